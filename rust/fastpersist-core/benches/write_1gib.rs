//! Writing 1 GiB from memory with O_DIRECT through `write_parts`, on each backend.
//!
//! Only the write and its fsync are timed (`iter_custom`); creating the source, deleting the
//! previous file and warming the pool are not. Files go under `FASTPERSIST_BENCH_DIR` (default:
//! Cargo's per-benchmark temporary directory inside `target/`), which must accept O_DIRECT.
//!
//! ```text
//! FASTPERSIST_BENCH_DIR=/mnt/nvme cargo bench -p fastpersist-core --bench write_1gib
//! ```

use std::path::PathBuf;
use std::time::{Duration, Instant};

use criterion::{Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use fastpersist_core::job::{JobProgress, SourceRegion, WriteOptions, WriteTarget, write_parts};
use fastpersist_core::plan::Plan;
use fastpersist_core::pool::Pool;
use fastpersist_core::probe::{self, BackendKind, DirectMode};

const TOTAL_BYTES: usize = 1 << 30;
const CHUNK_BYTES: u64 = 8 << 20;
const QUEUE_DEPTH: usize = 8;
const POOL_BYTES: usize = 64 << 20;

fn bench_dir() -> PathBuf {
    let dir = std::env::var_os("FASTPERSIST_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("write_1gib"));
    std::fs::create_dir_all(&dir).expect("create the benchmark directory");
    dir
}

fn backends() -> Vec<BackendKind> {
    let mut kinds = vec![BackendKind::IoUring, BackendKind::Threads];
    if let Err(why) = probe::uring_status() {
        eprintln!("skipping io_uring: {why}");
        kinds.retain(|k| *k != BackendKind::IoUring);
    }
    kinds
}

fn write_1gib(c: &mut Criterion) {
    let dir = bench_dir();
    // Non-zero, fully touched source memory (no page faults inside the timed region).
    let source: Vec<u8> = (0..TOTAL_BYTES).map(|i| (i % 251) as u8 + 1).collect();
    let plan = Plan::new(&[TOTAL_BYTES as u64], 1, 1, CHUNK_BYTES).expect("plan");
    let part = plan.parts[0];
    let path = dir.join("write_1gib.bin");

    let mut group = c.benchmark_group("write_1gib");
    group
        .throughput(Throughput::Bytes(TOTAL_BYTES as u64))
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(8));

    for backend in backends() {
        let options = WriteOptions {
            backend,
            direct: DirectMode::Require,
            queue_depth: QUEUE_DEPTH,
            checksum: true,
            durable: true,
            staging_threads: 1,
        };
        // One pool per backend, reused across iterations like a trainer reuses it across saves.
        let pool = Pool::new(CHUNK_BYTES as usize, POOL_BYTES);
        group.bench_function(backend.name(), |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let _ = std::fs::remove_file(&path);
                    let targets = [WriteTarget {
                        part,
                        path: path.clone(),
                    }];
                    let progress = JobProgress::default();
                    let start = Instant::now();
                    let report = write_parts(
                        &plan,
                        &targets,
                        // SAFETY: `source` outlives the write_parts call, which returns after the job.
                        vec![unsafe { SourceRegion::from_slice(&source) }],
                        &pool,
                        &options,
                        &progress,
                    )
                    .unwrap_or_else(|e| {
                        panic!("{e} (set FASTPERSIST_BENCH_DIR to a directory on a disk)")
                    });
                    timed += start.elapsed();
                    assert_eq!(report.bytes_written, TOTAL_BYTES as u64);
                }
                timed
            });
        });
    }
    group.finish();
    let _ = std::fs::remove_file(&path);
}

criterion_group!(benches, write_1gib);
criterion_main!(benches);
