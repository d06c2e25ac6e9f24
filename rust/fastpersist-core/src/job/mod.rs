//! A write job: stage source bytes into pool slots (checksumming each chunk while it is hot)
//! and drive a backend until every part file holds its range of the logical stream.
//!
//! * [`source`](SourceRegion): what the job reads, and the walk over the extents of a range;
//! * [`progress`](JobProgress): counters, cancellation and the moments callers wait for;
//! * [`guard`](Guard): the mutation guard's early copies and staging reports;
//! * [`crc32_fields`](Crc32Field): CRC-32s of stream ranges written into the stream (zip records);
//! * `from_pool`: the [`OpSource`](crate::backend::OpSource) of a save with host sources: it
//!   copies the stream's bytes into pool slots and hands them to the backend as writes;
//! * `from_arena`: the job of a save with device sources, staged into its arena and written
//!   straight from there (`arena_writes`: a window's writes and their checksum threads);
//! * [`memory`](is_memory_fs), the in-memory level in one folder: targets on tmpfs/ramfs,
//!   written through kept mappings of the files (`memory/mapped`), and a device job whose arena
//!   is its one file there, checksummed only (`memory/in_place`);
//! * here: the job itself (open the files, drive the backend, finish the files, report).

mod arena_writes;
mod crc32_fields;
mod from_arena;
mod from_pool;
mod guard;
mod memory;
mod progress;
pub(crate) mod source;

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::DIRECT_ALIGN_BYTES;
use crate::arena::ArenaLease;
use crate::backend::{self, Direction, OpenFile};
use crate::error::{Error, Result};
use crate::plan::{Part, Plan};
use crate::pool::Pool;
use crate::probe::{BackendKind, DirectMode};

pub use crc32_fields::{CRC32_FIELD_BYTES, Crc32Field};
use from_pool::Staging;
pub use guard::{Guard, StagingObserver};
pub use memory::{FileAhead, is_memory_fs, writes_in_memory};
pub use progress::{JobProgress, WriteGate};
pub use source::{CopyPiece, DeviceCopier, SourceRegion};

/// Knobs of one write job.
#[derive(Debug, Clone)]
pub struct WriteOptions {
    /// The backend (already resolved by [`crate::probe::select`]).
    pub backend: BackendKind,
    /// O_DIRECT policy.
    pub direct: DirectMode,
    /// Writes in flight.
    pub queue_depth: usize,
    /// Compute per-chunk crc32c.
    pub checksum: bool,
    /// fsync every data file before returning.
    pub durable: bool,
    /// Threads that copy and checksum host bytes into staging at once, the job's own thread
    /// among them (1: that thread alone); see `from_pool`.
    pub staging_threads: usize,
}

/// One file to write: a part of the plan and where it goes.
#[derive(Debug, Clone)]
pub struct WriteTarget {
    /// The part.
    pub part: Part,
    /// The file to create (its directory must exist).
    pub path: PathBuf,
}

/// What was written to one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartReport {
    /// The file.
    pub path: PathBuf,
    /// Its logical length.
    pub len_bytes: u64,
    /// crc32c of each chunk (empty when checksums are off).
    pub chunk_crc32c: Vec<u32>,
    /// Whether it was written with O_DIRECT.
    pub direct: bool,
}

/// What a job wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteReport {
    /// Per file, in target order.
    pub parts: Vec<PartReport>,
    /// Logical bytes written.
    pub bytes_written: u64,
}

/// Optional participants in a write job.
#[derive(Default)]
pub struct JobHooks {
    /// The mutation guard.
    pub guard: Option<Guard>,
    /// Stages [`SourceRegion::device`] extents into `arena`; required when there are any.
    pub device: Option<Box<dyn DeviceCopier>>,
    /// The staging memory of a save with device sources: its chunks are staged here and
    /// written straight from here (required with `device`; host sources then go here too).
    pub arena: Option<ArenaLease>,
    /// Holds the writes back until opened (with `arena` only): the job stages, releases its
    /// sources, and waits for the gate before its first write.
    pub write_gate: Option<std::sync::Arc<WriteGate>>,
    /// CRC-32 fields filled in while staging (the job must then write the whole stream).
    pub crc32_fields: Vec<Crc32Field>,
}

impl std::fmt::Debug for JobHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobHooks")
            .field("guard", &self.guard)
            .field("device", &self.device.is_some())
            .field("arena", &self.arena)
            .field("write_gate", &self.write_gate)
            .field("crc32_fields", &self.crc32_fields.len())
            .finish()
    }
}

/// The ways a job stages its bytes, chosen once per job by [`StagingMode::choose`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StagingMode {
    /// Host sources are copied chunk by chunk into pool slots, each slot written by the
    /// backend (`from_pool`).
    Pool,
    /// Host sources are copied straight into mappings of the files' pages: every target is a
    /// regular file on a memory filesystem, one at least holds data in pages allocated already
    /// (a recycled file, overwritten in place) and O_DIRECT was not required (`memory`). New
    /// files there go through the pool: writes allocate their pages as they copy, on the
    /// backend's workers, 1.3-1.6x faster than reserving them and populating a new mapping
    /// first (1 GiB to fresh /dev/shm files: 0.70-0.91 s against 1.12-1.18 s).
    MappedFiles,
    /// Chunks are staged window by window into the job's arena (device copies asked for per
    /// window) and written straight from there (`from_arena`); a write gate may hold the writes.
    Arena,
    /// The arena is the job's one data file on a memory filesystem: staging is the write, and
    /// only the checksums remain (`in_place`).
    InPlace,
}

impl StagingMode {
    /// How a job of `targets` with `hooks` stages: through an arena when it has one (in place
    /// when the arena is the one target's file), else through the pool, or the files' own pages
    /// on a memory filesystem. Device sources and a write gate need an arena.
    pub fn choose(
        targets: &[WriteTarget],
        options: &WriteOptions,
        hooks: &JobHooks,
    ) -> Result<Self> {
        if let Some(arena) = hooks.arena.as_ref() {
            return Ok(if from_arena::is_in_place(arena, targets)? {
                StagingMode::InPlace
            } else {
                StagingMode::Arena
            });
        }
        if hooks.device.is_some() || hooks.write_gate.is_some() {
            return Err(Error::InvalidArgument(
                "a job with a device copier or a write gate stages through an arena: none was given".into(),
            ));
        }
        let paths: Vec<&Path> = targets.iter().map(|t| t.path.as_path()).collect();
        Ok(
            if memory::writes_in_memory(&paths, options.direct, options.backend)
                && memory::any_whole(&paths)
            {
                StagingMode::MappedFiles
            } else {
                StagingMode::Pool
            },
        )
    }
}

/// What every write job works from (its sources and hooks are moved into it separately).
#[derive(Debug, Clone, Copy)]
pub(super) struct JobContext<'a> {
    pub plan: &'a Plan,
    pub targets: &'a [WriteTarget],
    pub pool: &'a Pool,
    pub options: &'a WriteOptions,
    pub progress: &'a JobProgress,
}

/// Lets every waiter go when the job returns, whatever happened: the sources were moved into
/// the job and are dropped with it, so nothing reads them after.
struct ReleasedOnReturn<'p>(&'p JobProgress);

impl Drop for ReleasedOnReturn<'_> {
    fn drop(&mut self) {
        if self.0.sources_released_after().is_none() {
            self.0.mark_sources_released();
        }
    }
}

/// Writes `targets` (parts of `plan`) from `sources` (one region per plan extent).
///
/// The sources are read only until `progress` reports them released, which happens as soon as
/// the last chunk is staged (or the job fails); the rest of the job touches only pool memory.
pub fn write_parts(
    plan: &Plan,
    targets: &[WriteTarget],
    sources: Vec<SourceRegion>,
    pool: &Pool,
    options: &WriteOptions,
    progress: &JobProgress,
) -> Result<WriteReport> {
    write_parts_with(
        plan,
        targets,
        sources,
        pool,
        options,
        progress,
        JobHooks::default(),
    )
}

/// [`write_parts`] with [`JobHooks`]. A mutation [`Guard`]: the extents it names are copied
/// first, and the guard's observer hears when each other watched extent is staged whole, so it
/// can check that its source had not changed before then (and fail the job if it had). A
/// [`DeviceCopier`] and an arena: the job stages through the arena, window by window, the
/// device copies of a window asked for at once (`from_arena`).
pub fn write_parts_with(
    plan: &Plan,
    targets: &[WriteTarget],
    sources: Vec<SourceRegion>,
    pool: &Pool,
    options: &WriteOptions,
    progress: &JobProgress,
    hooks: JobHooks,
) -> Result<WriteReport> {
    let _released = ReleasedOnReturn(progress);
    let job = JobContext {
        plan,
        targets,
        pool,
        options,
        progress,
    };
    let (crcs, direct) = match StagingMode::choose(targets, options, &hooks)? {
        mode @ (StagingMode::Arena | StagingMode::InPlace) => {
            from_arena::write(job, sources, hooks, mode == StagingMode::InPlace)?
        }
        mode @ (StagingMode::Pool | StagingMode::MappedFiles) => {
            write_from_pool(job, sources, hooks, mode == StagingMode::MappedFiles)?
        }
    };
    let parts = targets
        .iter()
        .zip(crcs)
        .zip(direct)
        .map(|((target, chunk_crc32c), direct)| PartReport {
            path: target.path.clone(),
            len_bytes: target.part.len_bytes,
            chunk_crc32c: if options.checksum {
                chunk_crc32c
            } else {
                Vec::new()
            },
            direct,
        })
        .collect();
    Ok(WriteReport {
        parts,
        bytes_written: targets.iter().map(|t| t.part.len_bytes).sum(),
    })
}

/// The job of host sources: staged chunk by chunk into pool slots (`from_pool`), or straight
/// into the files' pages on a memory filesystem (`in_memory`: `memory`). Returns the chunk
/// checksums per file and whether each file was written with O_DIRECT.
fn write_from_pool(
    job: JobContext<'_>,
    sources: Vec<SourceRegion>,
    hooks: JobHooks,
    in_memory: bool,
) -> Result<(Vec<Vec<u32>>, Vec<bool>)> {
    let JobContext {
        targets,
        options,
        progress,
        ..
    } = job;
    let staging = Staging::new(job, sources, hooks);
    progress.mark_copied_early();
    let mut staging = staging?;
    let result = (|| {
        if in_memory {
            memory::write_mapped(&mut staging, targets, options.durable)?;
            progress.check_cancelled("after its data was written")?;
            return Ok(vec![false; targets.len()]);
        }
        // The null sink moves no bytes, so nothing is reserved for them either.
        let reserve = options.backend != BackendKind::Null;
        let files = open_targets(targets, options.direct, reserve)?;
        staging.direct = files.iter().map(|f| f.direct).collect();
        backend::drive(
            options.backend,
            Direction::Write,
            &files,
            options.queue_depth,
            &mut staging,
        )?;
        finish_files(&files, targets, options.durable)?;
        // Every chunk may be on disk already, but a cancelled job must not report success.
        progress.check_cancelled("after its data was written")?;
        Ok(files.iter().map(|f| f.direct).collect::<Vec<_>>())
    })();
    staging.release_sources();
    let direct = result?;
    Ok((std::mem::take(&mut staging.crcs), direct))
}

fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

pub(super) fn open_targets(
    targets: &[WriteTarget],
    direct: DirectMode,
    reserve: bool,
) -> Result<Vec<OpenFile>> {
    let mut decided: Vec<(PathBuf, bool)> = Vec::new();
    let mut files = Vec::with_capacity(targets.len());
    for target in targets {
        let dir = parent_dir(&target.path);
        let use_direct = match decided.iter().find(|(d, _)| d == dir) {
            Some((_, yes)) => *yes,
            None => {
                let yes = direct.resolve(dir)?;
                decided.push((dir.to_path_buf(), yes));
                yes
            }
        };
        let flags = libc::O_CLOEXEC | if use_direct { libc::O_DIRECT } else { 0 };
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .custom_flags(flags)
            .open(&target.path)
            .map_err(|e| Error::io("create", &target.path, e))?;
        // Writes inside the file's size run in parallel on ext4; a full disk fails here.
        if reserve {
            crate::durable::preallocate(&file, target.part.len_bytes)
                .map_err(|e| Error::io("preallocate", &target.path, e))?;
        }
        files.push(OpenFile {
            file,
            path: target.path.clone(),
            direct: use_direct,
        });
    }
    Ok(files)
}

pub(super) fn finish_files(
    files: &[OpenFile],
    targets: &[WriteTarget],
    durable: bool,
) -> Result<()> {
    for (file, target) in files.iter().zip(targets) {
        let len = target.part.len_bytes;
        // O_DIRECT wrote the tail padded to the alignment: cut it back to the logical length.
        if file.direct && len % DIRECT_ALIGN_BYTES as u64 != 0 {
            file.file
                .set_len(len)
                .map_err(|e| Error::io("truncate", &file.path, e))?;
        }
        if durable {
            file.file
                .sync_all()
                .map_err(|e| Error::io("fsync", &file.path, e))?;
        }
    }
    Ok(())
}
