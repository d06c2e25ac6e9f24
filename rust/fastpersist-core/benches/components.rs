//! The pure-CPU pieces of a save, each reported in bytes/s (criterion `Throughput::Bytes`):
//!
//! * `plan/10000_extents`: `Plan::new` over 10,000 extents (bytes of stream planned per second);
//! * `crc32c/*`: the chunk checksum over a cache-resident 64 KiB buffer and an 8 MiB chunk;
//! * `staging/*`: the job's inner step, copying 8 MiB chunks of a 64 MiB source into aligned
//!   pool slots, with and without the crc32c computed over the hot bytes;
//! * `pool/acquire_release`: one slot checked out and returned (bytes of slot handed out per
//!   second; the cost per cycle is `slot_bytes / throughput`).
//!
//! ```text
//! cargo bench -p fastpersist-core --bench components
//! ```

use std::hint::black_box;
use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput, criterion_group, criterion_main};
use fastpersist_core::checksum::{Crc32c, crc32c};
use fastpersist_core::plan::Plan;
use fastpersist_core::pool::Pool;

const CHUNK_BYTES: usize = 8 << 20;
const SOURCE_BYTES: usize = 64 << 20;

fn short(group: &mut BenchmarkGroup<'_, WallTime>) {
    group
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
}

fn plan(c: &mut Criterion) {
    // Sizes of a transformer's state: many small vectors (norms, biases), some large matrices.
    let extents: Vec<u64> = (0..10_000u64)
        .map(|i| match i % 4 {
            0 => 4096 + i,
            1 => 1 << 20,
            2 => (3 << 20) + 17,
            _ => 513,
        })
        .collect();
    let planned = Plan::new(&extents, 8, 2, CHUNK_BYTES as u64).expect("plan");
    let mut group = c.benchmark_group("plan");
    short(&mut group);
    group.throughput(Throughput::Bytes(planned.total_bytes));
    group.bench_function("10000_extents", |b| {
        b.iter(|| Plan::new(black_box(&extents), 8, 2, CHUNK_BYTES as u64).expect("plan"))
    });
    group.finish();
}

fn source() -> Vec<u8> {
    (0..SOURCE_BYTES).map(|i| (i % 251) as u8 + 1).collect()
}

fn checksum(c: &mut Criterion) {
    let data = source();
    let mut group = c.benchmark_group("crc32c");
    short(&mut group);
    for len in [64 << 10, CHUNK_BYTES] {
        group.throughput(Throughput::Bytes(len as u64));
        group.bench_function(format!("{}KiB", len >> 10), |b| {
            b.iter(|| crc32c(black_box(&data[..len])))
        });
    }
    group.finish();
}

fn staging(c: &mut Criterion) {
    let data = source();
    // A pool smaller than the source, as in streaming mode: slots are reused chunk after chunk.
    let pool = Pool::new(CHUNK_BYTES, 4 * CHUNK_BYTES);
    let mut group = c.benchmark_group("staging");
    short(&mut group);
    group.throughput(Throughput::Bytes(SOURCE_BYTES as u64));
    for with_crc in [false, true] {
        let name = if with_crc { "copy_crc32c" } else { "copy" };
        group.bench_function(name, |b| {
            b.iter(|| {
                let mut crcs = Vec::with_capacity(SOURCE_BYTES / CHUNK_BYTES);
                for piece in data.chunks(CHUNK_BYTES) {
                    let mut slot = pool.try_acquire().expect("a free slot");
                    let dest = &mut slot.buf_mut()[..piece.len()];
                    dest.copy_from_slice(piece);
                    if with_crc {
                        let mut crc = Crc32c::default();
                        crc.update(dest);
                        crcs.push(crc.finish());
                    }
                    black_box(&slot);
                }
                crcs
            })
        });
    }
    group.finish();
}

fn pool(c: &mut Criterion) {
    let pool = Pool::new(CHUNK_BYTES, 4 * CHUNK_BYTES);
    // Allocate every slot once, outside the measurement (a trainer reuses its pool).
    let warm: Vec<_> = std::iter::from_fn(|| pool.try_acquire()).collect();
    drop(warm);
    let mut group = c.benchmark_group("pool");
    short(&mut group);
    group.throughput(Throughput::Bytes(pool.slot_bytes() as u64));
    group.bench_function("acquire_release", |b| {
        b.iter(|| black_box(pool.try_acquire().expect("a free slot")).index())
    });
    group.finish();
}

criterion_group!(benches, plan, checksum, staging, pool);
criterion_main!(benches);
