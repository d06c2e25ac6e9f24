//! The job's hooks: the mutation guard's engine side (early copies of small watched extents,
//! one report per watched extent when its bytes are all staged, a cancelled job that never
//! succeeds). The device copier's tests are in device_hooks.rs.

mod common;

use std::sync::{Arc, Mutex};

use common::{CHUNK, Recorder, options, regions, setup};
use fastpersist_core::error::{Error, Result};
use fastpersist_core::job::{Guard, JobHooks, JobProgress, StagingObserver, write_parts_with};
use fastpersist_core::pool::Pool;

#[test]
fn every_watched_extent_is_reported_once_and_small_ones_are_copied_first() {
    // Extent 0 and 2 are small (copied at once, never reported), 1 and 3 are large.
    let mut s = setup(
        &[100, 5 * CHUNK as usize + 7, 200, 3 * CHUNK as usize],
        1,
        0,
    );
    let seen = Arc::new(Mutex::new(Vec::new()));
    let guard = Guard {
        watched: vec![true, true, true, true],
        copy_early: vec![0, 2],
        observer: Box::new(Recorder {
            seen: Arc::clone(&seen),
            fail_on: None,
        }),
    };
    let pool = Pool::new(CHUNK as usize, 2 * CHUNK as usize);
    let progress = JobProgress::default();
    let sources = regions(&mut s.data);
    write_parts_with(
        &s.plan,
        &s.targets,
        sources,
        &pool,
        &options(),
        &progress,
        JobHooks {
            guard: Some(guard),
            ..JobHooks::default()
        },
    )
    .unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![1, 3]);
    assert!(progress.wait_copied_early(std::time::Duration::ZERO));
}

#[test]
fn the_extents_named_are_copied_early_and_never_reported() {
    let mut s = setup(&[300, 100, 200], 1, 0);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let guard = Guard {
        watched: vec![true, true, true],
        copy_early: vec![2, 1],
        observer: Box::new(Recorder {
            seen: Arc::clone(&seen),
            fail_on: None,
        }),
    };
    let pool = Pool::new(CHUNK as usize, 2 * CHUNK as usize);
    let sources = regions(&mut s.data);
    let report = write_parts_with(
        &s.plan,
        &s.targets,
        sources,
        &pool,
        &options(),
        &JobProgress::default(),
        JobHooks {
            guard: Some(guard),
            ..JobHooks::default()
        },
    )
    .unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![0]);
    // The copies are what was written.
    let written = std::fs::read(&report.parts[0].path).unwrap();
    for (offset, bytes) in s.plan.extent_offsets.iter().zip(&s.data) {
        assert_eq!(
            &written[*offset as usize..*offset as usize + bytes.len()],
            &bytes[..]
        );
    }
}

#[test]
fn an_observer_error_fails_the_job() {
    let mut s = setup(&[2 * CHUNK as usize, 2 * CHUNK as usize], 1, 0);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let guard = Guard {
        watched: vec![true, true],
        copy_early: Vec::new(),
        observer: Box::new(Recorder {
            seen: Arc::clone(&seen),
            fail_on: Some(0),
        }),
    };
    let pool = Pool::new(CHUNK as usize, 8 * CHUNK as usize);
    let progress = JobProgress::default();
    let sources = regions(&mut s.data);
    let err = write_parts_with(
        &s.plan,
        &s.targets,
        sources,
        &pool,
        &options(),
        &progress,
        JobHooks {
            guard: Some(guard),
            ..JobHooks::default()
        },
    )
    .unwrap_err();
    assert!(matches!(err, Error::Cancelled(_)), "{err:?}");
    assert!(progress.sources_released_after().is_some());
}

#[test]
fn a_writer_hears_only_of_extents_it_writes() {
    // Two writers split 4 chunks; extent 0 lies in writer 0's half, extent 1 in writer 1's.
    let mut s = setup(&[2 * CHUNK as usize, 2 * CHUNK as usize], 2, 1);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let guard = Guard {
        watched: vec![true, true],
        copy_early: Vec::new(),
        observer: Box::new(Recorder {
            seen: Arc::clone(&seen),
            fail_on: Some(0),
        }),
    };
    let pool = Pool::new(CHUNK as usize, 4 * CHUNK as usize);
    let sources = regions(&mut s.data);
    write_parts_with(
        &s.plan,
        &s.targets,
        sources,
        &pool,
        &options(),
        &JobProgress::default(),
        JobHooks {
            guard: Some(guard),
            ..JobHooks::default()
        },
    )
    .unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![1]);
}

/// Cancels the job from inside the last report: every chunk is staged (and may be submitted)
/// by then, yet the job must fail.
struct CancelAtEnd {
    progress: Arc<JobProgress>,
}

impl StagingObserver for CancelAtEnd {
    fn extents_staged(&mut self, _extents: &[usize]) -> Result<()> {
        self.progress.cancel();
        Ok(())
    }
}

#[test]
fn a_job_cancelled_after_the_last_chunk_was_staged_still_fails() {
    let mut s = setup(&[3 * CHUNK as usize], 1, 0);
    let progress = Arc::new(JobProgress::default());
    let guard = Guard {
        watched: vec![true],
        copy_early: Vec::new(),
        observer: Box::new(CancelAtEnd {
            progress: Arc::clone(&progress),
        }),
    };
    let pool = Pool::new(CHUNK as usize, 8 * CHUNK as usize);
    let sources = regions(&mut s.data);
    let err = write_parts_with(
        &s.plan,
        &s.targets,
        sources,
        &pool,
        &options(),
        &progress,
        JobHooks {
            guard: Some(guard),
            ..JobHooks::default()
        },
    )
    .unwrap_err();
    assert!(matches!(err, Error::Cancelled(_)), "{err:?}");
}

#[test]
fn only_watched_host_extents_of_the_plan_can_be_copied_early() {
    for copy_early in [vec![5], vec![1]] {
        let mut s = setup(&[100, 100], 1, 0);
        let guard = Guard {
            watched: vec![true, false],
            copy_early,
            observer: Box::new(Recorder {
                seen: Arc::default(),
                fail_on: None,
            }),
        };
        let progress = JobProgress::default();
        let err = write_parts_with(
            &s.plan,
            &s.targets,
            regions(&mut s.data),
            &Pool::new(CHUNK as usize, 2 * CHUNK as usize),
            &options(),
            &progress,
            JobHooks {
                guard: Some(guard),
                ..JobHooks::default()
            },
        )
        .unwrap_err();
        assert!(err.to_string().contains("cannot be copied early"), "{err}");
        assert!(progress.wait_copied_early(std::time::Duration::ZERO));
    }
}
