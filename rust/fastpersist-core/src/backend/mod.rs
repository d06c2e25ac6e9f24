//! Moving chunks between memory and files: the shared driver loop, two backends and a null sink.
//!
//! A job describes its work as an [`OpSource`]: it hands out [`IoOp`]s (staging a pool slot for a
//! write, carving a destination slice for a read) and is told when each completes. [`drive`]
//! keeps up to `queue_depth` ops in flight on the chosen backend until the source is exhausted,
//! then drains. On the first error it stops taking new ops, drains what is in flight (buffers
//! stay owned by the in-flight table until their completion arrives) and returns that error.
//!
//! The backends: `uring` (io_uring, one ring per job), `threads` (the fallback: a pool of threads
//! doing blocking `pwrite`/`pread`) and `null` (a sink that completes every write at once without
//! a system call, for benchmarks; never a user's choice).

mod null;
mod threads;
mod uring;

use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::path::PathBuf;

use crate::arena::ArenaSpan;
use crate::error::{Error, Result};
use crate::pool::Slot;
pub use crate::probe::BackendKind;

/// Most transfers a job keeps in flight (larger requests are clamped).
pub const MAX_QUEUE_DEPTH: usize = 1024;

/// An open data file and its path (for error messages).
#[derive(Debug)]
pub struct OpenFile {
    /// The file.
    pub file: File,
    /// Its path.
    pub path: PathBuf,
    /// Opened with O_DIRECT: every transfer must be aligned.
    pub direct: bool,
}

impl OpenFile {
    fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

/// Which way bytes move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Memory to file.
    Write,
    /// File to memory.
    Read,
}

/// Memory an op transfers from or into.
#[derive(Debug)]
pub enum IoBuf<'a> {
    /// A staging slot (writes). Returns to its pool when the op is dropped after completion.
    Slot(Slot),
    /// A caller-owned destination (reads).
    Slice(&'a mut [u8]),
    /// Bytes of a staging arena (writes): read, never written, by the transfer.
    Arena(ArenaSpan),
}

impl IoBuf<'_> {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        match self {
            IoBuf::Slot(slot) => slot.buf_mut().as_mut_ptr(),
            IoBuf::Slice(slice) => slice.as_mut_ptr(),
            // Only writes take arena bytes, and a write's transfer only reads its buffer.
            IoBuf::Arena(span) => span.as_ptr().cast_mut(),
        }
    }

    /// The buffer's bytes, to transfer into (reads only).
    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            IoBuf::Slot(slot) => &mut slot.buf_mut()[..],
            IoBuf::Slice(slice) => slice,
            IoBuf::Arena(_) => unreachable!("arena bytes are only written out, never read into"),
        }
    }

    fn capacity_bytes(&self) -> usize {
        match self {
            IoBuf::Slot(slot) => slot.buf().len_bytes(),
            IoBuf::Slice(slice) => slice.len(),
            IoBuf::Arena(span) => span.len_bytes(),
        }
    }

    /// The buffer's bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            IoBuf::Slot(slot) => slot.buf(),
            IoBuf::Slice(slice) => slice,
            IoBuf::Arena(span) => span.bytes(),
        }
    }
}

/// One transfer between a buffer and a file range.
#[derive(Debug)]
pub struct IoOp<'a> {
    /// Index into the job's files.
    pub file: usize,
    /// Where in the file the transfer starts.
    pub offset_bytes: u64,
    /// The memory.
    pub buf: IoBuf<'a>,
    /// Bytes to transfer (padded to the alignment for O_DIRECT).
    pub len_bytes: usize,
    /// Reads only: the op is complete once this many bytes arrived, even if end-of-file cut the
    /// padded remainder. Writes set it to `len_bytes`.
    pub min_bytes: usize,
    /// Bytes transferred so far (short transfers are resubmitted from here).
    pub done_bytes: usize,
    /// Which of its chunks the source made this op for (its index in the source's own list),
    /// handed back in [`OpSource::completed`].
    pub chunk_index: usize,
}

/// What a source has next.
#[derive(Debug)]
pub enum Next<'a> {
    /// Submit this op.
    Op(IoOp<'a>),
    /// Nothing can be produced without blocking (e.g. no free slot); ask again after a completion.
    NotYet,
    /// No more ops.
    Done,
}

/// The job side of the driver loop.
pub trait OpSource<'a> {
    /// The next op. `may_block` is true only when nothing is in flight, so blocking cannot
    /// deadlock on slots that only a completion would return.
    fn next_op(&mut self, may_block: bool) -> Result<Next<'a>>;
    /// An op finished successfully (all its bytes moved).
    fn completed(&mut self, op: IoOp<'a>) -> Result<()>;
    /// Called while every queue slot is busy: prepare one more op ahead of time (a write stages
    /// a chunk into a free pool slot) without blocking. Returns whether it did.
    fn prepare_ahead(&mut self) -> Result<bool> {
        Ok(false)
    }
}

/// Outcome of one (possibly partial) transfer.
enum Progress {
    Complete,
    Resubmit,
}

/// Accounts `transferred` bytes of `op`; errors on a zero-byte write or an early end-of-file.
fn advance(
    op: &mut IoOp<'_>,
    direction: Direction,
    transferred: usize,
    file: &OpenFile,
) -> Result<Progress> {
    if transferred == 0 {
        return match direction {
            Direction::Read if op.done_bytes >= op.min_bytes => Ok(Progress::Complete),
            Direction::Read => Err(Error::SizeMismatch {
                path: file.path.clone(),
                expected_bytes: op.offset_bytes + op.min_bytes as u64,
                found_bytes: op.offset_bytes + op.done_bytes as u64,
            }),
            Direction::Write => Err(Error::io(
                "write",
                &file.path,
                std::io::Error::new(std::io::ErrorKind::WriteZero, "write returned 0 bytes"),
            )),
        };
    }
    op.done_bytes += transferred;
    let complete = match direction {
        // A read may stop at end-of-file inside the padding: enough once the logical bytes arrived.
        Direction::Read => op.done_bytes >= op.min_bytes,
        Direction::Write => op.done_bytes >= op.len_bytes,
    };
    Ok(if complete {
        Progress::Complete
    } else {
        Progress::Resubmit
    })
}

fn check_op(op: &IoOp<'_>, file: &OpenFile) -> Result<()> {
    let align = crate::DIRECT_ALIGN_BYTES;
    let bad = op.len_bytes > op.buf.capacity_bytes()
        || op.min_bytes > op.len_bytes
        || op.len_bytes > u32::MAX as usize
        || (file.direct
            && (!op.offset_bytes.is_multiple_of(align as u64)
                || !op.len_bytes.is_multiple_of(align)
                || !(op.buf.bytes().as_ptr() as usize).is_multiple_of(align)));
    if bad {
        return Err(Error::Internal(format!(
            "misaligned or oversized transfer of {} bytes at offset {} of {} (direct={})",
            op.len_bytes,
            op.offset_bytes,
            file.path.display(),
            file.direct
        )));
    }
    Ok(())
}

/// A backend's submission side, as seen by the driver loop.
trait Submitter<'a> {
    /// Queues an op (it is in flight from here until it comes back from `wait`).
    fn push(&mut self, op: IoOp<'a>) -> Result<()>;
    /// Waits for at least one completion (or a resubmission) and appends finished ops.
    fn wait(&mut self, finished: &mut Vec<(IoOp<'a>, Result<()>)>) -> Result<()>;
    /// Appends ops that have already finished, without waiting.
    fn poll(&mut self, finished: &mut Vec<(IoOp<'a>, Result<()>)>) -> Result<()>;
}

/// Runs `source` to completion on `backend` with up to `queue_depth` ops in flight.
pub fn drive<'a>(
    backend: BackendKind,
    direction: Direction,
    files: &[OpenFile],
    queue_depth: usize,
    source: &mut dyn OpSource<'a>,
) -> Result<()> {
    let queue_depth = queue_depth.clamp(1, MAX_QUEUE_DEPTH);
    match backend {
        BackendKind::IoUring => {
            let mut ring = uring::UringSubmitter::new(direction, files, queue_depth)?;
            run_loop(&mut ring, files, queue_depth, source)
        }
        BackendKind::Threads => threads::with_workers(direction, files, queue_depth, |workers| {
            run_loop(workers, files, queue_depth, source)
        }),
        BackendKind::Null if direction == Direction::Read => Err(Error::InvalidArgument(
            "the null sink only takes writes (it moves no bytes): read with \"io_uring\" or \"threads\""
                .into(),
        )),
        BackendKind::Null => run_loop(&mut null::NullDisk::new(queue_depth), files, queue_depth, source),
    }
}

fn run_loop<'a>(
    submitter: &mut dyn Submitter<'a>,
    files: &[OpenFile],
    queue_depth: usize,
    source: &mut dyn OpSource<'a>,
) -> Result<()> {
    let mut in_flight = 0usize;
    let mut source_done = false;
    let mut first_error: Option<Error> = None;
    let mut finished = Vec::with_capacity(queue_depth);
    loop {
        while first_error.is_none() && !source_done && in_flight < queue_depth {
            match source.next_op(in_flight == 0) {
                Ok(Next::Op(op)) => {
                    let checked = files
                        .get(op.file)
                        .ok_or_else(|| Error::Internal(format!("no file {}", op.file)))
                        .and_then(|file| check_op(&op, file));
                    match checked.and_then(|()| submitter.push(op)) {
                        Ok(()) => in_flight += 1,
                        Err(e) => first_error = Some(e),
                    }
                }
                Ok(Next::NotYet) => break,
                Ok(Next::Done) => source_done = true,
                Err(e) => first_error = Some(e),
            }
        }
        if in_flight == 0 {
            break;
        }
        // The queue is full: until something completes, let the source work ahead (a write
        // copies further chunks into free pool slots, so with a pool as large as the state its
        // sources are released after one memory copy instead of at the disk's pace).
        while first_error.is_none() && finished.is_empty() {
            match source.prepare_ahead() {
                Ok(true) => submitter.poll(&mut finished)?,
                Ok(false) => break,
                Err(e) => first_error = Some(e),
            }
        }
        // A failure of the wait itself leaves ops in flight; the submitter's drop handles them.
        if finished.is_empty() {
            submitter.wait(&mut finished)?;
        }
        for (op, result) in finished.drain(..) {
            in_flight -= 1;
            let outcome = result.and_then(|()| {
                if first_error.is_none() {
                    source.completed(op)
                } else {
                    Ok(())
                }
            });
            if let Err(e) = outcome {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// For the criterion benches only (not part of the API): the driver loop against the null sink,
/// so the loop's own cost can be measured.
#[doc(hidden)]
pub mod bench_support {
    use super::{MAX_QUEUE_DEPTH, OpSource, OpenFile, null::NullDisk, run_loop};
    use crate::error::Result;

    /// Runs `source` to completion against the null sink with up to `queue_depth` ops in
    /// flight (`files` are only consulted for the alignment checks, never touched).
    pub fn drive_null<'a>(
        files: &[OpenFile],
        queue_depth: usize,
        source: &mut dyn OpSource<'a>,
    ) -> Result<()> {
        let queue_depth = queue_depth.clamp(1, MAX_QUEUE_DEPTH);
        run_loop(&mut NullDisk::new(queue_depth), files, queue_depth, source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(len: usize, min: usize, buf: &mut [u8]) -> IoOp<'_> {
        IoOp {
            file: 0,
            offset_bytes: 0,
            buf: IoBuf::Slice(buf),
            len_bytes: len,
            min_bytes: min,
            done_bytes: 0,
            chunk_index: 0,
        }
    }

    fn file() -> OpenFile {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        OpenFile {
            file: std::fs::File::create(&path).unwrap(),
            path,
            direct: false,
        }
    }

    /// A disk that completes nothing until waited on.
    struct SlowDisk<'a> {
        pending: Vec<IoOp<'a>>,
    }

    impl<'a> Submitter<'a> for SlowDisk<'a> {
        fn push(&mut self, op: IoOp<'a>) -> Result<()> {
            self.pending.push(op);
            Ok(())
        }
        fn wait(&mut self, finished: &mut Vec<(IoOp<'a>, Result<()>)>) -> Result<()> {
            finished.extend(self.pending.drain(..).map(|op| (op, Ok(()))));
            Ok(())
        }
        fn poll(&mut self, _finished: &mut Vec<(IoOp<'a>, Result<()>)>) -> Result<()> {
            Ok(())
        }
    }

    /// Hands out `total` ops; counts how many it prepared ahead.
    struct Counting<'a> {
        bufs: Vec<&'a mut [u8]>,
        ahead: Vec<&'a mut [u8]>,
        most_ahead: usize,
        completed: usize,
    }

    impl<'a> Counting<'a> {
        fn op(buf: &'a mut [u8]) -> IoOp<'a> {
            IoOp {
                file: 0,
                offset_bytes: 0,
                len_bytes: buf.len(),
                min_bytes: buf.len(),
                buf: IoBuf::Slice(buf),
                done_bytes: 0,
                chunk_index: 0,
            }
        }
    }

    impl<'a> OpSource<'a> for Counting<'a> {
        fn next_op(&mut self, _may_block: bool) -> Result<Next<'a>> {
            let buf = if self.ahead.is_empty() {
                self.bufs.pop()
            } else {
                Some(self.ahead.remove(0))
            };
            Ok(buf.map_or(Next::Done, |b| Next::Op(Self::op(b))))
        }
        fn completed(&mut self, _op: IoOp<'a>) -> Result<()> {
            self.completed += 1;
            Ok(())
        }
        fn prepare_ahead(&mut self) -> Result<bool> {
            let Some(buf) = self.bufs.pop() else {
                return Ok(false);
            };
            self.ahead.push(buf);
            self.most_ahead = self.most_ahead.max(self.ahead.len());
            Ok(true)
        }
    }

    #[test]
    fn a_full_queue_lets_the_source_work_ahead() {
        let files = [file()];
        let mut mem = [0u8; 10 * 16];
        let mut source = Counting {
            bufs: mem.chunks_mut(16).collect(),
            ahead: Vec::new(),
            most_ahead: 0,
            completed: 0,
        };
        let mut disk = SlowDisk {
            pending: Vec::new(),
        };
        run_loop(&mut disk, &files, 3, &mut source).unwrap();
        // Three ops in flight, and all seven others prepared before the first completion.
        assert_eq!(source.most_ahead, 7);
        assert_eq!(source.completed, 10);
    }

    #[test]
    fn short_transfers_resubmit_until_done() {
        let (f, mut mem) = (file(), vec![0u8; 8192]);
        let mut w = op(8192, 8192, &mut mem);
        assert!(matches!(
            advance(&mut w, Direction::Write, 4096, &f),
            Ok(Progress::Resubmit)
        ));
        assert_eq!(w.done_bytes, 4096);
        assert!(matches!(
            advance(&mut w, Direction::Write, 4096, &f),
            Ok(Progress::Complete)
        ));
        let mut w = op(8192, 8192, &mut mem);
        assert!(matches!(
            advance(&mut w, Direction::Write, 0, &f),
            Err(Error::Io { .. })
        ));
    }

    #[test]
    fn reads_complete_at_logical_length_and_detect_truncation() {
        let (f, mut mem) = (file(), vec![0u8; 8192]);
        let mut r = op(8192, 5000, &mut mem);
        assert!(matches!(
            advance(&mut r, Direction::Read, 3000, &f),
            Ok(Progress::Resubmit)
        ));
        assert!(matches!(
            advance(&mut r, Direction::Read, 2000, &f),
            Ok(Progress::Complete)
        ));
        let mut r = op(8192, 5000, &mut mem);
        assert!(matches!(
            advance(&mut r, Direction::Read, 3000, &f),
            Ok(Progress::Resubmit)
        ));
        assert!(matches!(
            advance(&mut r, Direction::Read, 0, &f),
            Err(Error::SizeMismatch { .. })
        ));
    }
}
