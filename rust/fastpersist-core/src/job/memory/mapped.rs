//! Shared mappings of the in-memory level's files, kept between jobs.
//!
//! A Checkpointer on a memory root rotates the same few files (recycled by the Python side:
//! renamed from a retired step into the next save's temporary directory, same inode). Mapping a
//! 1 GiB file, populating its page tables and unmapping it again costs about as much as a third
//! of a memcpy of it, so after a job the mapping of each recycled file is kept here with its
//! open file, keyed by the file's (device, inode), and the next job that opens the same inode
//! with the same length writes through it directly. While kept, the open file keeps its
//! filesystem busy (no remount read-only or unmount): a one-off save of new files keeps nothing.
//!
//! Bounded: at most [`MAX_KEPT`] mappings are kept, and a kept mapping whose file has been
//! deleted (`st_nlink == 0`: retired without recycling, a removed root) is dropped at the next
//! job and by a background reaper within about [`REAP_EVERY`], so deleting a memory root gives
//! its memory back even if this process never saves again. Keeping the file open also keeps its
//! inode number from being reused while the mapping is kept, so a kept mapping can only ever be
//! matched by the very file it maps.

use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::{Mutex, MutexGuard, Once};
use std::time::Duration;

use crate::error::{Error, Result};

/// Most mappings kept between jobs (a Checkpointer needs `keep + 1` per data file).
pub(super) const MAX_KEPT: usize = 16;
/// How often the reaper drops kept mappings of deleted files.
pub(super) const REAP_EVERY: Duration = Duration::from_millis(500);

/// A shared read-write mapping of a whole file; unmapped on drop.
pub(super) struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a Mapping exclusively owns its address range (nothing else holds a pointer into it;
// slices borrow it mutably), so moving it to another thread moves that ownership with it.
unsafe impl Send for Mapping {}

impl Mapping {
    fn new(file: &File, len: usize, path: &Path) -> Result<Self> {
        if len == 0 {
            return Ok(Mapping {
                ptr: std::ptr::null_mut(),
                len,
            });
        }
        let ptr = crate::pages::map_shared(file, len).map_err(|e| Error::io("mmap", path, e))?;
        Ok(Mapping {
            ptr: ptr.as_ptr(), // unmapped only in Drop
            len,
        })
    }

    /// The address of the mapping's first byte (for page-table population only).
    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    /// The bytes `[start, start + len)` of the file, writable.
    pub fn range(&mut self, start: u64, len: u64) -> &mut [u8] {
        let (start, len) = (start as usize, len as usize);
        assert!(start.checked_add(len).is_some_and(|end| end <= self.len));
        if len == 0 {
            return &mut [];
        }
        // SAFETY: the range lies inside the mapping (asserted), which stays mapped while `self`
        // lives; `&mut self` makes the slice the only Rust reference into it. Every page of it
        // is backed: the caller set the file to this length and reserved it (fallocate) before
        // writing, so no store can fault on a hole of a full tmpfs.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: `ptr`/`len` are exactly what mmap returned; no slice into it outlives
            // `self` (they borrow it mutably).
            unsafe { libc::munmap(self.ptr.cast(), self.len) };
        }
    }
}

/// An open file of the in-memory level and its mapping.
pub(super) struct MappedFile {
    /// The file (kept open while the mapping is kept: it tells when the file was deleted).
    pub file: File,
    /// Its whole length, mapped shared.
    pub map: Mapping,
    dev: u64,
    ino: u64,
}

static KEPT: Mutex<VecDeque<MappedFile>> = Mutex::new(VecDeque::new());

fn kept() -> MutexGuard<'static, VecDeque<MappedFile>> {
    KEPT.lock().unwrap_or_else(|e| e.into_inner())
}

impl MappedFile {
    /// Maps `file` (`len` bytes long), reusing the mapping kept from an earlier job on the same
    /// inode and length; returns it and whether the mapping is new (its page tables empty).
    pub fn open(file: File, len: usize, path: &Path) -> Result<(MappedFile, bool)> {
        let meta = file.metadata().map_err(|e| Error::io("stat", path, e))?;
        let (dev, ino) = (meta.dev(), meta.ino());
        let found = {
            let mut kept = kept();
            let at = kept.iter().position(|m| m.dev == dev && m.ino == ino);
            at.and_then(|i| kept.remove(i))
        };
        if let Some(old) = found
            && old.map.len == len
        {
            // The same inode, so the same pages: the new descriptor replaces the old one.
            return Ok((MappedFile { file, ..old }, false));
        }
        let map = Mapping::new(&file, len, path)?;
        Ok((
            MappedFile {
                file,
                map,
                dev,
                ino,
            },
            true,
        ))
    }

    /// Keeps `self` for a later job on the same file (the oldest beyond [`MAX_KEPT`] go).
    pub fn keep(self) {
        if self.map.len == 0 {
            return;
        }
        let evicted: Vec<MappedFile> = {
            let mut kept = kept();
            kept.push_back(self);
            let over = kept.len().saturating_sub(MAX_KEPT);
            kept.drain(..over).collect()
        };
        drop(evicted); // unmapped outside the lock
        start_reaper();
    }
}

/// Drops the kept mappings whose files have been deleted; returns how many.
pub(super) fn drop_deleted() -> usize {
    let gone: VecDeque<MappedFile> = {
        let mut kept = kept();
        let (live, gone) = kept
            .drain(..)
            .partition(|m| m.file.metadata().is_ok_and(|meta| meta.nlink() > 0));
        *kept = live;
        gone
    };
    gone.len() // unmapped here, outside the lock
}

/// The inodes whose mappings are kept now.
#[cfg(test)]
pub(super) fn kept_inodes() -> Vec<u64> {
    kept().iter().map(|m| m.ino).collect()
}

/// How many mappings are kept now.
#[cfg(test)]
pub(super) fn kept_count() -> usize {
    kept().len()
}

fn start_reaper() {
    static STARTED: Once = Once::new();
    STARTED.call_once(|| {
        let spawned = std::thread::Builder::new()
            .name("fastpersist-reaper".into())
            .spawn(|| {
                loop {
                    std::thread::sleep(REAP_EVERY);
                    drop_deleted();
                }
            });
        drop(spawned); // without a reaper, deleted files are still dropped at the next job
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_mapping_is_reused_for_the_same_file_and_dropped_once_it_is_deleted() {
        let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
            return;
        };
        let path = dir.path().join("f");
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        let open = || File::options().read(true).write(true).open(&path).unwrap();
        let (mut first, fresh) = MappedFile::open(open(), 8192, &path).unwrap();
        assert!(fresh);
        first.map.range(0, 4).copy_from_slice(b"abcd");
        let addr = first.map.addr();
        first.keep();
        let (mut second, fresh) = MappedFile::open(open(), 8192, &path).unwrap();
        assert!(!fresh);
        assert_eq!(second.map.addr(), addr);
        assert_eq!(&second.map.range(0, 4)[..], b"abcd");
        assert_eq!(&std::fs::read(&path).unwrap()[..4], b"abcd"); // shared: the file has it
        let ino = second.ino;
        second.keep();
        std::fs::remove_file(&path).unwrap();
        drop_deleted();
        assert!(!kept().iter().any(|m| m.ino == ino));
    }

    #[test]
    fn another_length_maps_anew() {
        let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
            return;
        };
        let path = dir.path().join("g");
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        let open = || File::options().read(true).write(true).open(&path).unwrap();
        let (first, _) = MappedFile::open(open(), 8192, &path).unwrap();
        first.keep();
        let (second, fresh) = MappedFile::open(open(), 4096, &path).unwrap();
        assert!(fresh);
        assert!(kept_count() <= MAX_KEPT);
        drop(second);
    }
}
