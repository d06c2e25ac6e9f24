//! The job's device copier: device-resident extents staged chunk by chunk, only the ranges
//! this writer writes; the next chunk's copies asked for before the current one is checksummed.

mod common;

use std::sync::{Arc, Mutex};

use common::{CHUNK, Recorder, options, regions, setup};
use fastpersist_core::error::{Error, Result};
use fastpersist_core::job::{
    DeviceCopier, Guard, JobHooks, JobProgress, SourceRegion, write_parts, write_parts_with,
};
use fastpersist_core::pool::Pool;

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
            crc32_fields: Vec::new(),
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
            crc32_fields: Vec::new(),
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
        crc32_fields: Vec::new(),
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
        crc32_fields: Vec::new(),
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
