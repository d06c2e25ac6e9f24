//! One error type for the engine. OS errors keep their `io::Error` (and so their errno) and the
//! path they happened on, so the bindings can raise a real `OSError` with `errno` and `filename`.

use std::fmt;
use std::io;
use std::path::PathBuf;

/// Result alias for the engine.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything the engine can fail with.
#[derive(Debug)]
pub enum Error {
    /// An operating-system call failed on `path`.
    Io {
        /// What we were doing ("open", "write", "fsync", ...).
        op: &'static str,
        /// The file or directory involved.
        path: PathBuf,
        /// The OS error (errno is kept).
        source: io::Error,
    },
    /// A file's size differs from what the manifest says (truncated or overwritten).
    SizeMismatch {
        /// The file.
        path: PathBuf,
        /// Bytes expected.
        expected_bytes: u64,
        /// Bytes found.
        found_bytes: u64,
    },
    /// A chunk's crc32c did not match the recorded one.
    ChecksumMismatch {
        /// The file.
        path: PathBuf,
        /// First byte of the chunk in the file.
        offset_bytes: u64,
        /// Length of the chunk.
        len_bytes: u64,
        /// Recorded checksum.
        expected: u32,
        /// Computed checksum.
        found: u32,
    },
    /// A required backend or I/O mode cannot be used here.
    BackendUnavailable(String),
    /// The caller passed something inconsistent (a bug in the caller, or hostile input).
    InvalidArgument(String),
    /// The job was cancelled (by its caller, or because a source changed before it was staged).
    Cancelled(String),
    /// A system call not tied to one file failed (e.g. `io_uring_enter` mid-job).
    Sys {
        /// The call.
        op: &'static str,
        /// The OS error (errno is kept).
        source: io::Error,
    },
    /// A participant the caller plugged into a job (a staging observer, a device copier)
    /// failed with an error of its own, kept whole so that the caller gets it back as it was.
    Hook {
        /// What the job was doing when the participant failed.
        what: String,
        /// The participant's own error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// An invariant of the engine itself was broken: a bug, not bad input.
    Internal(String),
}

/// What to do about ENOSPC, said once for the engine and the bindings.
pub const DISK_FULL_HINT: &str = "the disk is full: free space or point the checkpoint elsewhere";

impl Error {
    /// Wraps an `io::Error` with the operation and path.
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io { op, path, source } => {
                write!(f, "{op} {}: {source}", path.display())?;
                if source.raw_os_error() == Some(libc::ENOSPC) {
                    write!(f, " ({DISK_FULL_HINT})")?;
                }
                Ok(())
            }
            Error::SizeMismatch {
                path,
                expected_bytes,
                found_bytes,
            } => write!(
                f,
                "{} has the wrong size (truncated?): expected {expected_bytes} bytes, found {found_bytes}",
                path.display()
            ),
            Error::ChecksumMismatch {
                path,
                offset_bytes,
                len_bytes,
                expected,
                found,
            } => write!(
                f,
                "checksum mismatch in {} bytes [{offset_bytes}, {}): expected crc32c {expected:#010x}, found {found:#010x}",
                path.display(),
                offset_bytes + len_bytes
            ),
            Error::BackendUnavailable(msg)
            | Error::InvalidArgument(msg)
            | Error::Cancelled(msg) => f.write_str(msg),
            Error::Sys { op, source } => write!(f, "{op} failed: {source}"),
            Error::Hook { what, source } => write!(f, "{what}: {source}"),
            Error::Internal(msg) => write!(
                f,
                "fastpersist internal error (a bug; please report it): {msg}"
            ),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } | Error::Sys { source, .. } => Some(source),
            Error::Hook { source, .. } => Some(source.as_ref()),
            _ => None,
        }
    }
}
