//! The write job of a save with device sources: its chunks are staged into the job's arena, a
//! window of the arena at a time, and written straight from there.
//!
//! The arena holds the job's chunks in stream order, one `chunk_bytes` cell each, so a tensor
//! is one contiguous run of it. Per window: the device copies of every device-resident byte
//! are asked for in one call (for the first window, before the job reports its early copies
//! done, so that `save_async` returns with them queued), host bytes are copied and gaps zeroed
//! meanwhile, the copies are waited for once, the mutation guard hears of every extent staged
//! whole in one call, and then the window's chunks are written from the arena while a bounded
//! pool of threads checksums them, each chunk before its write is submitted. The next window
//! reuses the arena only after every write of this one has completed. The sources are let go
//! as soon as the last window is staged: that is when `wait_staged()` returns.

use std::ops::Range;

use super::crc32_fields::Crc32Patcher;
use super::from_pool::check_in_stream_order;
use super::guard::GuardState;
use super::source::{CopyPiece, DeviceCopier, ExtentMap, SourceRegion, check_against_plan};
use super::{JobContext, JobHooks, JobProgress, WriteTarget, finish_files, open_targets};
use crate::DIRECT_ALIGN_BYTES;
use crate::arena::ArenaLease;
use crate::error::{Error, Result};
use crate::plan::{Chunk, Plan};
use crate::probe::BackendKind;
use crate::round_up;

/// One of the job's chunks, and its cell (its index in [`ArenaJob::cells`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Cell {
    pub file: usize,
    pub chunk_in_file: usize,
    pub chunk: Chunk,
}

/// What a job wrote: per file, the crc32c of each chunk; and whether it was written with O_DIRECT.
pub(super) type Written = (Vec<Vec<u32>>, Vec<bool>);

/// Sets the job's "copied early" moment when dropped: whatever happens, the caller that waits
/// for it (`save_async`) is let go.
struct CopiedEarly<'p>(&'p JobProgress);

impl Drop for CopiedEarly<'_> {
    fn drop(&mut self) {
        self.0.mark_copied_early();
    }
}

/// Writes the job's targets from `sources` through the arena of `hooks` (see the module docs);
/// `in_place`: the arena is the one target's file ([`super::StagingMode::InPlace`]).
pub(super) fn write(
    context: JobContext<'_>,
    sources: Vec<SourceRegion>,
    hooks: JobHooks,
    in_place: bool,
) -> Result<Written> {
    let JobContext {
        targets,
        options,
        progress,
        ..
    } = context;
    let copied_early = CopiedEarly(progress);
    let gate = hooks.write_gate.clone();
    let mut job = ArenaJob::new(context, sources, hooks, in_place)?;
    let windows = job.windows();
    if let Some(first) = windows.first() {
        job.ask_copies(first.clone())?;
    }
    drop(copied_early);
    if job.in_place {
        return job.write_in_place(windows, targets, options, gate.as_deref());
    }
    // The null sink moves no bytes, so nothing is reserved for them either.
    let open = || {
        open_targets(
            targets,
            options.direct,
            options.backend != BackendKind::Null,
        )
    };
    // Opened once the first window is staged, not while it stages: creating and reserving the
    // files (on tmpfs, zeroing every page) is kept off the path to wait_staged().
    let mut opened = None;
    for (i, window) in windows.iter().enumerate() {
        if i > 0 {
            job.ask_copies(window.clone())?;
        }
        job.stage(window.clone())?;
        if i + 1 == windows.len() {
            job.release_sources(); // every byte is in the arena: the caller may go on
        }
        progress.check_cancelled("while staging")?;
        if i == 0
            && let Some(gate) = gate.as_ref()
        {
            gate.wait(progress)?; // a snapshot: written once the disk is free
        }
        let files = match opened.as_ref() {
            Some(files) => files,
            None => opened.insert(open()?),
        };
        let direct: Vec<bool> = files.iter().map(|f| f.direct).collect();
        job.write(window.clone(), files, &direct, options)?;
    }
    let files = match opened {
        Some(files) => files,
        None => open()?, // an empty part: its file, with nothing to write
    };
    let direct: Vec<bool> = files.iter().map(|f| f.direct).collect();
    job.release_sources();
    finish_files(&files, targets, options.durable)?;
    progress.check_cancelled("after its data was written")?;
    Ok((std::mem::take(&mut job.crcs), direct))
}

pub(super) struct ArenaJob<'p> {
    extents: ExtentMap,
    sources: Option<Vec<SourceRegion>>,
    /// The job's chunks in stream order; a window's cells lie at consecutive arena offsets.
    pub(super) cells: Vec<Cell>,
    pub(super) cell_bytes: usize,
    cells_per_window: usize,
    /// The arena is the job's one data file: staging writes it (`in_place`).
    pub(super) in_place: bool,
    pub(super) arena: ArenaLease,
    device: Option<Box<dyn DeviceCopier>>,
    /// Device copies were asked for and not yet waited for.
    copies_in_flight: bool,
    guard: Option<GuardState>,
    crc32: Option<Crc32Patcher>,
    pub(super) checksum: bool,
    /// Per file, the crc32c of each chunk.
    pub(super) crcs: Vec<Vec<u32>>,
    pub(super) progress: &'p JobProgress,
}

impl<'p> ArenaJob<'p> {
    fn new(
        context: JobContext<'p>,
        mut sources: Vec<SourceRegion>,
        hooks: JobHooks,
        in_place: bool,
    ) -> Result<Self> {
        let JobContext {
            plan,
            targets,
            pool,
            options,
            progress,
        } = context;
        let Some(arena) = hooks.arena else {
            return Err(Error::InvalidArgument(
                "a job that stages through an arena needs one".into(),
            ));
        };
        check_sources(plan, &sources, hooks.device.is_some())?;
        let cell_bytes = plan.chunk_bytes as usize;
        let cells = cells_in_stream_order(targets, plan.chunk_bytes);
        // In place, cell k is the file's chunk k, at k * chunk_bytes: one window holds them all
        // (the file's last chunk may end before its cell does).
        let cells_per_window = if in_place {
            cells.len().max(1)
        } else {
            arena.len_bytes() / cell_bytes
        };
        if cells_per_window == 0 {
            return Err(Error::InvalidArgument(format!(
                "the arena ({} bytes) is smaller than one chunk ({cell_bytes} bytes)",
                arena.len_bytes()
            )));
        }
        let crcs = targets
            .iter()
            .map(|t| vec![0; t.part.chunks(plan.chunk_bytes).count()])
            .collect();
        let extents = ExtentMap::new(plan);
        let crc32 = if hooks.crc32_fields.is_empty() {
            None
        } else {
            let in_order: Vec<_> = cells
                .iter()
                .map(|c| (c.file, c.chunk_in_file, c.chunk))
                .collect();
            check_in_stream_order(&in_order, plan.total_bytes)?;
            Some(Crc32Patcher::new(hooks.crc32_fields, plan.total_bytes)?)
        };
        let guard = match hooks.guard {
            Some(guard) => Some(GuardState::start(
                guard,
                plan,
                &extents,
                targets,
                &mut sources,
                pool,
            )?),
            None => None,
        };
        Ok(ArenaJob {
            extents,
            sources: Some(sources),
            cells,
            cell_bytes,
            cells_per_window,
            in_place,
            arena,
            device: hooks.device,
            copies_in_flight: false,
            guard,
            crc32,
            checksum: options.checksum,
            crcs,
            progress,
        })
    }

    /// The windows: runs of at most `cells_per_window` cells, in stream order.
    fn windows(&self) -> Vec<Range<usize>> {
        (0..self.cells.len())
            .step_by(self.cells_per_window)
            .map(|start| start..(start + self.cells_per_window).min(self.cells.len()))
            .collect()
    }

    /// The arena offset of cell `index` of the window starting at cell `window_start`.
    pub(super) fn arena_offset(&self, window_start: usize, index: usize) -> usize {
        (index - window_start) * self.cell_bytes
    }

    /// The device copies of `window`: one piece per contiguous run of a device extent.
    fn copy_pieces(&self, window: Range<usize>) -> Vec<CopyPiece> {
        let sources = self.sources.as_ref().expect("sources held while staging");
        let mut pieces: Vec<CopyPiece> = Vec::new();
        for index in window.clone() {
            let chunk = self.cells[index].chunk;
            let cell_offset = self.arena_offset(window.start, index) as u64;
            let start = chunk.stream_offset_bytes;
            for overlap in self.extents.overlapping(start, start + chunk.len_bytes) {
                if !sources[overlap.index].device {
                    continue;
                }
                let piece = CopyPiece {
                    extent: overlap.index,
                    extent_offset_bytes: overlap.from - overlap.extent_start,
                    arena_offset_bytes: cell_offset + (overlap.from - start),
                    len_bytes: overlap.to - overlap.from,
                };
                match pieces.last_mut() {
                    Some(last)
                        if last.extent == piece.extent
                            && last.extent_offset_bytes + last.len_bytes
                                == piece.extent_offset_bytes
                            && last.arena_offset_bytes + last.len_bytes
                                == piece.arena_offset_bytes =>
                    {
                        last.len_bytes += piece.len_bytes;
                    }
                    _ => pieces.push(piece),
                }
            }
        }
        pieces
    }

    /// Asks for every device copy of `window` at once.
    fn ask_copies(&mut self, window: Range<usize>) -> Result<()> {
        let pieces = self.copy_pieces(window);
        if pieces.is_empty() {
            return Ok(());
        }
        let device = self.device.as_mut().expect("checked in new");
        self.copies_in_flight = true;
        device.copy(&pieces)
    }

    /// Waits for the device copies asked for, whatever they return (the job is failing, or
    /// they were waited for already): nothing may write into the arena once it is let go.
    fn settle_copies(&mut self) {
        if std::mem::take(&mut self.copies_in_flight)
            && let Some(device) = self.device.as_mut()
        {
            let _ = device.wait();
        }
    }

    /// Lets go of the sources (the caller may modify them), once no device copy reads them.
    pub(super) fn release_sources(&mut self) {
        self.settle_copies();
        if self.sources.take().is_some() {
            self.progress.mark_sources_released();
        }
    }

    /// Completes `window` in the arena: host bytes and zeroed gaps while the device copies
    /// run, then the copies waited for, the CRC-32 fields filled in, and the guard told.
    pub(super) fn stage(&mut self, window: Range<usize>) -> Result<()> {
        for index in window.clone() {
            self.fill_host_bytes(window.start, index);
        }
        if std::mem::take(&mut self.copies_in_flight) {
            self.device.as_mut().expect("checked in new").wait()?;
        }
        let mut staged_bytes = 0;
        for index in window.clone() {
            let chunk = self.cells[index].chunk;
            if let Some(crc32) = self.crc32.as_mut() {
                let offset = (index - window.start) * self.cell_bytes;
                // SAFETY: the window's device copies have completed (waited for above) and no
                // write or checksum reads the arena while a window is being staged.
                let bytes = unsafe { self.arena.bytes_mut(offset, chunk.len_bytes as usize) };
                crc32.apply(bytes, chunk.stream_offset_bytes)?;
            }
            if let Some(guard) = self.guard.as_mut() {
                guard.record_staged(&self.extents, chunk.stream_offset_bytes, chunk.len_bytes);
            }
            staged_bytes += chunk.len_bytes;
        }
        self.progress.add_staged_bytes(staged_bytes);
        match self.guard.as_mut() {
            Some(guard) => guard.tell_observer(),
            None => Ok(()),
        }
    }

    /// Copies cell `index`'s host bytes into the arena and zeroes its gaps (between extents,
    /// and after the chunk up to the padded length an O_DIRECT write takes), never touching
    /// the ranges device copies may be writing meanwhile.
    fn fill_host_bytes(&self, window_start: usize, index: usize) {
        let sources = self.sources.as_ref().expect("sources held while staging");
        let chunk = self.cells[index].chunk;
        let base = self.arena_offset(window_start, index);
        let (start, end) = (
            chunk.stream_offset_bytes,
            chunk.stream_offset_bytes + chunk.len_bytes,
        );
        let padded_end = round_up(chunk.len_bytes as usize, DIRECT_ALIGN_BYTES);
        let mut cursor = start;
        for overlap in self.extents.overlapping(start, end) {
            self.zero(base + (cursor - start) as usize..base + (overlap.from - start) as usize);
            cursor = overlap.to;
            let region = &sources[overlap.index];
            if region.device {
                continue;
            }
            let len = (overlap.to - overlap.from) as usize;
            // SAFETY: the source range lies inside the region (its length is the extent's,
            // checked in `new`), which is readable until the sources are released (we hold
            // them); the destination lies inside this cell, which no device copy writes (they
            // go to device extents' ranges only), and nothing else uses the window meanwhile.
            unsafe {
                let dst = self
                    .arena
                    .bytes_mut(base + (overlap.from - start) as usize, len);
                std::ptr::copy_nonoverlapping(
                    region
                        .ptr
                        .add((overlap.from - overlap.extent_start) as usize),
                    dst.as_mut_ptr(),
                    len,
                );
            }
        }
        self.zero(base + (cursor - start) as usize..base + padded_end);
    }

    fn zero(&self, range: Range<usize>) {
        if !range.is_empty() {
            // SAFETY: a gap of the window being staged: no device copy writes it, and no
            // write or checksum reads the window meanwhile.
            unsafe { self.arena.bytes_mut(range.start, range.len()) }.fill(0);
        }
    }
}

/// Whether the job stages `targets` in place: `arena` is the file of its one part. An arena over
/// a file is refused for any other job (its bytes belong to that file).
pub(super) fn is_in_place(arena: &ArenaLease, targets: &[WriteTarget]) -> Result<bool> {
    match targets {
        [one] => arena.is_file_of(&one.path, one.part.len_bytes),
        _ if arena.is_file() => Err(Error::InvalidArgument(format!(
            "a staging arena over a file stages a job of one part, not of {}",
            targets.len()
        ))),
        _ => Ok(false),
    }
}

/// Checks that the sources match the plan's extents, and a copier is there for device ones.
fn check_sources(plan: &Plan, sources: &[SourceRegion], has_copier: bool) -> Result<()> {
    check_against_plan(plan, sources)?;
    if sources.iter().any(|r| r.device) && !has_copier {
        return Err(Error::InvalidArgument(
            "device-resident sources need a device copier".into(),
        ));
    }
    Ok(())
}

/// The chunks of `targets`, sorted by their place in the stream.
fn cells_in_stream_order(targets: &[WriteTarget], chunk_bytes: u64) -> Vec<Cell> {
    let mut cells: Vec<Cell> = targets
        .iter()
        .enumerate()
        .flat_map(|(file, t)| {
            t.part
                .chunks(chunk_bytes)
                .enumerate()
                .map(move |(chunk_in_file, chunk)| Cell {
                    file,
                    chunk_in_file,
                    chunk,
                })
        })
        .collect();
    cells.sort_by_key(|c| c.chunk.stream_offset_bytes);
    cells
}

impl Drop for ArenaJob<'_> {
    fn drop(&mut self) {
        // Before the lease goes (a field, dropped after this): no copy may still be landing.
        self.release_sources();
    }
}
