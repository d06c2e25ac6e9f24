//! The staging arena of device saves: one page-aligned mapping, reused by every save that
//! stages device memory, leased to one job at a time.
//!
//! A device save copies its device bytes into the arena (the caller registers the arena with
//! the device's runtime once, so that the copies run at pinned speed), and the job writes its
//! chunks straight from it. The arena holds the job's chunks in stream order, one
//! `chunk_bytes` cell each, so that a tensor's bytes are one contiguous run of the arena and
//! need one device copy; a job whose chunks outnumber the cells stages them in arena-sized
//! windows, one after another.
//!
//! Writes reference arena memory through [`ArenaSpan`]s that keep the mapping alive: a backend
//! that has to give up on an in-flight write leaks its span (and so the mapping) rather than
//! let the memory go while the kernel may still read it.
//!
//! An arena may also be a shared mapping of one data file on a memory filesystem
//! ([`Arena::over_file`]): a save to the in-memory level whose part is that file stages its
//! bytes straight into the file's pages, and its job only checksums them (`job/memory/in_place.rs`).
//! The file keeps its inode while it moves from a save's temporary directory to its step and,
//! retired, back into a later save's (`saving/recycle.py`), so the mapping, and the device
//! runtime's registration of it, serve every save that recycles the file.

use std::fmt;
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::DIRECT_ALIGN_BYTES;
use crate::error::{Error, Result};
use crate::pages::{
    HUGE_PAGE_BYTES, map_huge_aligned, map_shared, populate_write, unmap_anonymous,
};
use crate::round_up;

/// What an arena's memory is.
enum Backing {
    /// Anonymous memory of this process.
    Anonymous,
    /// A shared mapping of `file`, `file_len` bytes long (the mapping ends at the page that
    /// holds the file's last byte, so no byte of it lies past the file's end).
    File { file: File, file_len: u64 },
}

struct ArenaMemory {
    base: NonNull<u8>,
    len_bytes: usize,
    leased: AtomicBool,
    backing: Backing,
}

// SAFETY: the mapping is owned by this struct alone. Its bytes are written only by the one job
// that holds the lease (and by the device copies that job asked for, which it waits for before
// it lets go of the lease), and read by that job's writes and checksums.
unsafe impl Send for ArenaMemory {}
// SAFETY: see above; the lease flag is atomic.
unsafe impl Sync for ArenaMemory {}

impl Drop for ArenaMemory {
    fn drop(&mut self) {
        match self.backing {
            // SAFETY: the mapping was made by map_huge_aligned in Arena::new with this length,
            // and nothing refers to it any more (every Arena, lease and span holds the Arc).
            Backing::Anonymous => unsafe { unmap_anonymous(self.base, self.len_bytes) },
            // SAFETY: the mapping was made by mmap in Arena::over_file with this length, and
            // nothing refers to it any more; the file closes after it.
            Backing::File { .. } => unsafe {
                libc::munmap(self.base.as_ptr().cast(), self.len_bytes);
            },
        }
    }
}

/// A staging arena: `len_bytes` of page-aligned memory (huge-page aligned and advised for
/// transparent huge pages), zeroed when made. Clones share the memory.
#[derive(Clone)]
pub struct Arena {
    memory: Arc<ArenaMemory>,
}

impl fmt::Debug for Arena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Arena")
            .field("len_bytes", &self.memory.len_bytes)
            .field("leased", &self.is_leased())
            .finish()
    }
}

impl Arena {
    /// Maps an arena of at least `len_bytes` (rounded up to whole huge pages).
    pub fn new(len_bytes: usize) -> std::io::Result<Arena> {
        let len_bytes = round_up(len_bytes.max(DIRECT_ALIGN_BYTES), HUGE_PAGE_BYTES);
        let base = map_huge_aligned(len_bytes)?;
        Ok(Arena {
            memory: Arc::new(ArenaMemory {
                base,
                len_bytes,
                leased: AtomicBool::new(false),
                backing: Backing::Anonymous,
            }),
        })
    }

    /// An arena that is the open `file` (named `name` in messages): a shared mapping of it,
    /// its page tables populated now, once per file, not by the first copy. The file must be a
    /// regular file of exactly `file_len` bytes, every one of them allocated: the mapping never
    /// changes its length, and a store into a page that a full memory filesystem could not
    /// allocate would be a SIGBUS.
    pub fn over_file(file: File, file_len: u64, name: &Path) -> Result<Arena> {
        let meta = file.metadata().map_err(|e| Error::io("stat", name, e))?;
        if file_len == 0
            || !meta.is_file()
            || meta.len() != file_len
            || meta.blocks().saturating_mul(512) < file_len
        {
            return Err(Error::InvalidArgument(format!(
                "a staging arena over {} needs a regular file of {file_len} bytes, all allocated \
                 (it has {} bytes, {} allocated)",
                name.display(),
                meta.len(),
                meta.blocks().saturating_mul(512)
            )));
        }
        // It ends at the page holding the file's last byte: no access through it can fault
        // past EOF. Unmapped only when the memory is dropped.
        let len_bytes = round_up(file_len as usize, DIRECT_ALIGN_BYTES);
        let base = map_shared(&file, len_bytes).map_err(|e| Error::io("mmap", name, e))?;
        populate_write(base.as_ptr() as usize, len_bytes);
        Ok(Arena {
            memory: Arc::new(ArenaMemory {
                base,
                len_bytes,
                leased: AtomicBool::new(false),
                backing: Backing::File { file, file_len },
            }),
        })
    }

    /// Whether the arena is a mapping of a file ([`Arena::over_file`]).
    pub fn is_file(&self) -> bool {
        self.memory.is_file()
    }

    /// For an arena over a file: its (device, inode) and its count of hard links (0 once the
    /// file is deleted: the arena then only holds its memory); None for anonymous memory.
    pub fn file_status(&self) -> Option<std::io::Result<((u64, u64), u64)>> {
        self.memory.file_status()
    }

    /// Its length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.memory.len_bytes
    }

    /// Its first byte, for registering the memory with a device runtime. The memory is valid
    /// while any clone, lease or span of this arena lives.
    pub fn as_ptr(&self) -> *mut u8 {
        self.memory.base.as_ptr()
    }

    /// Whether a job holds the arena now.
    pub fn is_leased(&self) -> bool {
        self.memory.leased.load(Ordering::Acquire)
    }

    /// The arena for one job, unless another job holds it.
    pub fn try_lease(&self) -> Option<ArenaLease> {
        self.memory
            .leased
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| ArenaLease {
                memory: Arc::clone(&self.memory),
            })
    }
}

impl ArenaMemory {
    fn is_file(&self) -> bool {
        matches!(self.backing, Backing::File { .. })
    }

    fn file_status(&self) -> Option<std::io::Result<((u64, u64), u64)>> {
        match &self.backing {
            Backing::Anonymous => None,
            Backing::File { file, .. } => {
                Some(file.metadata().map(|m| ((m.dev(), m.ino()), m.nlink())))
            }
        }
    }
}

/// One job's hold on an [`Arena`]; the arena is free again when it is dropped.
pub struct ArenaLease {
    memory: Arc<ArenaMemory>,
}

impl fmt::Debug for ArenaLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ArenaLease")
            .field("len_bytes", &self.memory.len_bytes)
            .finish()
    }
}

impl Drop for ArenaLease {
    fn drop(&mut self) {
        self.memory.leased.store(false, Ordering::Release);
    }
}

impl ArenaLease {
    /// The arena's length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.memory.len_bytes
    }

    /// The arena's first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.memory.base.as_ptr()
    }

    /// Whether the arena is a mapping of a file ([`Arena::over_file`]).
    pub fn is_file(&self) -> bool {
        self.memory.is_file()
    }

    /// Whether the arena is the file of the job's one part at `path`, `part_len` bytes long:
    /// the job then writes it in place (`job/memory/in_place.rs`). An anonymous arena is not; an arena
    /// over any other file, or over this one at another length, is refused: its bytes belong to
    /// that file, which may be a committed step's.
    pub fn is_file_of(&self, path: &Path, part_len: u64) -> Result<bool> {
        let Backing::File { file_len, .. } = &self.memory.backing else {
            return Ok(false);
        };
        let ours = self
            .memory
            .file_status()
            .expect("a file arena")
            .map_err(|e| Error::io("stat", path, e))?
            .0;
        let target = std::fs::symlink_metadata(path).map_err(|e| Error::io("stat", path, e))?;
        if (target.dev(), target.ino()) != ours || *file_len != part_len || target.len() != part_len
        {
            return Err(Error::InvalidArgument(format!(
                "the staging arena is a mapping of another file (or of {} at another length \
                 than its {part_len} bytes): it may only stage that file",
                path.display()
            )));
        }
        Ok(true)
    }

    /// fsyncs the arena's file (a formality on a memory filesystem, kept for the contract).
    pub fn sync_file(&self, path: &Path) -> Result<()> {
        match &self.memory.backing {
            Backing::File { file, .. } => file.sync_all().map_err(|e| Error::io("fsync", path, e)),
            Backing::Anonymous => Ok(()),
        }
    }

    /// The arena's bytes `[offset_bytes, offset_bytes + len_bytes)`, for a write to read from;
    /// None if they run past its end.
    pub fn span(&self, offset_bytes: usize, len_bytes: usize) -> Option<ArenaSpan> {
        let end = offset_bytes.checked_add(len_bytes)?;
        (end <= self.memory.len_bytes).then(|| ArenaSpan {
            memory: Arc::clone(&self.memory),
            offset_bytes,
            len_bytes,
        })
    }

    /// The arena's bytes `[offset_bytes, offset_bytes + len_bytes)`, read-only.
    ///
    /// # Safety
    /// Nothing may write those bytes while the slice lives: no device copy into them may be in
    /// flight (the job has waited for its copies) and the job does not fill them meanwhile.
    pub unsafe fn bytes(&self, offset_bytes: usize, len_bytes: usize) -> &[u8] {
        assert!(offset_bytes + len_bytes <= self.memory.len_bytes);
        // SAFETY: in bounds (asserted); the mapping lives as long as `self`; no writer (the
        // caller's promise).
        unsafe { std::slice::from_raw_parts(self.as_ptr().add(offset_bytes), len_bytes) }
    }

    /// The arena's bytes `[offset_bytes, offset_bytes + len_bytes)`, writable.
    ///
    /// # Safety
    /// Nothing else may read or write those bytes while the slice lives: no device copy into
    /// them in flight, no write or checksum reading them.
    #[allow(clippy::mut_from_ref)] // the lease is the job's alone; the caller keeps ranges apart
    pub unsafe fn bytes_mut(&self, offset_bytes: usize, len_bytes: usize) -> &mut [u8] {
        assert!(offset_bytes + len_bytes <= self.memory.len_bytes);
        // SAFETY: in bounds (asserted); the mapping lives as long as `self`; exclusive (the
        // caller's promise).
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr().add(offset_bytes), len_bytes) }
    }
}

/// Bytes of an arena that a write reads; keeps the arena's memory mapped while it lives.
pub struct ArenaSpan {
    memory: Arc<ArenaMemory>,
    offset_bytes: usize,
    len_bytes: usize,
}

impl fmt::Debug for ArenaSpan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ArenaSpan")
            .field("offset_bytes", &self.offset_bytes)
            .field("len_bytes", &self.len_bytes)
            .finish()
    }
}

impl ArenaSpan {
    /// The span's first byte.
    pub fn as_ptr(&self) -> *const u8 {
        // SAFETY: offset_bytes + len_bytes <= the mapping's length (checked in ArenaLease::span).
        unsafe { self.memory.base.as_ptr().add(self.offset_bytes) }
    }

    /// Its length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// The span's bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: in bounds (see as_ptr), mapped while `self` lives. A span is made only for a
        // range the job has finished filling (its device copies waited for), and nothing writes
        // it until the write reading it has completed and the span is dropped.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len_bytes) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_lease_at_a_time() {
        let arena = Arena::new(3 << 20).unwrap();
        assert_eq!(arena.len_bytes(), 4 << 20);
        assert_eq!(arena.as_ptr() as usize % HUGE_PAGE_BYTES, 0);
        let lease = arena.try_lease().unwrap();
        assert!(arena.is_leased());
        assert!(arena.try_lease().is_none());
        drop(lease);
        assert!(!arena.is_leased());
        assert!(arena.try_lease().is_some());
    }

    #[test]
    fn spans_keep_the_memory_and_stay_inside() {
        let arena = Arena::new(1).unwrap();
        let lease = arena.try_lease().unwrap();
        // SAFETY: nothing else touches the arena in this test.
        unsafe { lease.bytes_mut(4096, 3).copy_from_slice(&[1, 2, 3]) };
        let span = lease.span(4096, 4096).unwrap();
        assert!(lease.span(arena.len_bytes() - 1, 2).is_none());
        drop((lease, arena));
        assert_eq!(&span.bytes()[..4], &[1, 2, 3, 0]);
    }

    fn whole_file(path: &Path, len: usize, byte: u8) -> File {
        std::fs::write(path, vec![byte; len]).unwrap();
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap()
    }

    #[test]
    fn a_file_arena_is_the_files_pages_and_stages_only_that_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        let arena = Arena::over_file(whole_file(&path, 5000, 9), 5000, &path).unwrap();
        assert_eq!(arena.len_bytes(), 8192);
        let lease = arena.try_lease().unwrap();
        // SAFETY: nothing else touches the arena in this test.
        assert!(unsafe { lease.bytes(0, 5000) }.iter().all(|&b| b == 9));
        // SAFETY: as above.
        unsafe { lease.bytes_mut(4990, 10).fill(7) };
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(
            (bytes.len(), &bytes[4988..]),
            (5000, &[9, 9, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7][..])
        );
        assert!(lease.is_file_of(&path, 5000).unwrap());
        assert!(lease.is_file_of(&path, 4096).is_err()); // another length
        let other = dir.path().join("other");
        std::fs::write(&other, vec![0; 5000]).unwrap();
        assert!(lease.is_file_of(&other, 5000).is_err());
        let anonymous = Arena::new(1).unwrap();
        assert!(
            !anonymous
                .try_lease()
                .unwrap()
                .is_file_of(&other, 5000)
                .unwrap()
        );
        // Renamed (as a step's file is when it commits, retires and is recycled): still it.
        let moved = dir.path().join("moved");
        std::fs::rename(&path, &moved).unwrap();
        assert!(lease.is_file_of(&moved, 5000).unwrap());
        assert_eq!(arena.file_status().unwrap().unwrap().1, 1);
        std::fs::remove_file(&moved).unwrap();
        assert_eq!(arena.file_status().unwrap().unwrap().1, 0);
        assert!(anonymous.file_status().is_none());
    }

    #[test]
    fn only_a_whole_file_of_the_length_asked_for_is_mapped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        let file = || whole_file(&path, 10_000, 1);
        assert!(Arena::over_file(file(), 10_000, &path).is_ok());
        assert!(Arena::over_file(file(), 6000, &path).is_err()); // never truncated
        assert!(Arena::over_file(file(), 20_000, &path).is_err()); // never grown
        let holes = file();
        holes.set_len(1 << 20).unwrap(); // a hole: its pages are not allocated
        assert!(Arena::over_file(holes, 1 << 20, &path).is_err());
        let empty = dir.path().join("empty");
        assert!(Arena::over_file(whole_file(&empty, 0, 0), 0, &empty).is_err());
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 1 << 20); // left as it was
    }
}
