//! A read job: fill one destination buffer (the logical stream, or a range of it) from part
//! files with aligned reads, verifying each chunk's crc32c as it lands.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Instant;

use crate::DIRECT_ALIGN_BYTES;
use crate::backend::{self, Direction, IoBuf, IoOp, Next, OpSource, OpenFile};
use crate::checksum::crc32c;
use crate::error::{Error, Result};
use crate::pages::populate_write;
use crate::plan::{check_chunk_bytes, chunk_count, chunk_spans};
use crate::probe::{BackendKind, DirectMode};
use crate::round_up;

/// One range of a file to read into the destination (usually the whole file).
#[derive(Debug, Clone)]
pub struct ReadPart {
    /// The file.
    pub path: PathBuf,
    /// The file's expected size (checked before reading).
    pub file_len_bytes: u64,
    /// Where the range starts in the file (a multiple of the chunk size).
    pub file_offset_bytes: u64,
    /// Bytes to read (up to the end of the file).
    pub len_bytes: u64,
    /// Where the range's first byte goes in the destination.
    pub dest_offset_bytes: u64,
    /// Expected crc32c of each chunk of the range, or empty to skip verification.
    pub chunk_crc32c: Vec<u32>,
}

impl ReadPart {
    /// The whole of a file of `len_bytes`.
    pub fn whole(
        path: PathBuf,
        len_bytes: u64,
        dest_offset_bytes: u64,
        chunk_crc32c: Vec<u32>,
    ) -> Self {
        ReadPart {
            path,
            file_len_bytes: len_bytes,
            file_offset_bytes: 0,
            len_bytes,
            dest_offset_bytes,
            chunk_crc32c,
        }
    }
}

/// Knobs of one read job.
#[derive(Debug, Clone)]
pub struct ReadOptions {
    /// The backend.
    pub backend: BackendKind,
    /// O_DIRECT policy.
    pub direct: DirectMode,
    /// Reads in flight.
    pub queue_depth: usize,
    /// Size of one read (the chunk size the checksums were computed over).
    pub chunk_bytes: u64,
}

/// What a read job measured.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadStats {
    /// Bytes read (the sum of the parts' lengths).
    pub bytes: u64,
    /// Time spent verifying chunk checksums (included in the read's wall time: a chunk is
    /// checked as its read completes, on the driver thread or, for a large read, on a thread of
    /// its own, while later reads are in flight).
    pub crc32c_ns: u64,
}

struct ReadChunk {
    file: usize,
    file_offset_bytes: u64,
    dest_offset_bytes: usize,
    len_bytes: usize,
    expected_crc: Option<u32>,
}

/// Reads every part into `dest`. Parts must not overlap in `dest` and must fit in it.
pub fn read_parts(parts: &[ReadPart], dest: &mut [u8], options: &ReadOptions) -> Result<ReadStats> {
    check_chunk_bytes(options.chunk_bytes)?;
    let dest_len = dest.len() as u64;
    let dest_aligned = (dest.as_ptr() as usize).is_multiple_of(DIRECT_ALIGN_BYTES);
    let mut files = Vec::with_capacity(parts.len());
    let mut chunks = Vec::new();
    for (index, part) in parts.iter().enumerate() {
        check_part(part, dest_len, options.chunk_bytes)?;
        // O_DIRECT needs every destination address aligned and room for the padded tail.
        let padded_end = round_up(
            (part.dest_offset_bytes + part.len_bytes) as usize,
            DIRECT_ALIGN_BYTES,
        );
        let can_direct = dest_aligned
            && part
                .dest_offset_bytes
                .is_multiple_of(DIRECT_ALIGN_BYTES as u64)
            && padded_end as u64 <= dest_len;
        files.push(open_part(part, options.direct, can_direct)?);
        chunks.extend(
            chunk_spans(part.len_bytes, options.chunk_bytes)
                .enumerate()
                .map(|(i, span)| ReadChunk {
                    file: index,
                    file_offset_bytes: part.file_offset_bytes + span.offset_bytes,
                    dest_offset_bytes: (part.dest_offset_bytes + span.offset_bytes) as usize,
                    len_bytes: span.len_bytes as usize,
                    expected_crc: part.chunk_crc32c.get(i).copied(),
                }),
        );
    }
    chunks.sort_by_key(|c| c.dest_offset_bytes);
    let crc32c_ns = drive_reads(dest, chunks, &files, options)?;
    Ok(ReadStats {
        bytes: parts.iter().map(|p| p.len_bytes).sum(),
        crc32c_ns,
    })
}

/// Checks that `part` fits in a destination of `dest_len` bytes, is a chunk-aligned range of
/// its file, and has one checksum per chunk (or none).
fn check_part(part: &ReadPart, dest_len: u64, chunk_bytes: u64) -> Result<()> {
    let end = part.dest_offset_bytes.checked_add(part.len_bytes);
    if end.is_none_or(|e| e > dest_len) {
        return Err(Error::InvalidArgument(format!(
            "{}: {} bytes at destination offset {} do not fit in {dest_len} bytes",
            part.path.display(),
            part.len_bytes,
            part.dest_offset_bytes
        )));
    }
    let range_end = part.file_offset_bytes.checked_add(part.len_bytes);
    if !part.file_offset_bytes.is_multiple_of(chunk_bytes)
        || range_end.is_none_or(|e| e > part.file_len_bytes)
    {
        return Err(Error::InvalidArgument(format!(
            "{}: range [{}, +{}) is not chunk-aligned or runs past the file's {} bytes",
            part.path.display(),
            part.file_offset_bytes,
            part.len_bytes,
            part.file_len_bytes
        )));
    }
    let chunks = chunk_count(part.len_bytes, chunk_bytes);
    if !part.chunk_crc32c.is_empty() && part.chunk_crc32c.len() as u64 != chunks {
        return Err(Error::InvalidArgument(format!(
            "{}: {} checksums recorded for {chunks} chunks",
            part.path.display(),
            part.chunk_crc32c.len()
        )));
    }
    Ok(())
}

/// Opens `part`'s file (with O_DIRECT where `mode` and `can_direct` allow) and checks its size.
fn open_part(part: &ReadPart, mode: DirectMode, can_direct: bool) -> Result<OpenFile> {
    let (file, direct) = open_for_read_as(&part.path, mode, can_direct)?;
    let found = file
        .metadata()
        .map_err(|e| Error::io("stat", &part.path, e))?
        .len();
    if found != part.file_len_bytes {
        return Err(Error::SizeMismatch {
            path: part.path.clone(),
            expected_bytes: part.file_len_bytes,
            found_bytes: found,
        });
    }
    Ok(OpenFile {
        file,
        path: part.path.clone(),
        direct,
    })
}

/// Reads `chunks` (sorted by destination offset) of `files` into `dest`, with helper threads
/// for prefaulting and verifying when the read is large. Returns the time spent verifying.
fn drive_reads(
    dest: &mut [u8],
    chunks: Vec<ReadChunk>,
    files: &[OpenFile],
    options: &ReadOptions,
) -> Result<u64> {
    let dest_addr = dest.as_mut_ptr() as usize;
    // The first `queue_depth` chunks are submitted at once, faulting their own pages; the
    // prefaulter starts after them.
    let ahead: Vec<(usize, usize)> = chunks
        .iter()
        .skip(options.queue_depth)
        .map(|c| (dest_addr + c.dest_offset_bytes, c.len_bytes))
        .collect();
    let verified_bytes: usize = chunks
        .iter()
        .filter(|c| c.expected_crc.is_some())
        .map(|c| c.len_bytes)
        .sum();
    let mut source = ReadSource::new(dest, chunks, files)?;
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        if ahead.iter().map(|r| r.1).sum::<usize>() >= HELPER_THREAD_MIN_BYTES {
            scope.spawn(|| prefault(&ahead, &done));
        }
        let verifier = (verified_bytes >= HELPER_THREAD_MIN_BYTES).then(|| {
            let (sender, received) = mpsc::channel();
            let failed = Arc::new(AtomicBool::new(false));
            source.verifier = Some((sender, Arc::clone(&failed)));
            scope.spawn(move || verify_chunks(received, files, &failed))
        });
        let result = backend::drive(
            options.backend,
            Direction::Read,
            files,
            options.queue_depth,
            &mut source,
        );
        done.store(true, Ordering::Relaxed);
        source.verifier = None; // hangs up: the verifier ends once it has checked what it got
        if let Some(handle) = verifier {
            let (crc32c_ns, mismatch) = handle.join().expect("the checksum thread panicked");
            source.crc32c_ns += crc32c_ns;
            // A mismatch stopped the reads early; it is the error to report.
            if let Some(error) = mismatch {
                return Err(error);
            }
        }
        result
    })?;
    Ok(source.crc32c_ns)
}

/// A read job hands work to a thread of its own (faulting the destination in, checking the
/// checksums) only for at least this many bytes of it: below, a thread costs more than it saves.
const HELPER_THREAD_MIN_BYTES: usize = 32 << 20;

/// A chunk that has landed, to verify.
struct Landed<'a> {
    bytes: &'a [u8],
    chunk: ChunkId,
}

/// Which chunk of which file (for the error), and its recorded checksum.
struct ChunkId {
    file: usize,
    file_offset_bytes: u64,
    expected: u32,
}

/// Checks `bytes` against the chunk's recorded crc32c, adding the time spent to `crc32c_ns`.
fn verify(files: &[OpenFile], chunk: &ChunkId, bytes: &[u8], crc32c_ns: &mut u64) -> Result<()> {
    let started = Instant::now();
    let found = crc32c(bytes);
    *crc32c_ns += started.elapsed().as_nanos() as u64;
    if found == chunk.expected {
        return Ok(());
    }
    Err(Error::ChecksumMismatch {
        path: files[chunk.file].path.clone(),
        offset_bytes: chunk.file_offset_bytes,
        len_bytes: bytes.len() as u64,
        expected: chunk.expected,
        found,
    })
}

/// Checks each landed chunk's crc32c (cold memory, just written by the device: ~10 GB/s here,
/// a sixth of a read's time that the thread driving the reads no longer spends between
/// submissions). Returns the time spent and the first mismatch; after one, `failed` stops the
/// reads and the rest is only drained.
fn verify_chunks(
    landed: mpsc::Receiver<Landed<'_>>,
    files: &[OpenFile],
    failed: &AtomicBool,
) -> (u64, Option<Error>) {
    let mut crc32c_ns = 0u64;
    let mut first: Option<Error> = None;
    for Landed { bytes, chunk } in landed {
        if first.is_some() {
            continue;
        }
        if let Err(error) = verify(files, &chunk, bytes, &mut crc32c_ns) {
            first = Some(error);
            failed.store(true, Ordering::Relaxed);
        }
    }
    (crc32c_ns, first)
}

/// Faults in each destination range ahead of its read, in order, until the reads are `done`.
///
/// A fresh destination's pages are otherwise faulted in by the kernel while it submits each
/// read (pinning the pages for O_DIRECT), on the thread that drives the reads: about 0.3 s per
/// GiB of system time here, on top of checking checksums. On its own thread that work overlaps
/// the reads in flight, on another core.
fn prefault(ranges: &[(usize, usize)], done: &AtomicBool) {
    for &(addr, len_bytes) in ranges {
        if done.load(Ordering::Relaxed) || !populate_write(addr, len_bytes) {
            return;
        }
    }
}

/// Opens a part for reading, with O_DIRECT when `mode` and the destination allow it.
///
/// The file itself is the probe (O_DIRECT is refused with EINVAL at open where the file system
/// lacks it): a load never creates anything, so it works on a read-only file system or in a
/// directory the reader cannot write.
fn open_for_read_as(
    path: &std::path::Path,
    mode: DirectMode,
    can_direct: bool,
) -> Result<(std::fs::File, bool)> {
    if matches!(mode, DirectMode::Off) || !can_direct {
        return Ok((open_for_read(path, false)?, false));
    }
    match open_for_read(path, true) {
        Ok(file) => Ok((file, true)),
        Err(Error::Io { source, .. }) if source.raw_os_error() == Some(libc::EINVAL) => {
            if matches!(mode, DirectMode::Require) {
                return Err(Error::BackendUnavailable(format!(
                    "direct_io=\"require\" but the filesystem of {} refuses O_DIRECT (ramfs does, and tmpfs before \
                     Linux 6.6); use direct_io=\"auto\" or another directory",
                    path.display()
                )));
            }
            Ok((open_for_read(path, false)?, false))
        }
        Err(e) => Err(e),
    }
}

fn open_for_read(path: &std::path::Path, direct: bool) -> Result<std::fs::File> {
    // O_NOFOLLOW: a data file is never a symbolic link; a link planted in a checkpoint must not
    // make a load read from outside it (ELOOP instead).
    let flags = libc::O_CLOEXEC | libc::O_NOFOLLOW | if direct { libc::O_DIRECT } else { 0 };
    OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)
        .map_err(|e| Error::io("open", path, e))
}

struct ReadSource<'a, 'f> {
    /// Disjoint destination slices, one per chunk, in `chunks` order (taken as ops are made).
    slices: Vec<Option<&'a mut [u8]>>,
    chunks: Vec<ReadChunk>,
    files: &'f [OpenFile],
    next: usize,
    crc32c_ns: u64,
    /// Where landed chunks go to be verified, when a thread does it (else `completed` does),
    /// and whether it found a mismatch.
    verifier: Option<(mpsc::Sender<Landed<'a>>, Arc<AtomicBool>)>,
}

impl<'a, 'f> ReadSource<'a, 'f> {
    fn new(dest: &'a mut [u8], chunks: Vec<ReadChunk>, files: &'f [OpenFile]) -> Result<Self> {
        let mut slices = Vec::with_capacity(chunks.len());
        let mut rest = dest;
        let mut rest_offset = 0usize;
        for (i, chunk) in chunks.iter().enumerate() {
            if chunk.dest_offset_bytes < rest_offset {
                return Err(Error::InvalidArgument(format!(
                    "{} overlaps another file in the destination at offset {}",
                    files[chunk.file].path.display(),
                    chunk.dest_offset_bytes
                )));
            }
            let skip = chunk.dest_offset_bytes - rest_offset;
            let tail = std::mem::take(&mut rest).split_at_mut(skip).1;
            // The slice may include the padding up to the alignment (for O_DIRECT), but never
            // reaches into the next chunk's bytes.
            let next_start = chunks
                .get(i + 1)
                .map_or(usize::MAX, |c| c.dest_offset_bytes);
            let want = if files[chunk.file].direct {
                round_up(chunk.len_bytes, DIRECT_ALIGN_BYTES)
            } else {
                chunk.len_bytes
            };
            let take = want
                .min(tail.len())
                .min(next_start - chunk.dest_offset_bytes);
            if take < want {
                return Err(Error::Internal(format!(
                    "no room for the aligned read of {} at {}",
                    files[chunk.file].path.display(),
                    chunk.file_offset_bytes
                )));
            }
            let (mine, after) = tail.split_at_mut(take);
            slices.push(Some(mine));
            rest = after;
            rest_offset = chunk.dest_offset_bytes + take;
        }
        Ok(ReadSource {
            slices,
            chunks,
            files,
            next: 0,
            crc32c_ns: 0,
            verifier: None,
        })
    }
}

impl<'a> OpSource<'a> for ReadSource<'a, '_> {
    fn next_op(&mut self, _may_block: bool) -> Result<Next<'a>> {
        if let Some((_, failed)) = &self.verifier
            && failed.load(Ordering::Relaxed)
        {
            return Ok(Next::Done); // a checksum failed: read no further (read_parts reports it)
        }
        let Some(chunk) = self.chunks.get(self.next) else {
            return Ok(Next::Done);
        };
        let slice = self.slices[self.next].take().expect("each chunk read once");
        let op = IoOp {
            file: chunk.file,
            offset_bytes: chunk.file_offset_bytes,
            len_bytes: slice.len(),
            min_bytes: chunk.len_bytes,
            buf: IoBuf::Slice(slice),
            done_bytes: 0,
            chunk_index: self.next,
        };
        self.next += 1;
        Ok(Next::Op(op))
    }

    fn completed(&mut self, op: IoOp<'a>) -> Result<()> {
        let chunk = &self.chunks[op.chunk_index];
        let Some(expected) = chunk.expected_crc else {
            return Ok(());
        };
        let id = ChunkId {
            file: chunk.file,
            file_offset_bytes: chunk.file_offset_bytes,
            expected,
        };
        let len_bytes = chunk.len_bytes;
        if let Some((sender, _)) = &self.verifier {
            let IoBuf::Slice(slice) = op.buf else {
                return Err(Error::Internal("a read into a staging slot".into()));
            };
            let bytes: &'a [u8] = slice;
            // The verifier lives until read_parts hangs up: a send cannot fail before.
            let _ = sender.send(Landed {
                bytes: &bytes[..len_bytes],
                chunk: id,
            });
            return Ok(());
        }
        verify(
            self.files,
            &id,
            &op.buf.bytes()[..len_bytes],
            &mut self.crc32c_ns,
        )
    }
}
