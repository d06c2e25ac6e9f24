//! The in-memory level: a part file on a memory filesystem (tmpfs, ramfs) whose pages exist
//! already (a recycled file, a spare made `ahead`; a job with none goes through the pool, see
//! `StagingMode::MappedFiles`) is written by copying the sources straight into a shared mapping
//! of the file, checksumming each piece while it is hot. There is no staging copy (the copy into the file's pages *is* the staging), no O_DIRECT
//! attempt and no page-cache write path per 4 KiB page.
//!
//! The file is opened without truncation, so a file recycled from a retired step (renamed into
//! the save's temporary directory by the Python side) keeps its pages: they are overwritten in
//! place instead of being freed and allocated again. Its length is set to the part's, then the
//! whole length is reserved with `fallocate`, which fails with ENOSPC on a full tmpfs *before*
//! anything is mapped: a store into a mapping past what tmpfs can hold would be a SIGBUS. A
//! helper thread populates the page tables of the chunks ahead of the copy
//! (`MADV_POPULATE_WRITE`), so the copy does not take one page fault per 4 KiB page. The mapping
//! of a recycled file (one that existed with data) is kept after the job
//! ([`mapped`]): the next save that overwrites the same file writes through it
//! with no mapping work at all. A new file's mapping is not kept.
//!
//! A device job whose arena is its one file here is finished in place (`in_place`): staging put
//! every byte into the file's pages already, so its chunks are only checksummed.

mod ahead;
mod in_place;
mod mapped;

pub use ahead::FileAhead;

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use super::WriteTarget;
use super::from_pool::Staging;
use crate::error::{Error, Result};
use crate::probe::{BackendKind, DirectMode};
use mapped::MappedFile;

/// `statfs` f_type of tmpfs (and of /dev/shm).
const TMPFS_MAGIC: i64 = 0x0102_1994;
/// `statfs` f_type of ramfs.
const RAMFS_MAGIC: i64 = 0x8584_58f6;

/// Whether `dir` lies on a memory filesystem (tmpfs or ramfs): its files live in RAM only.
pub fn is_memory_fs(dir: &Path) -> Result<bool> {
    let path = CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| Error::InvalidArgument(format!("{} contains a NUL byte", dir.display())))?;
    // SAFETY: statfs writes only into `st`, a plain C struct for which all-zero bytes are valid.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is NUL-terminated and outlives the call; `st` is writable and ours.
    let rc = unsafe { libc::statfs(path.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(Error::io("statfs", dir, std::io::Error::last_os_error()));
    }
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between targets
    let kind = st.f_type as i64;
    Ok(kind == TMPFS_MAGIC || kind == RAMFS_MAGIC)
}

/// Whether a job writes the files at `paths` in memory, through mappings of them (or, a device
/// save, by staging into a file's own mapping: `Arena::over_file`): O_DIRECT is not required,
/// the backend is not the null sink, and every file is on a memory filesystem.
pub fn writes_in_memory(paths: &[&Path], direct: DirectMode, backend: BackendKind) -> bool {
    direct != DirectMode::Require && backend != BackendKind::Null && all_on_memory_fs(paths)
}

/// Whether a file at any of `paths` holds data with every page allocated (a recycled file, or
/// a spare made ahead: `ahead`), so that writing through mappings reuses its pages. A file with
/// holes is written as a new one: through the pool, which allocates faster than a mapping.
pub(super) fn any_whole(paths: &[&Path]) -> bool {
    paths.iter().any(|p| {
        std::fs::symlink_metadata(p)
            .is_ok_and(|m| m.is_file() && m.len() > 0 && is_whole(&m, m.len()))
    })
}

/// Whether the file described by `meta` has pages allocated for its first `len` bytes.
fn is_whole(meta: &std::fs::Metadata, len: u64) -> bool {
    std::os::unix::fs::MetadataExt::blocks(meta).saturating_mul(512) >= len
}

/// Whether every path's directory is on a memory filesystem (decided once per directory) and
/// every path is a regular file or absent (`/dev/full` sits on devtmpfs too). A directory that
/// cannot be looked at counts as not: the usual path then reports the error on the file itself.
fn all_on_memory_fs(paths: &[&Path]) -> bool {
    let mut seen: Vec<&Path> = Vec::new();
    for &path in paths {
        match std::fs::symlink_metadata(path) {
            Ok(meta) if !meta.is_file() => return false,
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return false,
            _ => {}
        }
        let dir = super::parent_dir(path);
        if seen.contains(&dir) {
            continue;
        }
        if !is_memory_fs(dir).unwrap_or(false) {
            return false;
        }
        seen.push(dir);
    }
    !paths.is_empty()
}

/// Opens (creating, never truncating) each target, sets it to its part's length and reserves
/// that length in memory; says for each whether it existed with data (a recycled file).
fn open_files(targets: &[WriteTarget]) -> Result<Vec<(File, bool)>> {
    targets
        .iter()
        .map(|target| {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false) // a recycled file's pages are reused: overwritten in place
                .mode(0o644)
                // A recycled file is overwritten, so never through a link planted in its place.
                .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
                .open(&target.path)
                .map_err(|e| Error::io("create", &target.path, e))?;
            let stat = |file: &File| {
                file.metadata()
                    .map_err(|e| Error::io("stat", &target.path, e))
            };
            let recycled = stat(&file)?.len() > 0;
            let len = target.part.len_bytes;
            file.set_len(len)
                .map_err(|e| Error::io("truncate", &target.path, e))?;
            // A recycled file that is whole has every page already: no hole to fault on.
            if !is_whole(&stat(&file)?, len) {
                crate::durable::preallocate(&file, len)
                    .map_err(|e| Error::io("preallocate", &target.path, e))?;
            }
            Ok((file, recycled))
        })
        .collect()
}

/// Populates the page tables of `ranges` (address, length) in order until `stop` is set. Only
/// a speed-up: a range it does not reach (or a kernel without MADV_POPULATE_WRITE) is faulted in
/// by the copy itself.
fn populate(ranges: &[(usize, usize)], stop: &AtomicBool) {
    for &(addr, len) in ranges {
        if stop.load(Ordering::Relaxed) || len == 0 {
            return;
        }
        if !populate_range(addr, len) {
            return;
        }
    }
}

/// Populates the page tables of `[addr, addr + len)`, a range of one of our own live shared
/// mappings (`MADV_POPULATE_WRITE`); whether the kernel did.
fn populate_range(addr: usize, len: usize) -> bool {
    // Page-align the start (madvise needs it); the range stays inside the same mapping.
    let aligned = addr & !(crate::DIRECT_ALIGN_BYTES - 1);
    // SAFETY: madvise only populates page tables of a live mapping of ours (the callers keep it
    // mapped for the call); it reads or writes no memory through Rust references.
    let rc = unsafe {
        libc::madvise(
            aligned as *mut libc::c_void,
            len + (addr - aligned),
            libc::MADV_POPULATE_WRITE,
        )
    };
    rc == 0
}

/// Writes every target from the sources through shared mappings (see the module docs); fsyncs
/// them when `durable` (a formality on tmpfs, kept for the contract).
pub(super) fn write_mapped(
    staging: &mut Staging<'_>,
    targets: &[WriteTarget],
    durable: bool,
) -> Result<()> {
    mapped::drop_deleted();
    let mut maps = Vec::with_capacity(targets.len());
    let mut fresh = Vec::with_capacity(targets.len());
    let mut recycled = Vec::with_capacity(targets.len());
    for ((file, was_recycled), target) in open_files(targets)?.into_iter().zip(targets) {
        let (map, is_fresh) = MappedFile::open(file, target.part.len_bytes as usize, &target.path)?;
        maps.push(map);
        fresh.push(is_fresh);
        recycled.push(was_recycled);
    }
    let chunks = staging.chunk_list();
    // Only new mappings need their page tables populated; a kept one has them already.
    let ahead: Vec<(usize, usize)> = chunks
        .iter()
        .filter(|(file, _)| fresh[*file])
        .map(|(file, c)| {
            let base = maps[*file].map.addr();
            (base + c.file_offset_bytes as usize, c.len_bytes as usize)
        })
        .collect();
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        if !ahead.is_empty() {
            scope.spawn(|| populate(&ahead, &stop));
        }
        let copied = chunks.iter().try_for_each(|(file, chunk)| {
            let dst = maps[*file]
                .map
                .range(chunk.file_offset_bytes, chunk.len_bytes);
            staging.stage_next_into(dst)
        });
        stop.store(true, Ordering::Relaxed);
        copied
    })?;
    if durable {
        for (map, target) in maps.iter().zip(targets) {
            map.file
                .sync_all()
                .map_err(|e| Error::io("fsync", &target.path, e))?;
        }
    }
    // A recycled file's mapping is kept for the next job that overwrites it (a Checkpointer
    // rotating its files): no mmap, page-table population or munmap per save. A new file's is
    // not: a one-off save keeps nothing mapped (or its filesystem busy) after it returns.
    for (map, was_recycled) in maps.into_iter().zip(recycled) {
        if was_recycled {
            map.keep();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_shm_is_memory_and_a_disk_dir_is_not() {
        if Path::new("/dev/shm").is_dir() {
            assert!(is_memory_fs(Path::new("/dev/shm")).unwrap());
        }
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let on_disk = is_memory_fs(dir.path()).unwrap();
        // The source tree is on a disk except in unusual setups (a checkout under /dev/shm).
        if !env!("CARGO_MANIFEST_DIR").starts_with("/dev/shm") {
            assert!(!on_disk);
        }
    }

    /// Writes `data` (two extents) to `path` on a memory root through the whole job.
    fn write_on_shm(path: &Path, data: &[Vec<u8>]) -> (super::super::WriteReport, Vec<u8>) {
        use crate::job::{JobProgress, SourceRegion, WriteOptions, write_parts};
        let lens: Vec<u64> = data.iter().map(|d| d.len() as u64).collect();
        let plan = crate::plan::Plan::new(&lens, 1, 1, 64 << 10).unwrap();
        let pool = crate::pool::Pool::new(64 << 10, 128 << 10);
        let options = WriteOptions {
            backend: crate::probe::BackendKind::Threads,
            direct: crate::probe::DirectMode::Auto,
            queue_depth: 2,
            checksum: true,
            durable: true,
            staging_threads: 1,
        };
        let targets = [WriteTarget {
            part: plan.parts[0],
            path: path.to_path_buf(),
        }];
        // SAFETY: `data` outlives write_parts, which returns after the job.
        let sources = data
            .iter()
            .map(|d| unsafe { SourceRegion::from_slice(d) })
            .collect();
        let progress = JobProgress::default();
        let report = write_parts(&plan, &targets, sources, &pool, &options, &progress).unwrap();
        let mut stream = vec![0u8; plan.total_bytes as usize];
        for (d, &at) in data.iter().zip(&plan.extent_offsets) {
            stream[at as usize..at as usize + d.len()].copy_from_slice(d);
        }
        (report, stream)
    }

    #[test]
    fn a_save_on_shm_overwrites_a_recycled_file_in_place_with_the_right_checksums() {
        let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
            return;
        };
        let path = dir.path().join("data.bin");
        let ino = |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap());
        let mut inode = None;
        for round in 0..3u8 {
            // Shorter and longer than the file it overwrites, and not a multiple of a page.
            let data = vec![
                vec![round + 1; 100_000 + 70_000 * round as usize],
                vec![round + 9; 4321],
            ];
            let (report, stream) = write_on_shm(&path, &data);
            assert!(
                std::fs::read(&path).unwrap() == stream,
                "round {round}: wrong bytes"
            );
            let crcs: Vec<u32> = stream
                .chunks(64 << 10)
                .map(crate::checksum::crc32c)
                .collect();
            assert_eq!(report.parts[0].chunk_crc32c, crcs);
            // The new file is written through the pool; from then on, in place through a mapping.
            assert!(round == 0 || !report.parts[0].direct);
            assert_eq!(*inode.get_or_insert(ino(&path)), ino(&path));
        }
    }

    #[test]
    fn only_regular_files_on_a_memory_fs_take_the_memory_path_and_only_when_allowed() {
        let (threads, auto) = (BackendKind::Threads, DirectMode::Auto);
        assert!(!writes_in_memory(&[Path::new("/dev/full")], auto, threads)); // a device on devtmpfs
        if Path::new("/dev/shm").is_dir() {
            let absent = Path::new("/dev/shm/fastpersist-absent.bin");
            assert!(writes_in_memory(&[absent], auto, threads));
            assert!(!writes_in_memory(&[absent], DirectMode::Require, threads));
            assert!(!writes_in_memory(&[absent], auto, BackendKind::Null));
        }
        assert!(!writes_in_memory(&[], auto, threads));
    }

    #[test]
    fn a_missing_dir_is_an_error() {
        assert!(is_memory_fs(Path::new("/nonexistent/fastpersist")).is_err());
    }

    #[test]
    fn open_files_keeps_the_inode_and_sets_the_length() {
        let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
            return;
        };
        let path = dir.path().join("f");
        std::fs::write(&path, vec![7u8; 3 * 4096]).unwrap();
        let ino = |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap());
        let before = ino(&path);
        let plan = crate::plan::Plan::new(&[5000], 1, 1, 4096).unwrap();
        let targets = vec![WriteTarget {
            part: plan.parts[0],
            path: path.clone(),
        }];
        let files = open_files(&targets).unwrap();
        assert_eq!(files[0].0.metadata().unwrap().len(), 5000);
        assert!(files[0].1, "an existing file with data counts as recycled");
        assert_eq!(ino(&path), before);
        let file = files.into_iter().next().unwrap().0;
        let (mut map, fresh) = MappedFile::open(file, 5000, &path).unwrap();
        assert!(fresh);
        assert_eq!(map.map.range(4096, 904).len(), 904);
        assert!(map.map.range(0, 4096).iter().all(|&b| b == 7)); // overwritten in place, not freed
    }
}
