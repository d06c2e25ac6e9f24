//! A device save's job when something goes wrong: no copier or arena, a copier's own error, a
//! guard or a wait that fails with copies in flight; and when the sources are let go.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::device::{ThreadDevice, patterned};
use common::{CHUNK, Recorder, options, setup};
use fastpersist_core::arena::Arena;
use fastpersist_core::error::{Error, Result};
use fastpersist_core::job::{
    CopyPiece, DeviceCopier, Guard, JobHooks, JobProgress, SourceRegion, write_parts,
    write_parts_with,
};
use fastpersist_core::pool::Pool;

#[test]
fn device_extents_without_a_copier_or_an_arena_are_refused() {
    let s = setup(&[100], 1, 0);
    let pool = Pool::new(CHUNK as usize, 2 * CHUNK as usize);
    let err = write_parts(
        &s.plan,
        &s.targets,
        vec![SourceRegion::device(100)],
        &pool,
        &options(),
        &JobProgress::default(),
    )
    .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    let arena = Arena::new(1).unwrap();
    let progress = JobProgress::default();
    let err = write_parts_with(
        &s.plan,
        &s.targets,
        vec![SourceRegion::device(100)],
        &pool,
        &options(),
        &progress,
        JobHooks {
            arena: arena.try_lease(),
            ..JobHooks::default()
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("device copier"), "{err}");
    assert!(
        progress.wait_copied_early(Duration::ZERO),
        "save_async is let go"
    );
    assert!(!arena.is_leased());
}

/// A device whose copy fails with an error type of its own.
struct BrokenDevice;

#[derive(Debug)]
struct DeviceGone;

impl std::fmt::Display for DeviceGone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the device fell off the bus")
    }
}

impl std::error::Error for DeviceGone {}

impl DeviceCopier for BrokenDevice {
    fn copy(&mut self, pieces: &[CopyPiece]) -> Result<()> {
        Err(Error::Hook {
            what: format!("copying extent {}", pieces[0].extent),
            source: Box::new(DeviceGone),
        })
    }
}

#[test]
fn a_hooks_own_error_reaches_the_caller_whole() {
    let s = setup(&[100], 1, 0);
    let pool = Pool::new(CHUNK as usize, 2 * CHUNK as usize);
    let progress = JobProgress::default();
    let arena = Arena::new(1).unwrap();
    let err = write_parts_with(
        &s.plan,
        &s.targets,
        vec![SourceRegion::device(100)],
        &pool,
        &options(),
        &progress,
        JobHooks {
            device: Some(Box::new(BrokenDevice)),
            arena: arena.try_lease(),
            ..JobHooks::default()
        },
    )
    .unwrap_err();
    let Error::Hook { what, source } = &err else {
        panic!("expected the copier's error, got {err:?}");
    };
    assert_eq!(what, "copying extent 0");
    assert!(source.downcast_ref::<DeviceGone>().is_some(), "{source:?}");
    assert_eq!(
        err.to_string(),
        "copying extent 0: the device fell off the bus"
    );
    assert!(progress.sources_released_after().is_some());
    assert!(progress.wait_copied_early(Duration::ZERO));
}

#[test]
fn a_failing_job_waits_for_the_copies_in_flight_before_it_lets_go_of_the_arena() {
    // The guard fails on the first extent's report; the copies of the window were asked for
    // and must be waited for before the arena is free for another save.
    let sizes = [CHUNK as usize, 2 * CHUNK as usize];
    let s = setup(&sizes, 1, 0);
    let arena = Arena::new(1).unwrap();
    let progress = Arc::new(JobProgress::default());
    let mut device = ThreadDevice::new(patterned(&sizes), &arena, &progress);
    device.fail_wait = true;
    let seen = Arc::clone(&device.seen);
    let err = write_parts_with(
        &s.plan,
        &s.targets,
        vec![
            SourceRegion::device(sizes[0]),
            SourceRegion::device(sizes[1]),
        ],
        &Pool::new(CHUNK as usize, 2 * CHUNK as usize),
        &options(),
        &progress,
        JobHooks {
            device: Some(Box::new(device)),
            arena: arena.try_lease(),
            ..JobHooks::default()
        },
    )
    .unwrap_err();
    assert!(matches!(err, Error::Cancelled(_)), "{err:?}");
    assert_eq!(seen.lock().unwrap().waits, 1);
    assert!(!arena.is_leased());

    // The same with the guard failing after a successful wait: one wait, nothing in flight.
    let recorder_seen = Arc::new(Mutex::new(Vec::new()));
    let device = ThreadDevice::new(patterned(&sizes), &arena, &progress);
    let seen = Arc::clone(&device.seen);
    let err = write_parts_with(
        &s.plan,
        &s.targets,
        vec![
            SourceRegion::device(sizes[0]),
            SourceRegion::device(sizes[1]),
        ],
        &Pool::new(CHUNK as usize, 2 * CHUNK as usize),
        &options(),
        &Arc::new(JobProgress::default()),
        JobHooks {
            guard: Some(Guard {
                watched: vec![true, true],
                copy_early: Vec::new(),
                observer: Box::new(Recorder {
                    seen: Arc::clone(&recorder_seen),
                    fail_on: Some(0),
                }),
            }),
            device: Some(Box::new(device)),
            arena: arena.try_lease(),
            ..JobHooks::default()
        },
    )
    .unwrap_err();
    assert!(matches!(err, Error::Cancelled(_)), "{err:?}");
    assert_eq!(seen.lock().unwrap().waits, 1);
    assert_eq!(
        *recorder_seen.lock().unwrap(),
        vec![0, 1],
        "the guard hears of the whole window in one call"
    );
    assert!(!arena.is_leased());
}

#[test]
fn the_sources_are_released_only_after_the_copies_landed_and_the_guard_was_told() {
    let sizes = [3 * CHUNK as usize];
    let s = setup(&sizes, 1, 0);
    let arena = Arena::new(1).unwrap();
    let progress = Arc::new(JobProgress::default());
    struct Watching {
        inner: ThreadDevice,
        released_at_wait: Arc<AtomicBool>,
    }
    impl DeviceCopier for Watching {
        fn copy(&mut self, pieces: &[CopyPiece]) -> Result<()> {
            self.inner.copy(pieces)
        }
        fn wait(&mut self) -> Result<()> {
            let released = self.inner.progress.sources_released_after().is_some();
            self.released_at_wait.store(released, Ordering::SeqCst);
            self.inner.wait()
        }
    }
    let released_at_wait = Arc::new(AtomicBool::new(true));
    let told = Arc::new(Mutex::new(Vec::new()));
    let report = write_parts_with(
        &s.plan,
        &s.targets,
        vec![SourceRegion::device(sizes[0])],
        &Pool::new(CHUNK as usize, 2 * CHUNK as usize),
        &options(),
        &progress,
        JobHooks {
            guard: Some(Guard {
                watched: vec![true],
                copy_early: Vec::new(),
                observer: Box::new(Recorder {
                    seen: Arc::clone(&told),
                    fail_on: None,
                }),
            }),
            device: Some(Box::new(Watching {
                inner: ThreadDevice::new(patterned(&sizes), &arena, &progress),
                released_at_wait: Arc::clone(&released_at_wait),
            })),
            arena: arena.try_lease(),
            ..JobHooks::default()
        },
    )
    .unwrap();
    assert!(!released_at_wait.load(Ordering::SeqCst));
    assert_eq!(*told.lock().unwrap(), vec![0]);
    assert!(progress.sources_released_after().is_some());
    assert_eq!(report.bytes_written, sizes[0] as u64);
}
