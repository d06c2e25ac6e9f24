//! Durability helpers: space reservation, fsync of files and directories, and atomic directory
//! replacement.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::error::{Error, Result};

/// Reserves the first `len_bytes` of a new, empty file and sets its size (`fallocate`).
///
/// Direct writes then land inside the file instead of extending it. On ext4 an extending direct
/// write holds the inode lock and waits for its own completion, so extending writes run one at a
/// time whatever the queue depth (and io_uring punts them to workers that allocate blocks out of
/// order: an extent per chunk). A full disk also fails here, before any byte is written.
/// Where `fallocate` does not apply (a filesystem without it, a device) the reservation is skipped.
pub fn preallocate(file: &File, len_bytes: u64) -> std::io::Result<()> {
    if len_bytes == 0 {
        return Ok(());
    }
    match reserve(file, 0, len_bytes) {
        // Unsupported by this filesystem or file type: reserving was only an optimisation.
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EOPNOTSUPP | libc::ENOSYS | libc::ENODEV | libc::ESPIPE | libc::EINVAL)
            ) =>
        {
            Ok(())
        }
        other => other,
    }
}

/// Reserves `[offset, offset + len_bytes)` of `file` (`fallocate`, keeping its size), retried
/// when interrupted; every other failure (ENOSPC first) is the caller's.
pub fn reserve(file: &File, offset: u64, len_bytes: u64) -> std::io::Result<()> {
    let too_big = || std::io::Error::from_raw_os_error(libc::EFBIG);
    let offset = libc::off_t::try_from(offset).map_err(|_| too_big())?;
    let len = libc::off_t::try_from(len_bytes).map_err(|_| too_big())?;
    loop {
        // SAFETY: fallocate takes only integers; the fd stays open for the call (borrowed from
        // `file`).
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, offset, len) };
        if rc == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINTR) {
            return Err(err);
        }
    }
}

/// fsyncs a file by path (data and metadata).
pub fn fsync_path(path: &Path) -> Result<()> {
    let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
    file.sync_all().map_err(|e| Error::io("fsync", path, e))
}

/// fsyncs a directory so that entries created, renamed or removed in it are durable.
pub fn fsync_dir(path: &Path) -> Result<()> {
    let dir = File::open(path).map_err(|e| Error::io("open directory", path, e))?;
    dir.sync_all()
        .map_err(|e| Error::io("fsync directory", path, e))
}

fn c_path(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        Error::InvalidArgument(format!("path contains a NUL byte: {}", path.display()))
    })
}

/// Atomically puts `from` at `to`.
///
/// If `to` does not exist this is a no-replace rename. If it exists, the two are exchanged
/// (`renameat2(RENAME_EXCHANGE)`), so a reader of `to` sees the old or the new tree, never a
/// mix or nothing; the old tree is then at `from` and the caller removes it. Returns whether an
/// exchange happened. Both paths must be on the same filesystem.
pub fn replace_atomically(from: &Path, to: &Path) -> Result<bool> {
    let (c_from, c_to) = (c_path(from)?, c_path(to)?);
    let exists = std::fs::symlink_metadata(to).is_ok();
    let flags = if exists {
        libc::RENAME_EXCHANGE
    } else {
        libc::RENAME_NOREPLACE
    };
    // SAFETY: both arguments are valid NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            c_from.as_ptr(),
            libc::AT_FDCWD,
            c_to.as_ptr(),
            flags,
        )
    };
    if rc == 0 {
        return Ok(exists);
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        // Filesystems without renameat2 flags (rare): fall back to a plain rename, which is
        // still atomic when `to` does not exist.
        Some(libc::EINVAL) | Some(libc::ENOSYS) if !exists => std::fs::rename(from, to)
            .map(|()| false)
            .map_err(|e| Error::io("rename", to, e)),
        _ => Err(Error::io("rename", to, err)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replace_new_and_existing() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::create_dir(&a).unwrap();
        std::fs::write(a.join("x"), b"new").unwrap();
        assert!(!replace_atomically(&a, &b).unwrap());
        assert_eq!(std::fs::read(b.join("x")).unwrap(), b"new");
        std::fs::create_dir(&a).unwrap();
        std::fs::write(a.join("x"), b"newer").unwrap();
        assert!(replace_atomically(&a, &b).unwrap());
        assert_eq!(std::fs::read(b.join("x")).unwrap(), b"newer");
        assert_eq!(std::fs::read(a.join("x")).unwrap(), b"new");
        fsync_dir(dir.path()).unwrap();
        fsync_path(&b.join("x")).unwrap();
    }

    #[test]
    fn preallocate_sets_the_size() {
        let dir = tempfile::tempdir().unwrap();
        let file = File::create(dir.path().join("f")).unwrap();
        preallocate(&file, 0).unwrap();
        assert_eq!(file.metadata().unwrap().len(), 0);
        preallocate(&file, 12345).unwrap();
        assert_eq!(file.metadata().unwrap().len(), 12345);
    }

    #[test]
    fn missing_source_keeps_errno() {
        let dir = tempfile::tempdir().unwrap();
        let err = replace_atomically(&dir.path().join("nope"), &dir.path().join("b")).unwrap_err();
        match err {
            Error::Io { source, .. } => assert_eq!(source.raw_os_error(), Some(libc::ENOENT)),
            other => panic!("unexpected {other:?}"),
        }
    }
}
