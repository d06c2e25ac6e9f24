//! The write job's [`OpSource`] for host sources: copies the stream's bytes into pool slots
//! chunk by chunk (checksumming each while it is hot, and filling in [`Crc32Field`]s),
//! round-robin across the files, and hands them to the backend as writes. (A save with device
//! sources stages through its arena instead: `from_arena`.)
//!
//! A chunk is copied by up to [`WriteOptions::staging_threads`](super::WriteOptions) threads at
//! once, each a contiguous share of it (copy and crc32c fused per piece, as on one thread); the
//! shares' crc32c are combined into the chunk's, so the stream, its order and its checks are
//! the same whatever the count. One core's copy and crc32c would otherwise cap
//! a save to a memory root, or to drives faster than that, at one core's memory bandwidth.

use std::collections::VecDeque;
use std::time::Duration;

use super::crc32_fields::Crc32Patcher;
use super::guard::GuardState;
use super::source::{ExtentMap, SourceRegion, check_against_plan};
use super::{JobContext, JobHooks, JobProgress};
use crate::DIRECT_ALIGN_BYTES;
use crate::backend::{IoBuf, IoOp, Next, OpSource};
use crate::checksum::{Crc32c, crc32c_combine};
use crate::error::{Error, Result};
use crate::plan::{Chunk, Plan};
use crate::pool::{Pool, Slot};
use crate::round_up;

/// Bytes copied between checksum updates: small enough to still be in L2 when hashed.
const CRC_PIECE_BYTES: usize = 256 << 10;

/// The least share of a chunk worth a thread of its own: a thread's start and join (tens of
/// microseconds) are a few percent of copying 2 MiB.
const MIN_SHARE_BYTES: usize = 2 << 20;

pub(super) struct Staging<'p> {
    extents: ExtentMap,
    sources: Option<Vec<SourceRegion>>,
    /// (file index, chunk index within its part, chunk), round-robin across files so that every
    /// stripe is busy at once.
    chunks: Vec<(usize, usize, Chunk)>,
    next: usize,
    pool: &'p Pool,
    checksum: bool,
    /// Threads that copy one chunk at once (the job's own among them).
    threads: usize,
    /// Per file: whether it was opened with O_DIRECT (set once the files are open).
    pub direct: Vec<bool>,
    /// Per file, the crc32c of each chunk.
    pub crcs: Vec<Vec<u32>>,
    progress: &'p JobProgress,
    /// Chunks staged while the queue was full, in order, waiting for a queue slot.
    ahead: VecDeque<StagedChunk>,
    guard: Option<GuardState>,
    /// The CRC-32 fields filled in while staging (the stream is then staged in order).
    crc32: Option<Crc32Patcher>,
}

/// A chunk copied into a pool slot, not yet submitted.
struct StagedChunk {
    /// Its index in [`Staging::chunks`].
    index: usize,
    slot: Slot,
}

impl<'p> Staging<'p> {
    pub fn new(
        context: JobContext<'p>,
        sources: Vec<SourceRegion>,
        hooks: JobHooks,
    ) -> Result<Self> {
        let JobContext {
            plan,
            targets,
            pool,
            options,
            progress,
        } = context;
        // From here an early return drops `staging`, whose Drop releases the sources.
        let mut staging = Staging {
            extents: ExtentMap::new(plan),
            sources: Some(sources),
            chunks: Vec::new(),
            next: 0,
            pool,
            checksum: options.checksum,
            threads: options.staging_threads.max(1),
            direct: vec![false; targets.len()],
            crcs: Vec::new(),
            progress,
            ahead: VecDeque::new(),
            guard: None,
            crc32: None,
        };
        let sources = staging.sources.as_mut().expect("just set");
        check_sources(plan, sources, pool)?;
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
        if !hooks.crc32_fields.is_empty() {
            check_in_stream_order(&staging.chunks, plan.total_bytes)?;
            staging.crc32 = Some(Crc32Patcher::new(hooks.crc32_fields, plan.total_bytes)?);
        }
        if let Some(guard) = hooks.guard {
            let sources = staging.sources.as_mut().expect("just set");
            let state = GuardState::start(guard, plan, &staging.extents, targets, sources, pool)?;
            staging.guard = Some(state);
        }
        Ok(staging)
    }

    /// Lets go of the sources (the caller may modify them).
    pub fn release_sources(&mut self) {
        self.sources = None;
        self.progress.mark_sources_released();
    }

    /// Fills `dst` (the chunk's length) with the chunk's host bytes piece by piece, each piece
    /// checksummed while it is hot (and hashed for the CRC-32 fields, which are filled in);
    /// returns the chunk's crc32c (0 with checksums off). A chunk of several
    /// [`MIN_SHARE_BYTES`] is shared among the job's staging threads, except where CRC-32
    /// fields need the stream hashed in order.
    fn fill_checksummed(&mut self, dst: &mut [u8], chunk: &Chunk) -> Result<u32> {
        let start = chunk.stream_offset_bytes;
        let sources = self.sources.as_deref().expect("sources held while staging");
        let (extents, progress, checksum) = (&self.extents, self.progress, self.checksum);
        let threads = self.threads.min(dst.len() / MIN_SHARE_BYTES).max(1);
        if let Some(crc32) = self.crc32.as_mut() {
            let mut crc = Crc32c::default();
            let mut at = start;
            for piece in dst.chunks_mut(CRC_PIECE_BYTES) {
                copy_stream(extents, sources, piece, at);
                crc32.apply(piece, at)?;
                if checksum {
                    crc.update(piece);
                }
                progress.add_staged_bytes(piece.len() as u64);
                at += piece.len() as u64;
            }
            return Ok(crc.finish());
        }
        if threads == 1 {
            return Ok(stage_share(
                extents, sources, dst, start, checksum, progress,
            ));
        }
        // Contiguous shares, one per thread: each thread streams through its own range (a
        // piece-by-piece hand-out, tried, ran 0.72x one thread here: the two cores then
        // interleave 256 KiB pieces and neither streams).
        let share_bytes = round_up(dst.len().div_ceil(threads), CRC_PIECE_BYTES);
        let shares: Vec<(u32, u64)> = std::thread::scope(|scope| {
            let mut parts = dst.chunks_mut(share_bytes);
            let first = parts.next().expect("a chunk holds at least one byte");
            let others: Vec<_> = parts
                .enumerate()
                .map(|(i, part)| {
                    let at = start + ((i + 1) * share_bytes) as u64;
                    let len = part.len() as u64;
                    let staged = scope
                        .spawn(move || stage_share(extents, sources, part, at, checksum, progress));
                    (staged, len)
                })
                .collect();
            let first_len = first.len() as u64;
            let mut shares = vec![(
                stage_share(extents, sources, first, start, checksum, progress),
                first_len,
            )];
            for (staged, len) in others {
                match staged.join() {
                    Ok(crc) => shares.push((crc, len)),
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            }
            shares
        });
        if !checksum {
            return Ok(0);
        }
        let (first, _) = shares[0];
        Ok(shares[1..]
            .iter()
            .fold(first, |crc, &(next, len)| crc32c_combine(crc, next, len)))
    }

    /// The chunks in staging order: (file index, the chunk).
    pub(super) fn chunk_list(&self) -> Vec<(usize, Chunk)> {
        self.chunks
            .iter()
            .map(|&(file, _, chunk)| (file, chunk))
            .collect()
    }

    /// Stages the next chunk straight into `dst` (its place in the file's memory, of the
    /// chunk's length) instead of a pool slot: the write of the in-memory level.
    pub(super) fn stage_next_into(&mut self, dst: &mut [u8]) -> Result<()> {
        self.check_cancelled()?;
        let index = self.next;
        let (file, chunk_in_file, chunk) = self.chunks[index];
        self.next += 1;
        self.crcs[file][chunk_in_file] = self.fill_checksummed(dst, &chunk)?;
        if let Some(guard) = self.guard.as_mut() {
            guard.note_staged(&self.extents, chunk.stream_offset_bytes, chunk.len_bytes)?;
        }
        if self.next == self.chunks.len() {
            self.release_sources();
        }
        self.progress.add_written_bytes(chunk.len_bytes);
        Ok(())
    }

    fn check_cancelled(&self) -> Result<()> {
        self.progress.check_cancelled("while staging")
    }

    /// The slot for the chunk staged next; None when no slot is free and `may_block` is false.
    fn next_slot(&mut self, may_block: bool) -> Result<Option<Slot>> {
        match self.pool.try_acquire() {
            Some(slot) => Ok(Some(slot)),
            None if !may_block => Ok(None),
            None => loop {
                if let Some(slot) = self.pool.acquire_timeout(Duration::from_millis(50)) {
                    break Ok(Some(slot));
                }
                self.check_cancelled()?;
            },
        }
    }

    /// Stages the next chunk into `slot`.
    fn stage_next(&mut self, mut slot: Slot) -> Result<StagedChunk> {
        let index = self.next;
        let (file, chunk_in_file, chunk) = self.chunks[index];
        self.next += 1;
        let crc = self.fill_checksummed(&mut slot.buf_mut()[..chunk.len_bytes as usize], &chunk)?;
        self.crcs[file][chunk_in_file] = crc;
        if let Some(guard) = self.guard.as_mut() {
            guard.note_staged(&self.extents, chunk.stream_offset_bytes, chunk.len_bytes)?;
        }
        if self.next == self.chunks.len() {
            // Everything is in the pool: the caller may modify its tensors from here on.
            self.release_sources();
        }
        Ok(StagedChunk { index, slot })
    }

    fn op_for<'a>(&self, staged: StagedChunk) -> IoOp<'a> {
        let (file, _, chunk) = self.chunks[staged.index];
        let logical_bytes = chunk.len_bytes as usize;
        let len_bytes = if self.direct[file] {
            round_up(logical_bytes, DIRECT_ALIGN_BYTES)
        } else {
            logical_bytes
        };
        IoOp {
            file,
            offset_bytes: chunk.file_offset_bytes,
            buf: IoBuf::Slot(staged.slot),
            len_bytes,
            min_bytes: len_bytes,
            done_bytes: 0,
            chunk_index: staged.index,
        }
    }
}

/// Checks that the sources match the plan's extents, the chunks fit the pool's slots, and
/// every source is in host memory.
fn check_sources(plan: &Plan, sources: &[SourceRegion], pool: &Pool) -> Result<()> {
    check_against_plan(plan, sources)?;
    if plan.chunk_bytes as usize > pool.slot_bytes() {
        return Err(Error::InvalidArgument(format!(
            "chunk_bytes ({}) is larger than the pool's slots ({})",
            plan.chunk_bytes,
            pool.slot_bytes()
        )));
    }
    if sources.iter().any(|r| r.device) {
        return Err(Error::InvalidArgument(
            "device-resident sources need a device copier and an arena".into(),
        ));
    }
    Ok(())
}

/// Copies stream bytes `[start, start + dst.len())` into `dst`, zero-filling gaps.
fn copy_stream(extents: &ExtentMap, sources: &[SourceRegion], dst: &mut [u8], start: u64) {
    let mut cursor = start;
    for overlap in extents.overlapping(start, start + dst.len() as u64) {
        dst[(cursor - start) as usize..(overlap.from - start) as usize].fill(0);
        cursor = overlap.to;
        let region = &sources[overlap.index];
        let target = &mut dst[(overlap.from - start) as usize..(overlap.to - start) as usize];
        // SAFETY: `from - extent_start + len <= region.len_bytes` (the region's length equals
        // the extent's, checked in `Staging::new`), the region is readable until the sources
        // are released (SourceRegion::new's contract; the job holds them while it stages), and
        // `target` is our own slot (or file) memory, so the two cannot overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                region
                    .ptr
                    .add((overlap.from - overlap.extent_start) as usize),
                target.as_mut_ptr(),
                target.len(),
            );
        }
    }
    dst[(cursor - start) as usize..].fill(0);
}

/// Copies stream bytes from `start` into `dst` piece by piece, each piece checksummed while it
/// is hot; returns their crc32c.
fn stage_share(
    extents: &ExtentMap,
    sources: &[SourceRegion],
    dst: &mut [u8],
    start: u64,
    checksum: bool,
    progress: &JobProgress,
) -> u32 {
    let mut crc = Crc32c::default();
    let mut at = start;
    for piece in dst.chunks_mut(CRC_PIECE_BYTES) {
        copy_stream(extents, sources, piece, at);
        if checksum {
            crc.update(piece);
        }
        progress.add_staged_bytes(piece.len() as u64);
        at += piece.len() as u64;
    }
    if checksum { crc.finish() } else { 0 }
}

/// CRC-32 fields are filled in one pass: the job must stage the whole stream, in order.
pub(super) fn check_in_stream_order(
    chunks: &[(usize, usize, Chunk)],
    total_bytes: u64,
) -> Result<()> {
    let mut cursor = 0;
    for (_, _, chunk) in chunks {
        if chunk.stream_offset_bytes != cursor {
            break;
        }
        cursor += chunk.len_bytes;
    }
    if cursor != total_bytes {
        return Err(Error::InvalidArgument(
            "crc32 fields need one job writing the whole stream in order (a plan of one part)"
                .into(),
        ));
    }
    Ok(())
}

impl Drop for Staging<'_> {
    fn drop(&mut self) {
        self.release_sources();
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
        let Some(slot) = self.next_slot(may_block)? else {
            return Ok(Next::NotYet);
        };
        let staged = self.stage_next(slot)?;
        Ok(Next::Op(self.op_for(staged)))
    }

    fn prepare_ahead(&mut self) -> Result<bool> {
        if self.next == self.chunks.len() {
            return Ok(false);
        }
        self.check_cancelled()?;
        let Some(slot) = self.next_slot(false)? else {
            return Ok(false);
        };
        let staged = self.stage_next(slot)?;
        self.ahead.push_back(staged);
        Ok(true)
    }

    fn completed(&mut self, op: IoOp<'a>) -> Result<()> {
        let (_, _, chunk) = self.chunks[op.chunk_index];
        self.progress.add_written_bytes(chunk.len_bytes);
        Ok(())
    }
}
