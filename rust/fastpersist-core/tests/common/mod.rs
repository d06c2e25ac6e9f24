//! What the job-hook tests share: a small plan over temporary files and its source regions, and
//! (`device`) a fake device for the arena job's tests.

#![allow(dead_code)] // each test crate uses its own part of this

pub mod device;

use std::sync::{Arc, Mutex};

use fastpersist_core::error::{Error, Result};
use fastpersist_core::job::{SourceRegion, StagingObserver, WriteOptions, WriteTarget};
use fastpersist_core::plan::Plan;
use fastpersist_core::probe::{BackendKind, DirectMode};

pub const CHUNK: u64 = 64 << 10;

pub fn options() -> WriteOptions {
    WriteOptions {
        backend: BackendKind::Threads,
        direct: DirectMode::Off,
        queue_depth: 2,
        checksum: true,
        durable: false,
        staging_threads: 1,
    }
}

pub struct Setup {
    pub _root: tempfile::TempDir,
    pub data: Vec<Vec<u8>>,
    pub plan: Plan,
    pub targets: Vec<WriteTarget>,
}

/// A plan over extents of `sizes` bytes, each filled with its index + 1, and `writer`'s targets.
pub fn setup(sizes: &[usize], writers: usize, writer: usize) -> Setup {
    let data = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| vec![i as u8 + 1; n])
        .collect();
    setup_with(data, writers, writer)
}

/// A plan over the extents `data` and `writer`'s targets, in a fresh temporary directory.
pub fn setup_with(data: Vec<Vec<u8>>, writers: usize, writer: usize) -> Setup {
    let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let lens: Vec<u64> = data.iter().map(|d| d.len() as u64).collect();
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

pub fn regions(data: &mut [Vec<u8>]) -> Vec<SourceRegion> {
    data.iter()
        // SAFETY: every test keeps `data` alive until write_parts_guarded returns.
        .map(|d| unsafe { SourceRegion::new(d.as_ptr(), d.len()) })
        .collect()
}

/// Records what it is told; fails when it hears of `fail_on`.
pub struct Recorder {
    pub seen: Arc<Mutex<Vec<usize>>>,
    pub fail_on: Option<usize>,
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

/// `len` bytes of a xorshift sequence seeded by `seed` (no two extents alike).
pub fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The logical stream of `plan` over the extents `data`: each at its offset, zeros between.
pub fn expected_stream(plan: &Plan, data: &[Vec<u8>]) -> Vec<u8> {
    let mut stream = vec![0u8; plan.total_bytes as usize];
    for (off, bytes) in plan.extent_offsets.iter().zip(data) {
        stream[*off as usize..*off as usize + bytes.len()].copy_from_slice(bytes);
    }
    stream
}
