//! The write phase of a device save's window (`from_arena`): the window's chunks handed to the
//! backend straight from the arena, round-robin across files, each once a checksum thread has
//! computed its crc32c.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

use super::WriteOptions;
use super::from_arena::{ArenaJob, Cell};
use crate::DIRECT_ALIGN_BYTES;
use crate::backend::{self, Direction, IoBuf, IoOp, Next, OpSource, OpenFile};
use crate::checksum::crc32c;
use crate::error::{Error, Result};
use crate::round_up;

/// Most threads that checksum a window's chunks.
const MAX_CRC_THREADS: usize = 8;

/// The cells of `window` in the order their writes are submitted: round-robin across files,
/// so that every stripe is busy at once.
impl ArenaJob<'_> {
    /// Writes `window` from the arena, its chunks checksummed by a bounded pool of threads,
    /// each before its write is submitted; returns once every write has completed.
    pub(super) fn write(
        &mut self,
        window: Range<usize>,
        files: &[OpenFile],
        direct: &[bool],
        options: &WriteOptions,
    ) -> Result<()> {
        let order = submission_order(&self.cells, window.clone());
        let board = CrcBoard::new(order.len());
        let checksums = self.checksum.then_some(&board);
        // What the checksum threads read: (arena offset, length) per position in `order`.
        let ranges: Vec<(usize, usize)> = order
            .iter()
            .map(|&index| {
                let len = self.cells[index].chunk.len_bytes as usize;
                (self.arena_offset(window.start, index), len)
            })
            .collect();
        let (arena, ranges) = (&self.arena, &ranges);
        let job = &*self;
        std::thread::scope(|scope| {
            if let Some(board) = checksums {
                for _ in 0..crc_threads(order.len()) {
                    scope.spawn(move || {
                        board.work(|k| {
                            let (offset, len) = ranges[k];
                            // SAFETY: the window is staged (its copies waited for) and only
                            // read from now until every write of it has completed.
                            crc32c(unsafe { arena.bytes(offset, len) })
                        });
                    });
                }
            }
            let mut ops = WindowWrites {
                job,
                window_start: window.start,
                order: &order,
                next: 0,
                direct,
                checksums,
            };
            let driven = backend::drive(
                options.backend,
                Direction::Write,
                files,
                options.queue_depth,
                &mut ops,
            );
            board.stop();
            driven
        })?;
        if self.checksum {
            for (k, crc) in board.into_values().into_iter().enumerate() {
                let cell = self.cells[order[k]];
                self.crcs[cell.file][cell.chunk_in_file] = crc.unwrap_or_default();
            }
        }
        Ok(())
    }
}

/// How many threads checksum `chunks` chunks: one per core, at most [`MAX_CRC_THREADS`].
pub(super) fn crc_threads(chunks: usize) -> usize {
    std::thread::available_parallelism()
        .map_or(1, usize::from)
        .clamp(1, MAX_CRC_THREADS)
        .min(chunks)
}

fn submission_order(cells: &[Cell], window: Range<usize>) -> Vec<usize> {
    let mut order: Vec<usize> = window.collect();
    order.sort_by_key(|&i| (cells[i].chunk_in_file, cells[i].file));
    order
}

/// The writes of one window, handed to the backend in submission order.
struct WindowWrites<'j, 'p> {
    job: &'j ArenaJob<'p>,
    window_start: usize,
    order: &'j [usize],
    /// The next position in `order`.
    next: usize,
    direct: &'j [bool],
    checksums: Option<&'j CrcBoard>,
}

impl<'a> OpSource<'a> for WindowWrites<'_, '_> {
    fn next_op(&mut self, may_block: bool) -> Result<Next<'a>> {
        if self.next == self.order.len() {
            return Ok(Next::Done);
        }
        self.job.progress.check_cancelled("while writing")?;
        if let Some(board) = self.checksums
            && !board.is_ready(self.next, may_block)?
        {
            return Ok(Next::NotYet);
        }
        let index = self.order[self.next];
        self.next += 1;
        let cell = self.job.cells[index];
        let logical_bytes = cell.chunk.len_bytes as usize;
        let len_bytes = if self.direct[cell.file] {
            round_up(logical_bytes, DIRECT_ALIGN_BYTES)
        } else {
            logical_bytes
        };
        let span = self
            .job
            .arena
            .span(
                self.job.arena_offset(self.window_start, index),
                self.job.cell_bytes,
            )
            .ok_or_else(|| Error::Internal("a cell runs past the arena".into()))?;
        Ok(Next::Op(IoOp {
            file: cell.file,
            offset_bytes: cell.chunk.file_offset_bytes,
            buf: IoBuf::Arena(span),
            len_bytes,
            min_bytes: len_bytes,
            done_bytes: 0,
            chunk_index: index,
        }))
    }

    fn completed(&mut self, op: IoOp<'a>) -> Result<()> {
        let chunk = self.job.cells[op.chunk_index].chunk;
        self.job.progress.add_written_bytes(chunk.len_bytes);
        Ok(())
    }
}

/// The checksums of a window's chunks, computed by worker threads in submission order and
/// waited for by the writer, one chunk at a time.
pub(super) struct CrcBoard {
    next: AtomicUsize,
    values: Mutex<Vec<Option<u32>>>,
    ready: Condvar,
    stopped: AtomicBool,
}

impl CrcBoard {
    pub(super) fn new(len: usize) -> Self {
        CrcBoard {
            next: AtomicUsize::new(0),
            values: Mutex::new(vec![None; len]),
            ready: Condvar::new(),
            stopped: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Option<u32>>> {
        self.values.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A worker's loop: checksums positions in order until none is left or the board stopped.
    /// A worker that panics stops the board, so the writer never waits for it in vain.
    pub(super) fn work(&self, checksum: impl Fn(usize) -> u32) {
        struct StopOnPanic<'b>(&'b CrcBoard);
        impl Drop for StopOnPanic<'_> {
            fn drop(&mut self) {
                if std::thread::panicking() {
                    self.0.stop();
                }
            }
        }
        let _stop = StopOnPanic(self);
        let len = self.lock().len();
        while !self.stopped.load(Ordering::Acquire) {
            let k = self.next.fetch_add(1, Ordering::AcqRel);
            if k >= len {
                return;
            }
            let value = checksum(k);
            self.lock()[k] = Some(value);
            self.ready.notify_all();
        }
    }

    /// Whether position `k`'s checksum is in; with `block`, waits until it is.
    fn is_ready(&self, k: usize, block: bool) -> Result<bool> {
        let mut values = self.lock();
        loop {
            if values[k].is_some() {
                return Ok(true);
            }
            if self.stopped.load(Ordering::Acquire) {
                return Err(Error::Internal(
                    "a checksum thread stopped before its chunks were done".into(),
                ));
            }
            if !block {
                return Ok(false);
            }
            values = self.ready.wait(values).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        let _values = self.lock();
        self.ready.notify_all();
    }

    pub(super) fn into_values(self) -> Vec<Option<u32>> {
        self.values.into_inner().unwrap_or_else(|e| e.into_inner())
    }
}
