//! A memory-level file made ready ahead of the save that will overwrite it: its pages allocated
//! and its mapping's page tables populated, a slice at a time, then the mapping kept
//! ([`mapped`](super::mapped)) for that save to write through.
//!
//! A Checkpointer on a memory root recycles a retired step's files, so its steady saves allocate
//! nothing; its first `keep` saves would each allocate a fresh step's worth of tmpfs pages and
//! populate a new mapping of them (about 0.4 s and 0.4 s per GiB here, against 0.15-0.3 s for the
//! copy itself). The Python side (`memory_level/spares.py`) makes those files while the training
//! step runs, on a low-priority thread that stops between slices once a save starts; it hands a
//! file over only once its pages are all allocated. Neither step changes a byte of the file, and
//! a mapping that was not completed is not kept (the save then maps and populates it itself).

use std::fs::File;
use std::path::{Path, PathBuf};

use super::mapped::MappedFile;
use crate::error::{Error, Result};

/// A file on a memory filesystem being made ready, one [`FileAhead::advance`] at a time.
pub struct FileAhead {
    name: PathBuf,
    len_bytes: u64,
    /// The open file until it is mapped (the mapping then holds it).
    file: Option<File>,
    allocated: u64,
    map: Option<MappedFile>,
    populated: u64,
    done: bool,
}

impl std::fmt::Debug for FileAhead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileAhead")
            .field("name", &self.name)
            .field("len_bytes", &self.len_bytes)
            .field("allocated", &self.allocated)
            .field("populated", &self.populated)
            .field("done", &self.done)
            .finish()
    }
}

impl FileAhead {
    /// Starts on `file` (named `name` in messages), a regular file on a memory filesystem that
    /// the next save will overwrite with `len_bytes` bytes; sets it to that length.
    pub fn new(file: File, len_bytes: u64, name: &Path) -> Result<Self> {
        let meta = file.metadata().map_err(|e| Error::io("stat", name, e))?;
        if !meta.is_file() || !super::is_memory_fs(super::super::parent_dir(name))? {
            return Err(Error::InvalidArgument(format!(
                "{} is not a regular file on a memory filesystem",
                name.display()
            )));
        }
        if meta.len() != len_bytes {
            file.set_len(len_bytes)
                .map_err(|e| Error::io("truncate", name, e))?;
        }
        // Pages a recycled file holds already need no allocating.
        let allocated = if super::is_whole(&meta, len_bytes) {
            len_bytes
        } else {
            0
        };
        Ok(FileAhead {
            name: name.to_path_buf(),
            len_bytes,
            file: Some(file),
            allocated,
            map: None,
            populated: 0,
            done: len_bytes == 0,
        })
    }

    /// Does the next piece of at most `max_bytes`: allocates the next pages, else maps the file,
    /// else populates the next page tables, else keeps the mapping for the save. Returns whether
    /// the file is ready. An allocation that fails (a full memory filesystem) is an error; a
    /// kernel that cannot populate page tables ends the work early, the mapping not kept.
    pub fn advance(&mut self, max_bytes: u64) -> Result<bool> {
        let step = max_bytes.max(crate::DIRECT_ALIGN_BYTES as u64);
        if self.done {
            return Ok(true);
        }
        if self.allocated < self.len_bytes {
            let n = step.min(self.len_bytes - self.allocated);
            let file = self.file.as_ref().expect("open until mapped");
            crate::durable::reserve(file, self.allocated, n)
                .map_err(|e| Error::io("preallocate", &self.name, e))?;
            self.allocated += n;
            return Ok(false);
        }
        let Some(map) = self.map.as_mut() else {
            let file = self.file.take().expect("open until mapped");
            let (map, fresh) = MappedFile::open(file, self.len_bytes as usize, &self.name)?;
            if !fresh {
                self.populated = self.len_bytes; // a kept mapping of this file has its page tables
            }
            self.map = Some(map);
            return Ok(false);
        };
        if self.populated < self.len_bytes {
            let n = step.min(self.len_bytes - self.populated);
            let start = map.map.addr() + self.populated as usize;
            if !super::populate_range(start, n as usize) {
                self.map = None; // unmapped: the save maps the file itself
                self.done = true;
                return Ok(true);
            }
            self.populated += n;
            return Ok(false);
        }
        if let Some(map) = self.map.take() {
            map.keep();
        }
        self.done = true;
        Ok(true)
    }

    /// Bytes allocated so far.
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    fn shm_file() -> Option<(tempfile::TempDir, PathBuf, File)> {
        let dir = tempfile::tempdir_in("/dev/shm").ok()?;
        let path = dir.path().join("spare.bin");
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        Some((dir, path, file))
    }

    #[test]
    fn a_readied_file_is_allocated_and_its_mapping_kept_for_the_save() {
        let len = 3 * (256 << 10) + 4096;
        let Some((_dir, path, file)) = shm_file() else {
            return;
        };
        let mut ahead = FileAhead::new(file, len, &path).unwrap();
        let mut calls = 0;
        while !ahead.advance(256 << 10).unwrap() {
            calls += 1;
            assert!(calls < 100);
        }
        assert!(
            calls >= 4 + 1 + 4,
            "allocated, mapped and populated a slice at a time: {calls}"
        );
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.len(), len);
        assert!(meta.blocks() * 512 >= len);
        let ino = meta.ino();
        assert!(super::super::mapped::kept_inodes().contains(&ino));
        assert!(std::fs::read(&path).unwrap().iter().all(|&b| b == 0));
    }

    #[test]
    fn a_file_left_half_made_is_still_whole_to_a_save_and_nothing_is_kept() {
        let len = 1 << 20;
        let Some((_dir, path, file)) = shm_file() else {
            return;
        };
        let mut ahead = FileAhead::new(file, len, &path).unwrap();
        assert!(!ahead.advance(256 << 10).unwrap());
        assert_eq!(ahead.allocated_bytes(), 256 << 10);
        let ino = std::fs::metadata(&path).unwrap().ino();
        drop(ahead);
        assert!(!super::super::mapped::kept_inodes().contains(&ino));
        assert_eq!(std::fs::metadata(&path).unwrap().len(), len);
    }

    #[test]
    fn only_a_regular_file_on_a_memory_filesystem() {
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let path = dir.path().join("on-disk.bin");
        let file = File::create(&path).unwrap();
        if super::super::is_memory_fs(dir.path()).unwrap() {
            return;
        }
        let err = FileAhead::new(file, 4096, &path).unwrap_err();
        assert!(err.to_string().contains("memory filesystem"), "{err}");
    }
}
