//! The job's hooks. The mutation guard's engine side: early copies of small watched extents,
//! one report per watched extent when its bytes are all staged, and a cancelled job that never
//! succeeds. The device copier: device-resident extents staged chunk by chunk, only the ranges
//! this writer writes.

use std::sync::{Arc, Mutex};

use fastpersist_core::error::{Error, Result};
use fastpersist_core::job::{
    DeviceCopier, Guard, JobHooks, JobProgress, SourceRegion, StagingObserver, WriteOptions,
    WriteTarget, write_parts, write_parts_with,
};
use fastpersist_core::plan::Plan;
use fastpersist_core::pool::Pool;
use fastpersist_core::probe::{BackendKind, DirectMode};

const CHUNK: u64 = 64 << 10;

/// Records what it is told; fails when it hears of `fail_on`.
struct Recorder {
    seen: Arc<Mutex<Vec<usize>>>,
    fail_on: Option<usize>,
}

impl StagingObserver for Recorder {
    fn extents_staged(&mut self, extents: &[usize]) -> Result<()> {
        self.seen.lock().unwrap().extend_from_slice(extents);
        if self.fail_on.is_some_and(|f| extents.contains(&f)) {
            return Err(Error::Cancelled(
                "extent changed before it was staged".into(),
            ));
        }
        Ok(())
    }
}

fn options() -> WriteOptions {
    WriteOptions {
        backend: BackendKind::Threads,
        direct: DirectMode::Off,
        queue_depth: 2,
        checksum: true,
        durable: false,
    }
}

struct Setup {
    _root: tempfile::TempDir,
    data: Vec<Vec<u8>>,
    plan: Plan,
    targets: Vec<WriteTarget>,
}

fn setup(sizes: &[usize], writers: usize, writer: usize) -> Setup {
    let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let data: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| vec![i as u8 + 1; n])
        .collect();
    let lens: Vec<u64> = sizes.iter().map(|&n| n as u64).collect();
    let plan = Plan::new(&lens, writers, 1, CHUNK).unwrap();
    let targets = plan
        .parts_of_writer(writer)
        .map(|p| WriteTarget {
            part: *p,
            path: root.path().join(format!("w{}.bin", p.writer)),
        })
        .collect();
    Setup {
        _root: root,
        data,
        plan,
        targets,
    }
}

fn regions(data: &mut [Vec<u8>]) -> Vec<SourceRegion> {
    data.iter()
        // SAFETY: every test keeps `data` alive until write_parts_guarded returns.
        .map(|d| unsafe { SourceRegion::new(d.as_ptr(), d.len()) })
        .collect()
}

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
        copy_max_extent_bytes: 1024,
        copy_budget_bytes: 1 << 20,
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
            device: None,
        },
    )
    .unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![1, 3]);
    assert!(progress.wait_copied_early(std::time::Duration::ZERO));
}

#[test]
fn early_copies_stop_at_the_budget_smallest_first() {
    let mut s = setup(&[300, 100, 200], 1, 0);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let guard = Guard {
        watched: vec![true, true, true],
        copy_max_extent_bytes: 1024,
        copy_budget_bytes: 300, // 100 + 200 fit; 300 does not
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
            device: None,
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
        copy_max_extent_bytes: 0,
        copy_budget_bytes: 0,
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
            device: None,
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
        copy_max_extent_bytes: 0,
        copy_budget_bytes: 0,
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
            device: None,
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
        copy_max_extent_bytes: 0,
        copy_budget_bytes: 0,
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
            device: None,
        },
    )
    .unwrap_err();
    assert!(matches!(err, Error::Cancelled(_)), "{err:?}");
}

/// A fake device: extent bytes live in vectors; records every copy it is asked for.
struct FakeDevice {
    memory: Vec<Vec<u8>>,
    copies: Arc<Mutex<Vec<(usize, u64, usize)>>>,
}

impl DeviceCopier for FakeDevice {
    fn copy_to_host(
        &mut self,
        extent: usize,
        offset_bytes: u64,
        slot: &mut [u8],
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        let dst = &mut slot[range];
        let start = offset_bytes as usize;
        dst.copy_from_slice(&self.memory[extent][start..start + dst.len()]);
        self.copies
            .lock()
            .unwrap()
            .push((extent, offset_bytes, dst.len()));
        Ok(())
    }
}

#[test]
fn device_extents_are_copied_chunk_by_chunk_and_only_this_writers_share() {
    // Host extent 0, device extents 1 and 2; two writers: writer 1 writes the back half.
    let sizes = [100, 3 * CHUNK as usize + 5, 2 * CHUNK as usize];
    for writer in 0..2 {
        let mut s = setup(&sizes, 2, writer);
        let device_memory: Vec<Vec<u8>> = s.data.clone();
        let copies = Arc::new(Mutex::new(Vec::new()));
        let mut sources = regions(&mut s.data);
        sources[1] = SourceRegion::device(sizes[1]);
        sources[2] = SourceRegion::device(sizes[2]);
        let hooks = JobHooks {
            guard: None,
            device: Some(Box::new(FakeDevice {
                memory: device_memory,
                copies: Arc::clone(&copies),
            })),
        };
        let pool = Pool::new(CHUNK as usize, 2 * CHUNK as usize);
        let report = write_parts_with(
            &s.plan,
            &s.targets,
            sources,
            &pool,
            &options(),
            &JobProgress::default(),
            hooks,
        )
        .unwrap();
        let copies = copies.lock().unwrap();
        assert!(
            copies.iter().all(|&(_, _, n)| n as u64 <= CHUNK),
            "{copies:?}"
        );
        let copied: usize = copies.iter().map(|c| c.2).sum();
        let part = &s.targets[0].part;
        let device_bytes_in_part: u64 = (1..3)
            .map(|i| {
                let (o, n) = (s.plan.extent_offsets[i], sizes[i] as u64);
                let (a, b) = (
                    o.max(part.stream_offset_bytes),
                    (o + n).min(part.stream_offset_bytes + part.len_bytes),
                );
                b.saturating_sub(a)
            })
            .sum();
        assert_eq!(
            copied as u64, device_bytes_in_part,
            "writer {writer} copies only its share"
        );
        let written = std::fs::read(&report.parts[0].path).unwrap();
        for (i, bytes) in s.data.iter().enumerate() {
            let (o, n) = (s.plan.extent_offsets[i], bytes.len() as u64);
            let (a, b) = (
                o.max(part.stream_offset_bytes),
                (o + n).min(part.stream_offset_bytes + part.len_bytes),
            );
            if a < b {
                let got = &written[(a - part.stream_offset_bytes) as usize
                    ..(b - part.stream_offset_bytes) as usize];
                assert_eq!(
                    got,
                    &bytes[(a - o) as usize..(b - o) as usize],
                    "extent {i}"
                );
            }
        }
    }
}

#[test]
fn device_extents_without_a_copier_are_refused() {
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
    fn copy_to_host(
        &mut self,
        extent: usize,
        _offset_bytes: u64,
        _slot: &mut [u8],
        _range: std::ops::Range<usize>,
    ) -> Result<()> {
        Err(Error::Hook {
            what: format!("copying extent {extent}"),
            source: Box::new(DeviceGone),
        })
    }
}

#[test]
fn a_hooks_own_error_reaches_the_caller_whole() {
    let s = setup(&[100], 1, 0);
    let pool = Pool::new(CHUNK as usize, 2 * CHUNK as usize);
    let progress = JobProgress::default();
    let err = write_parts_with(
        &s.plan,
        &s.targets,
        vec![SourceRegion::device(100)],
        &pool,
        &options(),
        &progress,
        JobHooks {
            guard: None,
            device: Some(Box::new(BrokenDevice)),
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
}

/// An asynchronous fake device: a copy runs only at `wait`, as a queued DMA completes later
/// (a job that read a slot before waiting would write stale bytes). Records, for each copy,
/// its stream offset and how many bytes the job had staged when it was asked for.
struct LazyDevice {
    memory: Vec<u8>,
    /// (address in the slot, length, offset in the extent) of each copy not yet run.
    pending: Vec<(usize, usize, usize)>,
    progress: Arc<JobProgress>,
    asked: Arc<Mutex<Vec<(u64, u64)>>>,
}

impl DeviceCopier for LazyDevice {
    fn copy_to_host(
        &mut self,
        _extent: usize,
        offset_bytes: u64,
        slot: &mut [u8],
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        let len = range.len();
        let address = slot[range].as_mut_ptr() as usize;
        self.pending.push((address, len, offset_bytes as usize));
        self.asked
            .lock()
            .unwrap()
            .push((offset_bytes, self.progress.staged_bytes()));
        Ok(())
    }

    fn wait(&mut self) -> Result<()> {
        for (address, len, offset) in self.pending.drain(..) {
            // SAFETY: DeviceCopier's contract: the job keeps the slot, and touches none of it,
            // until `wait` has returned; `address..address + len` was inside it when asked for.
            let dst = unsafe { std::slice::from_raw_parts_mut(address as *mut u8, len) };
            dst.copy_from_slice(&self.memory[offset..offset + len]);
        }
        Ok(())
    }
}

#[test]
fn the_next_chunks_device_copy_is_asked_for_before_the_current_chunk_is_checksummed() {
    let chunks = 6;
    let size = chunks * CHUNK as usize;
    let s = setup(&[size], 1, 0);
    let memory: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    let progress = Arc::new(JobProgress::default());
    let asked = Arc::new(Mutex::new(Vec::new()));
    let hooks = JobHooks {
        guard: None,
        device: Some(Box::new(LazyDevice {
            memory: memory.clone(),
            pending: Vec::new(),
            progress: Arc::clone(&progress),
            asked: Arc::clone(&asked),
        })),
    };
    let pool = Pool::new(CHUNK as usize, 8 * CHUNK as usize); // a free slot for every chunk
    let report = write_parts_with(
        &s.plan,
        &s.targets,
        vec![SourceRegion::device(size)],
        &pool,
        &options(),
        &progress,
        hooks,
    )
    .unwrap();
    let written = std::fs::read(&report.parts[0].path).unwrap();
    assert!(
        written == memory,
        "the job read a slot before its copy had run"
    );
    let crcs: Vec<u32> = written
        .chunks(CHUNK as usize)
        .map(fastpersist_core::checksum::crc32c)
        .collect();
    assert_eq!(report.parts[0].chunk_crc32c, crcs);
    let asked = asked.lock().unwrap();
    assert_eq!(asked.len(), chunks);
    for &(offset, staged) in asked.iter().skip(1) {
        // chunk k's copy was asked for while chunk k-1 was still to be checksummed
        assert_eq!(staged, offset - CHUNK, "{asked:?}");
    }
}

#[test]
fn a_failing_job_waits_for_the_copies_in_flight_before_it_lets_go_of_their_slot() {
    // A guard that fails on the first extent's report: the second extent's first chunk was
    // asked for ahead, into a slot of its own; the job must wait for it before that slot
    // goes back to the pool (a later save could be given it while the copy writes).
    let sizes = [CHUNK as usize, 2 * CHUNK as usize];
    let s = setup(&sizes, 1, 0);
    let memory: Vec<u8> = vec![7; 3 * CHUNK as usize];
    let progress = Arc::new(JobProgress::default());
    let asked = Arc::new(Mutex::new(Vec::new()));
    let waits = Arc::new(Mutex::new(0usize));
    struct Counted {
        inner: LazyDevice,
        waits: Arc<Mutex<usize>>,
    }
    impl DeviceCopier for Counted {
        fn copy_to_host(
            &mut self,
            extent: usize,
            offset_bytes: u64,
            slot: &mut [u8],
            range: std::ops::Range<usize>,
        ) -> Result<()> {
            self.inner.copy_to_host(extent, offset_bytes, slot, range)
        }
        fn wait(&mut self) -> Result<()> {
            *self.waits.lock().unwrap() += 1;
            self.inner.wait()
        }
    }
    let seen = Arc::new(Mutex::new(Vec::new()));
    let guard = Guard {
        watched: vec![true, false],
        copy_max_extent_bytes: 0,
        copy_budget_bytes: 0,
        observer: Box::new(Recorder {
            seen: Arc::clone(&seen),
            fail_on: Some(0),
        }),
    };
    let hooks = JobHooks {
        guard: Some(guard),
        device: Some(Box::new(Counted {
            inner: LazyDevice {
                memory,
                pending: Vec::new(),
                progress: Arc::clone(&progress),
                asked: Arc::clone(&asked),
            },
            waits: Arc::clone(&waits),
        })),
    };
    let pool = Pool::new(CHUNK as usize, 4 * CHUNK as usize);
    let err = write_parts_with(
        &s.plan,
        &s.targets,
        vec![
            SourceRegion::device(sizes[0]),
            SourceRegion::device(sizes[1]),
        ],
        &pool,
        &options(),
        &progress,
        hooks,
    )
    .unwrap_err();
    assert!(matches!(err, Error::Cancelled(_)), "{err:?}");
    assert_eq!(
        asked.lock().unwrap().len(),
        2,
        "the second chunk was asked for ahead"
    );
    assert_eq!(
        *waits.lock().unwrap(),
        2,
        "and waited for before the job let go of it"
    );
}
