//! CRC-32 fields (the record CRCs of a zip archive) filled in while a job stages its stream, on
//! every way a job writes: both backends, O_DIRECT on and off, and files on a memory filesystem.

mod common;

use std::path::PathBuf;

use common::{CHUNK, Setup, options, setup_with};

use fastpersist_core::checksum::crc32;
use fastpersist_core::error::Error;
use fastpersist_core::job::{
    Crc32Field, JobHooks, JobProgress, SourceRegion, WriteOptions, write_parts_with,
};
use fastpersist_core::pool::Pool;
use fastpersist_core::probe::{self, BackendKind, DirectMode};

/// Extents of `sizes` bytes with varied contents (a constant fill would hide a CRC of the wrong range).
fn setup(sizes: &[usize], writers: usize, writer: usize) -> Setup {
    let data = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            (0..n)
                .map(|k| (k as u8).wrapping_mul(31) ^ i as u8)
                .collect()
        })
        .collect();
    setup_with(data, writers, writer)
}

fn regions(data: &[Vec<u8>]) -> Vec<SourceRegion> {
    data.iter()
        // SAFETY: every test keeps `data` alive until write_parts_with returns.
        .map(|d| unsafe { SourceRegion::from_slice(d) })
        .collect()
}

/// Like a zip archive: two records, each CRC right after it (the first one straddling a chunk
/// boundary and overwriting the next extent's first bytes) and again in a trailing directory.
fn crc32_setup(writers: usize) -> (Setup, Vec<Crc32Field>) {
    let sizes = [2 * CHUNK as usize - 2, 100, 5000, 256];
    let s = setup(&sizes, writers, 0);
    let off = s.plan.extent_offsets.clone();
    let fields = vec![
        Crc32Field {
            start_bytes: off[0],
            len_bytes: sizes[0] as u64,
            write_at_bytes: vec![off[0] + sizes[0] as u64, off[3]],
        },
        Crc32Field {
            start_bytes: off[2],
            len_bytes: sizes[2] as u64,
            write_at_bytes: vec![off[2] + sizes[2] as u64, off[3] + 4],
        },
    ];
    (s, fields)
}

#[test]
fn crc32_fields_are_filled_in_on_every_backend_direct_or_not_and_on_a_memory_fs() {
    let mut ways: Vec<(BackendKind, DirectMode, bool)> = vec![];
    for backend in [BackendKind::Threads, BackendKind::IoUring] {
        if backend == BackendKind::IoUring && probe::uring_status().is_err() {
            continue; // blocked here (seccomp, kernel.io_uring_disabled): skipped, not failed
        }
        for direct in [DirectMode::Off, DirectMode::Auto] {
            ways.push((backend, direct, false));
        }
    }
    if std::path::Path::new("/dev/shm").is_dir() {
        ways.push((BackendKind::Threads, DirectMode::Auto, true));
    }
    for (backend, direct, shm) in ways {
        let (mut s, fields) = crc32_setup(1);
        let shm_dir = shm.then(|| tempfile::tempdir_in("/dev/shm").unwrap());
        if let Some(dir) = &shm_dir {
            s.targets[0].path = PathBuf::from(dir.path()).join("w0.bin");
        }
        let mut stream = vec![0u8; s.plan.total_bytes as usize];
        for (d, &at) in s.data.iter().zip(&s.plan.extent_offsets) {
            stream[at as usize..at as usize + d.len()].copy_from_slice(d);
        }
        for f in &fields {
            let (a, b) = (
                f.start_bytes as usize,
                (f.start_bytes + f.len_bytes) as usize,
            );
            let crc = crc32(&stream[a..b]).to_le_bytes();
            for &at in &f.write_at_bytes {
                stream[at as usize..at as usize + 4].copy_from_slice(&crc);
            }
        }
        let pool = Pool::new(CHUNK as usize, 2 * CHUNK as usize);
        let options = WriteOptions {
            backend,
            direct,
            ..options()
        };
        let sources = regions(&s.data);
        let hooks = JobHooks {
            crc32_fields: fields,
            ..JobHooks::default()
        };
        let progress = JobProgress::default();
        write_parts_with(
            &s.plan, &s.targets, sources, &pool, &options, &progress, hooks,
        )
        .unwrap();
        let written = std::fs::read(&s.targets[0].path).unwrap();
        assert!(written == stream, "{backend:?} {direct:?} shm={shm}");
    }
}

#[test]
fn crc32_fields_need_one_job_writing_the_whole_stream() {
    let (s, fields) = crc32_setup(2);
    let pool = Pool::new(CHUNK as usize, 2 * CHUNK as usize);
    let sources = regions(&s.data);
    let hooks = JobHooks {
        crc32_fields: fields,
        ..JobHooks::default()
    };
    let progress = JobProgress::default();
    let err = write_parts_with(
        &s.plan,
        &s.targets,
        sources,
        &pool,
        &options(),
        &progress,
        hooks,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("whole stream")),
        "{err}"
    );
}
