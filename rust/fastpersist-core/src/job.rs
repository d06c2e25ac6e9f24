//! A write job: stage source bytes into pool slots (checksumming each chunk while it is hot)
//! and drive a backend until every part file holds its range of the logical stream.

use std::collections::VecDeque;
use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::DIRECT_ALIGN_BYTES;
use crate::align::round_up;
use crate::backend::{self, Direction, IoBuf, IoOp, Next, OpSource, OpenFile};
use crate::checksum::Crc32c;
use crate::error::{Error, Result};
use crate::plan::{Chunk, Part, Plan};
use crate::pool::{Pool, Slot};
use crate::probe::{BackendKind, DirectMode};

/// Bytes copied between checksum updates: small enough to still be in L2 when hashed.
const CRC_PIECE_BYTES: usize = 256 << 10;

/// Read-only memory of one source extent (a tensor's bytes), referenced by raw pointer so that a
/// background thread can stage it while the caller keeps the owner alive.
#[derive(Debug, Clone, Copy)]
pub struct SourceRegion {
    ptr: *const u8,
    len_bytes: usize,
    /// The bytes live in device memory: a [`DeviceCopier`] puts them into the slot.
    device: bool,
}

// SAFETY: a SourceRegion is only a promise (made in `new`) that the memory stays readable; the
// job reads it from one thread at a time and never writes it.
unsafe impl Send for SourceRegion {}

impl SourceRegion {
    /// # Safety
    /// `ptr..ptr+len_bytes` must stay valid for reads until the job that receives this region
    /// reports its sources released ([`JobProgress::wait_sources_released`]) or returns.
    /// Concurrent writes to it are a caller bug that gives torn (not unsafe-to-write) data.
    pub unsafe fn new(ptr: *const u8, len_bytes: usize) -> Self {
        SourceRegion {
            ptr,
            len_bytes,
            device: false,
        }
    }

    /// An extent whose bytes are in device (e.g. GPU) memory: the job asks its
    /// [`DeviceCopier`] to copy them into each slot, and never dereferences a pointer for it.
    pub fn device(len_bytes: usize) -> Self {
        SourceRegion {
            ptr: std::ptr::null(),
            len_bytes,
            device: true,
        }
    }

    /// A region over a slice. The region does not borrow the slice, so this is `unsafe`.
    ///
    /// # Safety
    /// As for [`SourceRegion::new`]: `bytes` must stay alive (not freed, moved or resized)
    /// until the job that receives the region releases its sources or returns.
    pub unsafe fn from_slice(bytes: &[u8]) -> Self {
        SourceRegion {
            ptr: bytes.as_ptr(),
            len_bytes: bytes.len(),
            device: false,
        }
    }

    /// Length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }
}

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

/// A moment in a job's life that others wait for: set once, with the time since the job began.
#[derive(Debug, Default)]
struct Latch {
    after: Mutex<Option<Duration>>,
    reached: Condvar,
}

impl Latch {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Duration>> {
        self.after.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set(&self, elapsed: Duration) {
        let mut after = self.lock();
        if after.is_none() {
            *after = Some(elapsed);
            self.reached.notify_all();
        }
    }

    fn get(&self) -> Option<Duration> {
        *self.lock()
    }

    fn wait(&self, timeout: Duration) -> bool {
        let guard = self.lock();
        let (guard, _) = self
            .reached
            .wait_timeout_while(guard, timeout, |after| after.is_none())
            .unwrap_or_else(|e| e.into_inner());
        guard.is_some()
    }
}

/// Progress shared between a job and whoever waits on it.
#[derive(Debug)]
pub struct JobProgress {
    started: Instant,
    staged_bytes: AtomicU64,
    written_bytes: AtomicU64,
    cancelled: AtomicBool,
    copied_early: Latch,
    released: Latch,
}

impl Default for JobProgress {
    fn default() -> Self {
        JobProgress {
            started: Instant::now(),
            staged_bytes: AtomicU64::new(0),
            written_bytes: AtomicU64::new(0),
            cancelled: AtomicBool::new(false),
            copied_early: Latch::default(),
            released: Latch::default(),
        }
    }
}

impl JobProgress {
    /// Bytes copied into the pool so far.
    pub fn staged_bytes(&self) -> u64 {
        self.staged_bytes.load(Ordering::Relaxed)
    }

    /// Bytes whose write completed so far.
    pub fn written_bytes(&self) -> u64 {
        self.written_bytes.load(Ordering::Relaxed)
    }

    /// Asks the job to stop. It fails with [`Error::Cancelled`] at its next chunk, or at the
    /// latest before it reports success: a cancelled job never succeeds.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
    }

    /// Whether [`JobProgress::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }

    fn check_cancelled(&self, when: &str) -> Result<()> {
        if self.is_cancelled() {
            return Err(Error::Cancelled(format!("the save was cancelled {when}")));
        }
        Ok(())
    }

    fn mark_copied_early(&self) {
        self.copied_early.set(self.started.elapsed());
    }

    /// Waits until the job has copied the extents a [`Guard`] asked to copy at once (or
    /// failed, or finished staging). Returns false on timeout.
    pub fn wait_copied_early(&self, timeout: Duration) -> bool {
        self.copied_early.wait(timeout)
    }

    fn mark_sources_released(&self) {
        self.mark_copied_early();
        self.released.set(self.started.elapsed());
    }

    /// Time from job start until the sources were released, once they are.
    pub fn sources_released_after(&self) -> Option<Duration> {
        self.released.get()
    }

    /// Waits until the job no longer reads source memory. Returns false on timeout.
    pub fn wait_sources_released(&self, timeout: Duration) -> bool {
        self.released.wait(timeout)
    }
}

/// Copies bytes of device-resident extents into host slots (a GPU's device-to-host copy).
pub trait DeviceCopier: Send {
    /// Copies the bytes of extent `extent` starting at `offset_bytes` into `slot[range]`, and
    /// returns only once they are all there (the slot is submitted for writing right after).
    /// The whole slot is passed so that a copier can register (pin) it once.
    fn copy_to_host(
        &mut self,
        extent: usize,
        offset_bytes: u64,
        slot: &mut [u8],
        range: std::ops::Range<usize>,
    ) -> Result<()>;
}

/// Optional participants in a write job.
#[derive(Default)]
pub struct JobHooks {
    /// The mutation guard.
    pub guard: Option<Guard>,
    /// Stages [`SourceRegion::device`] extents; required when there are any.
    pub device: Option<Box<dyn DeviceCopier>>,
}

impl std::fmt::Debug for JobHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobHooks")
            .field("guard", &self.guard)
            .field("device", &self.device.is_some())
            .finish()
    }
}

/// Told when extents have been staged whole: from then on their source may change freely.
pub trait StagingObserver: Send {
    /// `extents` (plan indices) just had the last of this job's bytes of them staged. An error
    /// fails the job (e.g. the source was modified before it was staged).
    fn extents_staged(&mut self, extents: &[usize]) -> Result<()>;
}

/// The mutation guard's side of a job: which extents may change under it, and who checks.
pub struct Guard {
    /// Per plan extent: its source may be modified by someone while the job runs.
    pub watched: Vec<bool>,
    /// Watched extents of at most this many bytes are copied into job-owned memory before the
    /// job reports [`JobProgress::wait_copied_early`], smallest first, up to
    /// `copy_budget_bytes` in all: nothing can race them afterwards.
    pub copy_max_extent_bytes: u64,
    /// Total bytes of early copies.
    pub copy_budget_bytes: u64,
    /// Told when each remaining watched extent has been staged whole.
    pub observer: Box<dyn StagingObserver>,
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard")
            .field("watched", &self.watched.iter().filter(|w| **w).count())
            .field("copy_max_extent_bytes", &self.copy_max_extent_bytes)
            .field("copy_budget_bytes", &self.copy_budget_bytes)
            .finish_non_exhaustive()
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

/// [`write_parts`] with [`JobHooks`]. A mutation [`Guard`]: small watched extents are copied
/// first, and the guard's observer hears when each other watched extent is staged whole, so it
/// can check that its source had not changed before then (and fail the job if it had). A
/// [`DeviceCopier`]: stages the [`SourceRegion::device`] extents, chunk by chunk, while earlier
/// chunks are being written.
pub fn write_parts_with(
    plan: &Plan,
    targets: &[WriteTarget],
    sources: Vec<SourceRegion>,
    pool: &Pool,
    options: &WriteOptions,
    progress: &JobProgress,
    hooks: JobHooks,
) -> Result<WriteReport> {
    let staging = Staging::new(plan, targets, sources, pool, options, progress, hooks);
    progress.mark_copied_early();
    let mut staging = staging?;
    let result = (|| {
        let files = open_targets(targets, options.direct)?;
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
    let parts = targets
        .iter()
        .zip(std::mem::take(&mut staging.crcs))
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

fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

fn open_targets(targets: &[WriteTarget], direct: DirectMode) -> Result<Vec<OpenFile>> {
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
        crate::durable::preallocate(&file, target.part.len_bytes)
            .map_err(|e| Error::io("preallocate", &target.path, e))?;
        files.push(OpenFile {
            file,
            path: target.path.clone(),
            direct: use_direct,
        });
    }
    Ok(files)
}

fn finish_files(files: &[OpenFile], targets: &[WriteTarget], durable: bool) -> Result<()> {
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

struct Staging<'p> {
    plan: &'p Plan,
    extent_ends: Vec<u64>,
    sources: Option<Vec<SourceRegion>>,
    /// (file index, chunk index within its part, chunk), round-robin across files so that every
    /// stripe is busy at once.
    chunks: Vec<(usize, usize, Chunk)>,
    next: usize,
    pool: &'p Pool,
    checksum: bool,
    direct: Vec<bool>,
    crcs: Vec<Vec<u32>>,
    progress: &'p JobProgress,
    /// Chunks staged while the queue was full, in order, waiting for a queue slot.
    ahead: VecDeque<StagedChunk>,
    guard: Option<GuardState>,
    device: Option<Box<dyn DeviceCopier>>,
}

/// What the staging side keeps of a [`Guard`].
struct GuardState {
    watched: Vec<bool>,
    /// Per extent, this job's bytes of it not yet staged (watched extents only).
    remaining_bytes: Vec<u64>,
    /// Extents staged whole since the observer was last told.
    just_staged: Vec<usize>,
    observer: Box<dyn StagingObserver>,
    /// Early copies of small watched extents; the job's sources point into it for those. Its
    /// heap block never moves (sized once, never grown) and lives as long as the staging.
    _early_copies: Vec<u8>,
}

/// A chunk copied into a pool slot, not yet submitted.
struct StagedChunk {
    file: usize,
    offset_bytes: u64,
    slot: Slot,
    logical_bytes: usize,
}

impl<'p> Staging<'p> {
    fn new(
        plan: &'p Plan,
        targets: &[WriteTarget],
        sources: Vec<SourceRegion>,
        pool: &'p Pool,
        options: &WriteOptions,
        progress: &'p JobProgress,
        hooks: JobHooks,
    ) -> Result<Self> {
        let staging = Staging {
            plan,
            extent_ends: plan
                .extent_offsets
                .iter()
                .zip(&plan.extent_bytes)
                .map(|(o, l)| o + l)
                .collect(),
            sources: Some(sources),
            chunks: Vec::new(),
            next: 0,
            pool,
            checksum: options.checksum,
            direct: vec![false; targets.len()],
            crcs: Vec::new(),
            progress,
            ahead: VecDeque::new(),
            guard: None,
            device: hooks.device,
        };
        // From here an early return drops `staging`, whose Drop releases the sources.
        let mut staging = staging;
        let sources = staging.sources.as_ref().expect("just set");
        if sources.len() != plan.extent_bytes.len()
            || sources
                .iter()
                .zip(&plan.extent_bytes)
                .any(|(s, &l)| s.len_bytes as u64 != l)
        {
            return Err(Error::Internal(
                "source regions do not match the plan's extents".into(),
            ));
        }
        if plan.chunk_bytes as usize > pool.slot_bytes() {
            return Err(Error::InvalidArgument(format!(
                "chunk_bytes ({}) is larger than the pool's slots ({})",
                plan.chunk_bytes,
                pool.slot_bytes()
            )));
        }
        let per_file: Vec<Vec<Chunk>> = targets
            .iter()
            .map(|t| t.part.chunks(plan.chunk_bytes).collect())
            .collect();
        staging.crcs = per_file.iter().map(|c| vec![0; c.len()]).collect();
        let rounds = per_file.iter().map(Vec::len).max().unwrap_or(0);
        for round in 0..rounds {
            for (file, chunks) in per_file.iter().enumerate() {
                if let Some(chunk) = chunks.get(round) {
                    staging.chunks.push((file, round, *chunk));
                }
            }
        }
        let has_device = staging
            .sources
            .as_ref()
            .is_some_and(|s| s.iter().any(|r| r.device));
        if has_device && staging.device.is_none() {
            return Err(Error::InvalidArgument(
                "device-resident sources need a device copier".into(),
            ));
        }
        if let Some(guard) = hooks.guard {
            staging.start_guard(guard, targets)?;
        }
        Ok(staging)
    }

    /// Calls `f(extent, overlap_bytes)` for every extent overlapping stream bytes `[start, end)`.
    fn for_extents_in(&self, start: u64, end: u64, mut f: impl FnMut(usize, u64)) {
        let first = self.extent_ends.partition_point(|&e| e <= start);
        for index in first..self.extent_ends.len() {
            let ext_start = self.plan.extent_offsets[index];
            if ext_start >= end {
                break;
            }
            let overlap = self.extent_ends[index].min(end) - ext_start.max(start);
            if overlap > 0 {
                f(index, overlap);
            }
        }
    }

    /// Counts this job's bytes of each watched extent, and copies the small ones at once.
    fn start_guard(&mut self, guard: Guard, targets: &[WriteTarget]) -> Result<()> {
        let extent_count = self.plan.extent_bytes.len();
        if guard.watched.len() != extent_count {
            return Err(Error::Internal(format!(
                "the guard watches {} extents, the plan has {extent_count}",
                guard.watched.len()
            )));
        }
        let mut watched = guard.watched;
        let mut remaining_bytes = vec![0u64; extent_count];
        for target in targets {
            let start = target.part.stream_offset_bytes;
            self.for_extents_in(start, start + target.part.len_bytes, |i, n| {
                if watched[i] {
                    remaining_bytes[i] += n;
                }
            });
        }
        let mut small: Vec<usize> = (0..extent_count)
            .filter(|&i| {
                remaining_bytes[i] > 0 && !self.sources.as_ref().is_some_and(|s| s[i].device)
            })
            .filter(|&i| self.plan.extent_bytes[i] <= guard.copy_max_extent_bytes)
            .collect();
        small.sort_by_key(|&i| self.plan.extent_bytes[i]);
        let mut total = 0u64;
        small.retain(|&i| {
            total += self.plan.extent_bytes[i];
            total <= guard.copy_budget_bytes
        });
        let mut early_copies = vec![
            0u8;
            small
                .iter()
                .map(|&i| self.plan.extent_bytes[i] as usize)
                .sum()
        ];
        let sources = self.sources.as_mut().expect("sources held while staging");
        let mut at = 0;
        for &i in &small {
            let len = sources[i].len_bytes;
            let dst = &mut early_copies[at..at + len];
            // SAFETY: the region is readable (SourceRegion::new's contract; the job holds the
            // sources until it releases them, which has not happened yet), its length is the
            // extent's (checked in `new`), and `dst` is memory of our own.
            unsafe { std::ptr::copy_nonoverlapping(sources[i].ptr, dst.as_mut_ptr(), len) };
            // SAFETY: `early_copies` is never grown or dropped before the staging is, so the
            // region stays readable for as long as the job reads its sources.
            sources[i] = unsafe { SourceRegion::new(dst.as_ptr(), len) };
            watched[i] = false;
            remaining_bytes[i] = 0;
            at += len;
        }
        self.guard = Some(GuardState {
            watched,
            remaining_bytes,
            just_staged: Vec::new(),
            observer: guard.observer,
            _early_copies: early_copies,
        });
        Ok(())
    }

    /// Records that stream bytes `[start, start + len_bytes)` are staged, and tells the guard's
    /// observer about the watched extents that are now staged whole.
    fn note_staged(&mut self, start: u64, len_bytes: u64) -> Result<()> {
        let Some(mut guard) = self.guard.take() else {
            return Ok(());
        };
        self.for_extents_in(start, start + len_bytes, |i, n| {
            if guard.watched[i] {
                guard.remaining_bytes[i] -= n;
                if guard.remaining_bytes[i] == 0 {
                    guard.just_staged.push(i);
                }
            }
        });
        let told = if guard.just_staged.is_empty() {
            Ok(())
        } else {
            let told = guard.observer.extents_staged(&guard.just_staged);
            guard.just_staged.clear();
            told
        };
        self.guard = Some(guard);
        told
    }

    fn release_sources(&mut self) {
        self.sources = None;
        self.progress.mark_sources_released();
    }

    /// Copies stream bytes `[start, start + dst.len())` into `dst`, zero-filling gaps.
    fn fill(&self, dst: &mut [u8], start: u64) {
        let sources = self.sources.as_ref().expect("sources held while staging");
        let end = start + dst.len() as u64;
        let mut cursor = start;
        let first = self.extent_ends.partition_point(|&e| e <= start);
        for (index, region) in sources.iter().enumerate().skip(first) {
            let ext_start = self.plan.extent_offsets[index];
            if ext_start >= end {
                break;
            }
            let from = ext_start.max(start);
            let to = self.extent_ends[index].min(end);
            if from >= to {
                continue;
            }
            dst[(cursor - start) as usize..(from - start) as usize].fill(0);
            let target = &mut dst[(from - start) as usize..(to - start) as usize];
            if region.device {
                // Put there by the device copier before the chunk's pieces are filled.
                cursor = to;
                continue;
            }
            // SAFETY: `from - ext_start + len <= region.len_bytes` (the region's length equals the
            // extent's, checked in `new`), the region is readable until sources are released
            // (SourceRegion::new's contract; we still hold them), and `target` is our own slot
            // memory, so the two cannot overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    region.ptr.add((from - ext_start) as usize),
                    target.as_mut_ptr(),
                    target.len(),
                );
            }
            cursor = to;
        }
        dst[(cursor - start) as usize..].fill(0);
    }

    /// Copies the device-resident extents overlapping `chunk` into `slot`, one call each.
    fn copy_from_device(&mut self, slot: &mut Slot, chunk: &Chunk) -> Result<()> {
        let Some(device) = self.device.as_mut() else {
            return Ok(());
        };
        let sources = self.sources.as_ref().expect("sources held while staging");
        let start = chunk.stream_offset_bytes;
        let end = start + chunk.len_bytes;
        let first = self.extent_ends.partition_point(|&e| e <= start);
        for (index, source) in sources.iter().enumerate().skip(first) {
            let ext_start = self.plan.extent_offsets[index];
            if ext_start >= end {
                break;
            }
            let (from, to) = (ext_start.max(start), self.extent_ends[index].min(end));
            if from < to && source.device {
                let range = (from - start) as usize..(to - start) as usize;
                device.copy_to_host(index, from - ext_start, slot.buf_mut(), range)?;
            }
        }
        Ok(())
    }

    fn stage(&mut self, slot: &mut Slot, chunk: &Chunk) -> Result<u32> {
        self.copy_from_device(slot, chunk)?;
        let len = chunk.len_bytes as usize;
        let mut crc = Crc32c::default();
        let mut done = 0;
        while done < len {
            let piece = CRC_PIECE_BYTES.min(len - done);
            let dst = &mut slot.buf_mut()[done..done + piece];
            self.fill(dst, chunk.stream_offset_bytes + done as u64);
            if self.checksum {
                crc.update(dst);
            }
            done += piece;
            self.progress
                .staged_bytes
                .fetch_add(piece as u64, Ordering::Relaxed);
        }
        Ok(crc.finish())
    }
}

impl Drop for Staging<'_> {
    fn drop(&mut self) {
        self.release_sources();
    }
}

impl Staging<'_> {
    fn check_cancelled(&self) -> Result<()> {
        self.progress.check_cancelled("while staging")
    }

    /// Stages the next chunk into `slot`.
    fn stage_next(&mut self, mut slot: Slot) -> Result<StagedChunk> {
        let (file, index, chunk) = self.chunks[self.next];
        self.next += 1;
        let crc = self.stage(&mut slot, &chunk)?;
        self.crcs[file][index] = crc;
        self.note_staged(chunk.stream_offset_bytes, chunk.len_bytes)?;
        if self.next == self.chunks.len() {
            // Everything is in the pool: the caller may modify its tensors from here on.
            self.release_sources();
        }
        Ok(StagedChunk {
            file,
            offset_bytes: chunk.file_offset_bytes,
            slot,
            logical_bytes: chunk.len_bytes as usize,
        })
    }

    fn op_for<'a>(&self, staged: StagedChunk) -> IoOp<'a> {
        let len_bytes = if self.direct[staged.file] {
            round_up(staged.logical_bytes, DIRECT_ALIGN_BYTES)
        } else {
            staged.logical_bytes
        };
        IoOp {
            file: staged.file,
            offset_bytes: staged.offset_bytes,
            buf: IoBuf::Slot(staged.slot),
            len_bytes,
            min_bytes: len_bytes,
            done_bytes: 0,
            tag: staged.logical_bytes,
        }
    }
}

impl<'a> OpSource<'a> for Staging<'_> {
    fn next_op(&mut self, may_block: bool) -> Result<Next<'a>> {
        if self.ahead.is_empty() && self.next == self.chunks.len() {
            self.release_sources();
            return Ok(Next::Done);
        }
        self.check_cancelled()?;
        if let Some(staged) = self.ahead.pop_front() {
            return Ok(Next::Op(self.op_for(staged)));
        }
        let slot = match self.pool.try_acquire() {
            Some(slot) => slot,
            None if !may_block => return Ok(Next::NotYet),
            None => loop {
                if let Some(slot) = self.pool.acquire_timeout(Duration::from_millis(50)) {
                    break slot;
                }
                self.check_cancelled()?;
            },
        };
        let staged = self.stage_next(slot)?;
        Ok(Next::Op(self.op_for(staged)))
    }

    fn prepare_ahead(&mut self) -> Result<bool> {
        if self.next == self.chunks.len() {
            return Ok(false);
        }
        self.check_cancelled()?;
        let Some(slot) = self.pool.try_acquire() else {
            return Ok(false);
        };
        let staged = self.stage_next(slot)?;
        self.ahead.push_back(staged);
        Ok(true)
    }

    fn completed(&mut self, op: IoOp<'a>) -> Result<()> {
        self.progress
            .written_bytes
            .fetch_add(op.tag as u64, Ordering::Relaxed);
        Ok(())
    }
}
