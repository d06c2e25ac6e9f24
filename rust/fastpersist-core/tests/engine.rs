//! Real files, both backends, O_DIRECT on and off: write a plan and read it back.

mod common;

use std::path::{Path, PathBuf};

use common::{expected_stream, pseudo_random};

use fastpersist_core::align::AlignedBuf;
use fastpersist_core::error::Error;
use fastpersist_core::job::{JobProgress, SourceRegion, WriteOptions, WriteTarget, write_parts};
use fastpersist_core::plan::Plan;
use fastpersist_core::pool::Pool;
use fastpersist_core::probe::{self, BackendKind, DirectMode};
use fastpersist_core::read::{ReadOptions, ReadPart, read_parts};

const CHUNK: u64 = 64 << 10;

fn backends() -> Vec<BackendKind> {
    let mut kinds = vec![BackendKind::Threads];
    match probe::uring_status() {
        Ok(()) => kinds.push(BackendKind::IoUring),
        // Skip, don't fail, where the kernel or a sandbox blocks io_uring.
        Err(why) => eprintln!("skipping io_uring: {why}"),
    }
    kinds
}

struct Written {
    plan: Plan,
    parts: Vec<ReadPart>,
    stream: Vec<u8>,
}

fn write_all(
    dirs: &[PathBuf],
    sizes: &[usize],
    writers: usize,
    backend: BackendKind,
    direct: DirectMode,
) -> Written {
    let data: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| pseudo_random(n, i as u64 + 1))
        .collect();
    let lens: Vec<u64> = sizes.iter().map(|&n| n as u64).collect();
    let plan = Plan::new(&lens, writers, dirs.len(), CHUNK).unwrap();
    // More slots than writes in flight, so chunks are also staged ahead while the queue is full.
    let pool = Pool::new(CHUNK as usize, 12 * CHUNK as usize);
    let options = WriteOptions {
        backend,
        direct,
        queue_depth: 4,
        checksum: true,
        durable: true,
        staging_threads: 1,
    };
    let mut parts = Vec::new();
    for writer in 0..writers {
        let targets: Vec<WriteTarget> = plan
            .parts_of_writer(writer)
            .map(|p| WriteTarget {
                part: *p,
                path: dirs[p.stripe].join(format!("w{}-s{}.bin", p.writer, p.stripe)),
            })
            .collect();
        let sources = data
            .iter()
            // SAFETY: `data` outlives the write_parts call below, which returns after the job.
            .map(|d| unsafe { SourceRegion::from_slice(d) })
            .collect();
        let progress = JobProgress::default();
        let report = write_parts(&plan, &targets, sources, &pool, &options, &progress).unwrap();
        assert!(progress.sources_released_after().is_some());
        assert_eq!(progress.written_bytes(), report.bytes_written);
        for (target, part) in targets.iter().zip(&report.parts) {
            assert_eq!(
                std::fs::metadata(&part.path).unwrap().len(),
                target.part.len_bytes
            );
            assert_eq!(
                part.chunk_crc32c.len() as u64,
                fastpersist_core::plan::chunk_count(target.part.len_bytes, CHUNK)
            );
            if direct == DirectMode::Off {
                assert!(!part.direct);
            }
            parts.push(ReadPart::whole(
                part.path.clone(),
                part.len_bytes,
                target.part.stream_offset_bytes,
                part.chunk_crc32c.clone(),
            ));
        }
    }
    let stream = expected_stream(&plan, &data);
    Written {
        plan,
        parts,
        stream,
    }
}

fn read_back(w: &Written, backend: BackendKind, direct: DirectMode) -> Result<Vec<u8>, Error> {
    let mut dest = AlignedBuf::zeroed(w.plan.total_bytes as usize);
    let options = ReadOptions {
        backend,
        direct,
        queue_depth: 4,
        chunk_bytes: CHUNK,
    };
    read_parts(&w.parts, &mut dest, &options)?;
    Ok(dest[..w.plan.total_bytes as usize].to_vec())
}

fn cases() -> Vec<Vec<usize>> {
    vec![
        vec![0],
        vec![1],
        vec![4095],
        vec![4097],
        (0..300).map(|i| (i * 37) % 700).collect(),
        vec![5 * CHUNK as usize + 3],
        vec![3, CHUNK as usize * 2, 0, 4096, 1, 100_000],
    ]
}

fn stripe_dirs(root: &Path, count: usize) -> Vec<PathBuf> {
    (0..count)
        .map(|i| {
            let d = root.join(format!("stripe{i}"));
            std::fs::create_dir_all(&d).unwrap();
            d
        })
        .collect()
}

#[test]
fn round_trip_both_backends_direct_on_and_off() {
    for backend in backends() {
        for direct in [DirectMode::Auto, DirectMode::Off] {
            for (writers, stripes) in [(1, 1), (2, 3)] {
                for sizes in cases() {
                    let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
                    let dirs = stripe_dirs(root.path(), stripes);
                    let written = write_all(&dirs, &sizes, writers, backend, direct);
                    for read_backend in backends() {
                        let got = read_back(&written, read_backend, direct).unwrap();
                        assert!(
                            got == written.stream,
                            "mismatch: {backend:?} -> {read_backend:?}, {direct:?}, sizes {:?}",
                            &sizes[..sizes.len().min(5)]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn read_stats_count_bytes_and_time_only_verified_chunks() {
    for backend in backends() {
        let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let dirs = stripe_dirs(root.path(), 2);
        let written = write_all(&dirs, &[1 << 20, 300_001], 1, backend, DirectMode::Auto);
        let options = ReadOptions {
            backend,
            direct: DirectMode::Auto,
            queue_depth: 4,
            chunk_bytes: CHUNK,
        };
        let total: u64 = written.parts.iter().map(|p| p.len_bytes).sum();
        let mut dest = AlignedBuf::zeroed(written.plan.total_bytes as usize);
        let verified = read_parts(&written.parts, &mut dest, &options).unwrap();
        assert_eq!(verified.bytes, total);
        assert!(
            verified.crc32c_ns > 0,
            "{backend:?}: checksums were checked but not timed"
        );
        let unverified_parts: Vec<ReadPart> = written
            .parts
            .iter()
            .cloned()
            .map(|mut p| {
                p.chunk_crc32c.clear();
                p
            })
            .collect();
        let unverified = read_parts(&unverified_parts, &mut dest, &options).unwrap();
        assert_eq!((unverified.bytes, unverified.crc32c_ns), (total, 0));
    }
}

#[test]
fn a_destination_large_enough_to_be_prefaulted_reads_back_exactly() {
    // Past the read job's prefault threshold (32 MiB): a second thread faults the destination
    // in ahead of the reads while they land in it.
    for backend in backends() {
        let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let dirs = stripe_dirs(root.path(), 2);
        let written = write_all(&dirs, &[40 << 20, 3 << 20], 2, backend, DirectMode::Auto);
        let got = read_back(&written, backend, DirectMode::Auto).unwrap();
        assert!(
            got == written.stream,
            "{backend:?}: mismatch after a prefaulted read"
        );
    }
}

#[test]
fn direct_io_is_used_where_supported() {
    let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    if !probe::direct_io_supported(root.path()).unwrap() {
        eprintln!("skipping: {} refuses O_DIRECT", root.path().display());
        return;
    }
    let dirs = stripe_dirs(root.path(), 1);
    let written = write_all(
        &dirs,
        &[100_003],
        1,
        BackendKind::Threads,
        DirectMode::Require,
    );
    assert_eq!(written.parts.len(), 1);
}

#[test]
fn corruption_and_truncation_are_detected() {
    for backend in backends() {
        let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let dirs = stripe_dirs(root.path(), 1);
        let written = write_all(&dirs, &[300_000], 1, backend, DirectMode::Auto);
        let path = &written.parts[0].path;
        let mut bytes = std::fs::read(path).unwrap();
        bytes[200_000] ^= 0x10;
        std::fs::write(path, &bytes).unwrap();
        match read_back(&written, backend, DirectMode::Auto) {
            Err(Error::ChecksumMismatch {
                offset_bytes,
                len_bytes,
                ..
            }) => {
                assert!(offset_bytes <= 200_000 && 200_000 < offset_bytes + len_bytes);
            }
            other => panic!("expected a checksum mismatch, got {other:?}"),
        }
        bytes.truncate(1000);
        std::fs::write(path, &bytes).unwrap();
        assert!(matches!(
            read_back(&written, backend, DirectMode::Auto),
            Err(Error::SizeMismatch { .. })
        ));
    }
}

#[test]
fn corruption_is_detected_by_the_checksum_thread_of_a_large_read() {
    // Past 32 MiB of verified bytes the checksums are checked on a thread of their own: a bad
    // chunk still fails the read with its file and byte range, and stops it early.
    for backend in backends() {
        let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let dirs = stripe_dirs(root.path(), 1);
        let written = write_all(&dirs, &[48 << 20], 1, backend, DirectMode::Auto);
        let path = &written.parts[0].path;
        let mut bytes = std::fs::read(path).unwrap();
        let damaged = (20 << 20) + 12_345;
        bytes[damaged] ^= 0x01;
        std::fs::write(path, &bytes).unwrap();
        match read_back(&written, backend, DirectMode::Auto) {
            Err(Error::ChecksumMismatch {
                path: reported,
                offset_bytes,
                len_bytes,
                ..
            }) => {
                assert_eq!(&reported, path);
                assert_eq!(len_bytes, CHUNK);
                assert!(
                    offset_bytes <= damaged as u64 && (damaged as u64) < offset_bytes + len_bytes
                );
            }
            other => panic!("{backend:?}: expected a checksum mismatch, got {other:?}"),
        }
    }
}

#[test]
fn os_errors_keep_errno_and_path() {
    for backend in backends() {
        let missing = PathBuf::from("/nonexistent-dir-fastpersist/x.bin");
        let plan = Plan::new(&[10], 1, 1, CHUNK).unwrap();
        let pool = Pool::new(CHUNK as usize, 2 * CHUNK as usize);
        let data = [7u8; 10];
        let options = WriteOptions {
            backend,
            direct: DirectMode::Off,
            queue_depth: 2,
            checksum: true,
            durable: true,
            staging_threads: 1,
        };
        let targets = [WriteTarget {
            part: plan.parts[0],
            path: missing.clone(),
        }];
        let progress = JobProgress::default();
        let err = write_parts(
            &plan,
            &targets,
            // SAFETY: `data` outlives the write_parts call, which returns after the job.
            vec![unsafe { SourceRegion::from_slice(&data) }],
            &pool,
            &options,
            &progress,
        )
        .unwrap_err();
        match err {
            Error::Io { path, source, .. } => {
                assert_eq!(source.raw_os_error(), Some(libc::ENOENT));
                assert_eq!(path, missing);
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(
            progress.sources_released_after().is_some(),
            "sources released on failure"
        );
    }
}

#[test]
fn pool_is_bounded_and_reused_across_jobs() {
    let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let dirs = stripe_dirs(root.path(), 1);
    let pool = Pool::new(CHUNK as usize, 3 * CHUNK as usize);
    let data = pseudo_random(20 * CHUNK as usize, 9);
    let plan = Plan::new(&[data.len() as u64], 1, 1, CHUNK).unwrap();
    for backend in backends() {
        for round in 0..3 {
            let targets = [WriteTarget {
                part: plan.parts[0],
                path: dirs[0].join(format!("r{round}.bin")),
            }];
            let options = WriteOptions {
                backend,
                direct: DirectMode::Auto,
                queue_depth: 8,
                checksum: false,
                durable: false,
                staging_threads: 1,
            };
            write_parts(
                &plan,
                &targets,
                // SAFETY: `data` outlives the write_parts call, which returns after the job.
                vec![unsafe { SourceRegion::from_slice(&data) }],
                &pool,
                &options,
                &JobProgress::default(),
            )
            .unwrap();
            assert_eq!(std::fs::read(&targets[0].path).unwrap(), data);
            assert_eq!(pool.allocated_bytes(), 3 * CHUNK as usize);
        }
    }
}

#[test]
fn cancelled_job_fails_and_releases_sources() {
    let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let dirs = stripe_dirs(root.path(), 1);
    let data = pseudo_random(10 * CHUNK as usize, 3);
    let plan = Plan::new(&[data.len() as u64], 1, 1, CHUNK).unwrap();
    let pool = Pool::new(CHUNK as usize, 2 * CHUNK as usize);
    let targets = [WriteTarget {
        part: plan.parts[0],
        path: dirs[0].join("c.bin"),
    }];
    let options = WriteOptions {
        backend: BackendKind::Threads,
        direct: DirectMode::Off,
        queue_depth: 2,
        checksum: true,
        durable: false,
        staging_threads: 1,
    };
    let progress = JobProgress::default();
    progress.cancel();
    let err = write_parts(
        &plan,
        &targets,
        // SAFETY: `data` outlives the write_parts call, which returns after the job.
        vec![unsafe { SourceRegion::from_slice(&data) }],
        &pool,
        &options,
        &progress,
    )
    .unwrap_err();
    assert!(matches!(err, Error::Cancelled(_)));
    assert!(progress.sources_released_after().is_some());
}

/// Writes `data` as one writer's part into `dir` with `backend`; returns the report.
fn write_one(
    dir: &Path,
    data: &[Vec<u8>],
    backend: BackendKind,
) -> fastpersist_core::job::WriteReport {
    let lens: Vec<u64> = data.iter().map(|d| d.len() as u64).collect();
    let plan = Plan::new(&lens, 1, 1, CHUNK).unwrap();
    let pool = Pool::new(CHUNK as usize, 4 * CHUNK as usize);
    let options = WriteOptions {
        backend,
        direct: DirectMode::Auto,
        queue_depth: 4,
        checksum: true,
        durable: true,
        staging_threads: 1,
    };
    let targets: Vec<WriteTarget> = plan
        .parts_of_writer(0)
        .map(|p| WriteTarget {
            part: *p,
            path: dir.join(format!("{backend:?}.bin")),
        })
        .collect();
    // SAFETY: `data` outlives the write_parts call below, which returns after the job.
    let sources = data
        .iter()
        .map(|d| unsafe { SourceRegion::from_slice(d) })
        .collect();
    write_parts(
        &plan,
        &targets,
        sources,
        &pool,
        &options,
        &JobProgress::default(),
    )
    .unwrap()
}

#[test]
fn the_null_sink_stages_and_checksums_every_chunk_but_writes_nothing() {
    let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let data: Vec<Vec<u8>> = [3 * CHUNK as usize + 100, 17, CHUNK as usize]
        .iter()
        .enumerate()
        .map(|(i, &n)| pseudo_random(n, i as u64 + 7))
        .collect();
    let real = write_one(root.path(), &data, BackendKind::Threads);
    let null = write_one(root.path(), &data, BackendKind::Null);
    assert_eq!(null.bytes_written, real.bytes_written);
    assert_eq!(null.parts[0].chunk_crc32c, real.parts[0].chunk_crc32c);
    // Nothing was reserved or written: at most the O_DIRECT tail truncation set a (sparse) size.
    let on_disk = std::fs::metadata(&null.parts[0].path).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(on_disk.blocks(), 0, "the null sink allocated blocks");
    let parts = [ReadPart::whole(
        null.parts[0].path.clone(),
        null.parts[0].len_bytes,
        0,
        null.parts[0].chunk_crc32c.clone(),
    )];
    let mut dest = AlignedBuf::zeroed(null.bytes_written as usize);
    let options = ReadOptions {
        backend: BackendKind::Null,
        direct: DirectMode::Auto,
        queue_depth: 4,
        chunk_bytes: CHUNK,
    };
    let refused = read_parts(&parts, &mut dest, &options).unwrap_err();
    assert!(matches!(refused, Error::InvalidArgument(_)), "{refused:?}");
}
