//! The submit/complete loop (`backend::drive`), in bytes/s:
//!
//! * `driver_null/64KiB_ops`: the loop alone, against a disk that completes every op at once
//!   without a system call (the `bench_support` seam): the loop's overhead per op;
//! * `driver_devnull/{io_uring,threads}`: real submissions of 64 KiB writes to `/dev/null`: the
//!   backend's cost per op with no device behind it;
//! * `driver_file/{io_uring,threads}`: 8 MiB O_DIRECT writes (queue depth 8) of 512 MiB into a
//!   preallocated file, no fsync: the device path. Files go under `FASTPERSIST_BENCH_DIR`
//!   (default: Cargo's per-benchmark temporary directory inside `target/`), which must accept
//!   O_DIRECT.
//!
//! ```text
//! cargo bench -p fastpersist-core --bench driver
//! ```

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::time::Duration;

use criterion::{Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use fastpersist_core::Result;
use fastpersist_core::align::AlignedBuf;
use fastpersist_core::backend::bench_support::drive_null;
use fastpersist_core::backend::{Direction, IoBuf, IoOp, Next, OpSource, OpenFile, drive};
use fastpersist_core::probe::{self, BackendKind};

const SMALL_OP_BYTES: usize = 64 << 10;
const SMALL_TOTAL_BYTES: u64 = 256 << 20;
const FILE_OP_BYTES: usize = 8 << 20;
const FILE_TOTAL_BYTES: u64 = 512 << 20;
const QUEUE_DEPTH: usize = 8;

/// Hands out `total_bytes` of ops over a fixed set of buffers, reusing each when it completes.
struct Cycle<'a> {
    free: Vec<&'a mut [u8]>,
    op_bytes: usize,
    next_offset: u64,
    total_bytes: u64,
}

impl<'a> Cycle<'a> {
    fn new(mem: &'a mut [u8], op_bytes: usize, total_bytes: u64) -> Self {
        Cycle {
            free: mem.chunks_mut(op_bytes).collect(),
            op_bytes,
            next_offset: 0,
            total_bytes,
        }
    }
}

impl<'a> OpSource<'a> for Cycle<'a> {
    fn next_op(&mut self, _may_block: bool) -> Result<Next<'a>> {
        if self.next_offset >= self.total_bytes {
            return Ok(Next::Done);
        }
        let Some(buf) = self.free.pop() else {
            return Ok(Next::NotYet);
        };
        let offset_bytes = self.next_offset;
        self.next_offset += self.op_bytes as u64;
        Ok(Next::Op(IoOp {
            file: 0,
            offset_bytes,
            buf: IoBuf::Slice(buf),
            len_bytes: self.op_bytes,
            min_bytes: self.op_bytes,
            done_bytes: 0,
            chunk_index: 0,
        }))
    }

    fn completed(&mut self, op: IoOp<'a>) -> Result<()> {
        if let IoBuf::Slice(buf) = op.buf {
            self.free.push(buf);
        }
        Ok(())
    }
}

fn backends() -> Vec<BackendKind> {
    let mut kinds = vec![BackendKind::IoUring, BackendKind::Threads];
    if let Err(why) = probe::uring_status() {
        eprintln!("skipping io_uring: {why}");
        kinds.retain(|k| *k != BackendKind::IoUring);
    }
    kinds
}

fn open(path: PathBuf, file: File, direct: bool) -> [OpenFile; 1] {
    [OpenFile { file, path, direct }]
}

fn driver_null(c: &mut Criterion) {
    let files = open(
        PathBuf::from("/dev/null"),
        File::options()
            .write(true)
            .open("/dev/null")
            .expect("/dev/null"),
        false,
    );
    let mut mem = AlignedBuf::zeroed(SMALL_OP_BYTES * QUEUE_DEPTH);
    let mut group = c.benchmark_group("driver_null");
    group
        .throughput(Throughput::Bytes(SMALL_TOTAL_BYTES))
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    group.bench_function("64KiB_ops", |b| {
        b.iter(|| {
            let mut source = Cycle::new(&mut mem, SMALL_OP_BYTES, SMALL_TOTAL_BYTES);
            drive_null(&files, QUEUE_DEPTH, &mut source).expect("null drive");
        })
    });
    group.finish();
}

fn driver_devnull(c: &mut Criterion) {
    let files = open(
        PathBuf::from("/dev/null"),
        File::options()
            .write(true)
            .open("/dev/null")
            .expect("/dev/null"),
        false,
    );
    let mut mem = AlignedBuf::zeroed(SMALL_OP_BYTES * QUEUE_DEPTH);
    let mut group = c.benchmark_group("driver_devnull");
    group
        .throughput(Throughput::Bytes(SMALL_TOTAL_BYTES))
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    for backend in backends() {
        group.bench_function(backend.name(), |b| {
            b.iter(|| {
                let mut source = Cycle::new(&mut mem, SMALL_OP_BYTES, SMALL_TOTAL_BYTES);
                drive(backend, Direction::Write, &files, QUEUE_DEPTH, &mut source)
                    .expect("write to /dev/null");
            })
        });
    }
    group.finish();
}

fn bench_dir() -> PathBuf {
    let dir = std::env::var_os("FASTPERSIST_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("driver"));
    std::fs::create_dir_all(&dir).expect("create the benchmark directory");
    dir
}

fn driver_file(c: &mut Criterion) {
    let path = bench_dir().join("driver.bin");
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(&path)
        .unwrap_or_else(|e| panic!("{e}: set FASTPERSIST_BENCH_DIR to a directory on a disk"));
    fastpersist_core::durable::preallocate(&file, FILE_TOTAL_BYTES).expect("preallocate");
    let files = open(path.clone(), file, true);
    let mut mem = AlignedBuf::zeroed(FILE_OP_BYTES * QUEUE_DEPTH);
    mem.fill(0x5a);
    let mut group = c.benchmark_group("driver_file");
    group
        .throughput(Throughput::Bytes(FILE_TOTAL_BYTES))
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    for backend in backends() {
        group.bench_function(backend.name(), |b| {
            b.iter(|| {
                let mut source = Cycle::new(&mut mem, FILE_OP_BYTES, FILE_TOTAL_BYTES);
                drive(backend, Direction::Write, &files, QUEUE_DEPTH, &mut source)
                    .expect("O_DIRECT writes");
            })
        });
    }
    group.finish();
    drop(files);
    let _ = std::fs::remove_file(&path);
}

criterion_group!(benches, driver_null, driver_devnull, driver_file);
criterion_main!(benches);
