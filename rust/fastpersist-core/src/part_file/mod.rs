//! Writing one part file from bytes that arrive in order from elsewhere: a level copying a share
//! to a directory, a drain downloading an object, a rank receiving a peer's share.
//!
//! The write jobs ([`crate::job`]) write from memory they stage themselves; this writer takes
//! pieces of any size, checks each chunk's crc32c as its last byte passes (before that byte is
//! written), writes with O_DIRECT where the filesystem takes it, and fsyncs at the end. A piece
//! that is page-aligned in memory and in the file is written from where it lies; anything else
//! goes through one aligned buffer, so the writes stay large and aligned whatever the pieces.
//!
//! Its tests, and the simulated filesystem their writes meet, are in `tests`.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::align::AlignedBuf;
use crate::checksum::Crc32c;
use crate::error::{Error, Result};
use crate::{DIRECT_ALIGN_BYTES, round_up};

/// The aligned buffer's size: large writes, and at most this much held per open writer.
pub const PART_FILE_BUFFER_BYTES: usize = 8 << 20;

/// How a new part file is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Create {
    /// The file must not exist yet (`O_EXCL`): a copy that finds one there is refused.
    New,
    /// An existing file is truncated (a store overwriting an object).
    Replace,
}

/// The chunks a new file's bytes are checked against.
#[derive(Debug, Clone, Default)]
pub struct Expected {
    /// One crc32c per chunk of `chunk_bytes` (the last may be shorter); empty: unchecked.
    pub chunk_crc32c: Vec<u32>,
    /// The chunk size the checksums were taken at.
    pub chunk_bytes: u64,
}

/// A part file being written front to back (see the module docs). Dropped without
/// [`PartFileWriter::finish`], the file stays as it is: the caller removes it (or calls
/// [`PartFileWriter::discard`]).
pub struct PartFileWriter {
    path: PathBuf,
    file: File,
    direct: bool,
    len_bytes: u64,
    /// File offset of the next byte appended.
    next: u64,
    expected: Expected,
    /// The running checksum of the chunk `chunk` (its bytes before `next`).
    crc: Crc32c,
    chunk: usize,
    /// Bytes appended but not yet written (direct I/O only); they start at `next - held`.
    buffer: Option<AlignedBuf>,
    held: usize,
}

impl std::fmt::Debug for PartFileWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartFileWriter")
            .field("path", &self.path)
            .field("direct", &self.direct)
            .field("len_bytes", &self.len_bytes)
            .field("written_bytes", &self.next)
            .finish()
    }
}

impl PartFileWriter {
    /// Creates the file `path` for `len_bytes` bytes checked against `expected`; `direct`: try
    /// O_DIRECT, falling back to buffered I/O where the filesystem refuses it.
    pub fn create(
        path: &Path,
        len_bytes: u64,
        expected: Expected,
        create: Create,
        direct: bool,
    ) -> Result<Self> {
        if !expected.chunk_crc32c.is_empty() {
            let chunks = if expected.chunk_bytes == 0 {
                u64::MAX
            } else {
                len_bytes.div_ceil(expected.chunk_bytes)
            };
            if chunks != expected.chunk_crc32c.len() as u64 {
                return Err(Error::InvalidArgument(format!(
                    "{}: {} chunk checksums for {len_bytes} bytes in chunks of {} bytes",
                    path.display(),
                    expected.chunk_crc32c.len(),
                    expected.chunk_bytes
                )));
            }
        }
        let (file, direct) = match direct.then(|| open(path, create, true)) {
            Some(Ok(file)) => (Ok(file), true),
            Some(Err(e)) if e.raw_os_error() == Some(libc::EINVAL) => {
                (open(path, create, false), false)
            }
            Some(Err(e)) => (Err(e), false),
            None => (open(path, create, false), false),
        };
        let file = file.map_err(|e| Error::io("create", path, e))?;
        Ok(PartFileWriter {
            path: path.to_path_buf(),
            file,
            direct,
            len_bytes,
            next: 0,
            expected,
            crc: Crc32c::default(),
            chunk: 0,
            buffer: None,
            held: 0,
        })
    }

    /// Whether the file is written with O_DIRECT.
    pub fn direct(&self) -> bool {
        self.direct
    }

    /// Bytes appended so far.
    pub fn written_bytes(&self) -> u64 {
        self.next
    }

    /// Appends `data`: every chunk it completes is checked first, then its bytes are written.
    pub fn append(&mut self, data: &[u8]) -> Result<()> {
        let end = self.next + data.len() as u64;
        if end > self.len_bytes {
            return Err(Error::InvalidArgument(format!(
                "{}: {} bytes at {} run past its {} bytes",
                self.path.display(),
                data.len(),
                self.next,
                self.len_bytes
            )));
        }
        self.check(data)?;
        if !self.direct {
            self.write_buffered(data, self.next)?;
        } else if self.held == 0 && aligned(data, self.next) {
            self.write_direct(data, self.next)?;
        } else {
            self.hold(data)?;
        }
        self.next = end;
        Ok(())
    }

    /// Writes what is held and sets the size: the file is whole and checked; `durable`: fsynced
    /// too (a copy another one vouches for may skip it). A file that cannot be finished (short,
    /// or a write or fsync failed) is removed.
    pub fn finish(mut self, durable: bool) -> Result<()> {
        let finished = self.complete(durable);
        if finished.is_err() {
            let _ = std::fs::remove_file(&self.path);
        }
        finished
    }

    fn complete(&mut self, durable: bool) -> Result<()> {
        if self.next != self.len_bytes {
            return Err(Error::SizeMismatch {
                path: self.path.clone(),
                expected_bytes: self.len_bytes,
                found_bytes: self.next,
            });
        }
        if self.held > 0 {
            let at = self.next - self.held as u64;
            let padded = round_up(self.held, DIRECT_ALIGN_BYTES);
            let buffer = self.buffer.take().expect("held bytes live in the buffer");
            self.write_direct(&buffer[..padded], at)?;
            self.held = 0;
        }
        // A held tail was written padded to the page: the file ends at its own length.
        self.file
            .set_len(self.len_bytes)
            .map_err(|e| Error::io("truncate", &self.path, e))?;
        if durable {
            self.file
                .sync_all()
                .map_err(|e| Error::io("fsync", &self.path, e))?;
        }
        Ok(())
    }

    /// Closes and removes the unfinished file.
    pub fn discard(self) -> Result<()> {
        let path = self.path.clone();
        drop(self);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("remove", path, e)),
        }
    }

    fn check(&mut self, mut data: &[u8]) -> Result<()> {
        let crcs = &self.expected.chunk_crc32c;
        if crcs.is_empty() {
            return Ok(());
        }
        let chunk_bytes = self.expected.chunk_bytes;
        let mut at = self.next;
        while !data.is_empty() {
            let start = self.chunk as u64 * chunk_bytes;
            let chunk_end = (start + chunk_bytes).min(self.len_bytes);
            let take = ((chunk_end - at) as usize).min(data.len());
            self.crc.update(&data[..take]);
            at += take as u64;
            data = &data[take..];
            if at == chunk_end {
                let found = self.crc.finish();
                let expected = crcs[self.chunk];
                if found != expected {
                    return Err(Error::ChecksumMismatch {
                        path: self.path.clone(),
                        offset_bytes: start,
                        len_bytes: chunk_end - start,
                        expected,
                        found,
                    });
                }
                self.crc = Crc32c::default();
                self.chunk += 1;
            }
        }
        Ok(())
    }

    /// Copies `data` into the aligned buffer, writing it out each time it fills.
    fn hold(&mut self, mut data: &[u8]) -> Result<()> {
        let capacity = round_up(
            (self.len_bytes.min(PART_FILE_BUFFER_BYTES as u64) as usize).max(1),
            DIRECT_ALIGN_BYTES,
        );
        let mut at = self.next;
        while !data.is_empty() {
            let buffer = self
                .buffer
                .get_or_insert_with(|| AlignedBuf::zeroed(capacity));
            let take = (buffer.len_bytes() - self.held).min(data.len());
            buffer[self.held..self.held + take].copy_from_slice(&data[..take]);
            self.held += take;
            at += take as u64;
            data = &data[take..];
            if self.held == buffer.len_bytes() {
                let buffer = self.buffer.take().expect("just filled");
                let start = at - self.held as u64;
                self.write_direct(&buffer, start)?;
                self.held = 0;
                if !self.direct {
                    // The write fell back to buffered I/O: nothing is held from here on, so the
                    // rest of this piece goes straight to its own offset.
                    return self.write_buffered(data, at);
                }
                self.buffer = Some(buffer);
            }
        }
        Ok(())
    }

    fn write_buffered(&mut self, data: &[u8], offset: u64) -> Result<()> {
        debug_assert_eq!(self.held, 0, "buffered writes never leave bytes held");
        write_all_at(&self.file, data, offset, false).map_err(|e| Error::io("write", &self.path, e))
    }

    fn write_direct(&mut self, data: &[u8], offset: u64) -> Result<()> {
        match write_all_at(&self.file, data, offset, true) {
            // Some filesystems open with O_DIRECT and then refuse the writes: nothing is written
            // yet, so the file is opened again for buffered I/O (the caller stops holding bytes).
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) && offset == 0 => {
                self.file = open(&self.path, Create::Replace, false)
                    .map_err(|e| Error::io("create", &self.path, e))?;
                self.direct = false;
                write_all_at(&self.file, data, offset, false)
            }
            written => written,
        }
        .map_err(|e| Error::io("write", &self.path, e))
    }
}

/// Writes all of `data` at `offset`, going on after short writes.
fn write_all_at(
    file: &File,
    mut data: &[u8],
    mut offset: u64,
    direct: bool,
) -> std::io::Result<()> {
    while !data.is_empty() {
        match write_once(file, data, offset, direct) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                data = &data[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(not(test))]
fn write_once(file: &File, data: &[u8], offset: u64, _direct: bool) -> std::io::Result<usize> {
    std::os::unix::fs::FileExt::write_at(file, data, offset)
}

#[cfg(test)]
fn write_once(file: &File, data: &[u8], offset: u64, direct: bool) -> std::io::Result<usize> {
    tests::faults::write_once(file, data, offset, direct)
}

fn aligned(data: &[u8], offset: u64) -> bool {
    let align = DIRECT_ALIGN_BYTES;
    (data.as_ptr() as usize).is_multiple_of(align)
        && data.len().is_multiple_of(align)
        && offset.is_multiple_of(align as u64)
}

fn open(path: &Path, create: Create, direct: bool) -> std::io::Result<File> {
    let mut options = OpenOptions::new();
    options.write(true);
    match create {
        Create::New => options.create_new(true),
        Create::Replace => options.create(true).truncate(true),
    };
    let flags = libc::O_CLOEXEC | libc::O_NOFOLLOW | if direct { libc::O_DIRECT } else { 0 };
    options.custom_flags(flags).mode(0o644).open(path)
}

#[cfg(test)]
mod tests;
