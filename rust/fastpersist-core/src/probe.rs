//! Which backend to use, and whether O_DIRECT works in a directory. Probed once, loudly.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::OnceLock;

use io_uring::{IoUring, Probe, opcode};

use crate::error::{Error, Result};

/// The I/O backend that moves chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// One ring per job, batched submissions.
    IoUring,
    /// A pool of threads doing `pwrite`/`pread`.
    Threads,
    /// Benchmarks only: writes complete at once and move no bytes (`backend::null`).
    Null,
}

impl BackendKind {
    /// The name users see (`"io_uring"` or `"threads"`).
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::IoUring => "io_uring",
            BackendKind::Threads => "threads",
            BackendKind::Null => "null",
        }
    }
}

/// What the caller asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    /// io_uring if it works here, else threads (with one warning).
    Auto,
    /// io_uring or an error.
    IoUring,
    /// Always threads.
    Threads,
    /// The null sink (benchmarks only; never from `FASTPERSIST_BACKEND`).
    Null,
}

impl BackendChoice {
    /// Parses `"auto" | "io_uring" | "threads"`.
    pub fn parse(text: &str) -> Result<Self> {
        match text {
            "auto" => Ok(BackendChoice::Auto),
            "io_uring" => Ok(BackendChoice::IoUring),
            "threads" => Ok(BackendChoice::Threads),
            "null" => Ok(BackendChoice::Null),
            other => Err(Error::InvalidArgument(format!(
                "unknown backend {other:?}: expected \"auto\", \"io_uring\" or \"threads\""
            ))),
        }
    }
}

/// The backend picked for a job, and why io_uring was not used when it was not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// The backend to use.
    pub kind: BackendKind,
    /// Set when `auto` fell back to threads: the cause and the fix, for a one-time warning.
    pub fallback_reason: Option<String>,
}

/// Whether data files use O_DIRECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirectMode {
    /// O_DIRECT where the filesystem accepts it, buffered I/O + fsync elsewhere.
    Auto,
    /// O_DIRECT or an error.
    Require,
    /// Buffered I/O + fsync.
    Off,
}

impl DirectMode {
    /// Parses `"auto" | "require" | "off"`.
    pub fn parse(text: &str) -> Result<Self> {
        match text {
            "auto" => Ok(DirectMode::Auto),
            "require" => Ok(DirectMode::Require),
            "off" => Ok(DirectMode::Off),
            other => Err(Error::InvalidArgument(format!(
                "unknown direct_io {other:?}: expected \"auto\", \"require\" or \"off\""
            ))),
        }
    }

    /// Decides for one directory: `Ok(true)` means open with O_DIRECT.
    pub fn resolve(self, dir: &Path) -> Result<bool> {
        match self {
            DirectMode::Off => Ok(false),
            DirectMode::Auto => direct_io_supported(dir),
            DirectMode::Require => {
                if direct_io_supported(dir)? {
                    Ok(true)
                } else {
                    Err(Error::BackendUnavailable(format!(
                        "direct_io=\"require\" but the filesystem of {} refuses O_DIRECT (ramfs does, and tmpfs before Linux 6.6); \
                         use direct_io=\"auto\" or another directory",
                        dir.display()
                    )))
                }
            }
        }
    }
}

/// Env var that forces a backend when the caller asked for `auto`.
pub const BACKEND_ENV: &str = "FASTPERSIST_BACKEND";
/// Test hook: makes the io_uring probe fail with this errno (`EPERM`, `ENOSYS`, `ENOMEM` or a number).
pub const SIMULATE_ENV: &str = "FASTPERSIST_SIMULATE_URING_ERRNO";

/// Why io_uring cannot be used (the errno and a message naming the cause and the fix).
pub type UringBlocked = String;

/// io_uring availability, probed once per process.
pub fn uring_status() -> &'static std::result::Result<(), UringBlocked> {
    static STATUS: OnceLock<std::result::Result<(), UringBlocked>> = OnceLock::new();
    STATUS.get_or_init(|| probe_uring(simulated_errno()))
}

fn simulated_errno() -> Option<i32> {
    let text = std::env::var(SIMULATE_ENV).ok()?;
    match text.as_str() {
        "" => None,
        "EPERM" => Some(libc::EPERM),
        "ENOSYS" => Some(libc::ENOSYS),
        "ENOMEM" => Some(libc::ENOMEM),
        other => other.parse().ok(),
    }
}

/// Tries to set up a small ring and checks the opcodes the engine uses.
/// `simulate_errno` makes it fail as if `io_uring_setup` returned that errno.
pub fn probe_uring(simulate_errno: Option<i32>) -> std::result::Result<(), UringBlocked> {
    let setup = match simulate_errno {
        Some(errno) => Err(std::io::Error::from_raw_os_error(errno)),
        None => IoUring::new(4),
    };
    let ring = setup.map_err(|e| explain_setup_error(&e))?;
    let mut probe = Probe::new();
    if let Err(e) = ring.submitter().register_probe(&mut probe) {
        return Err(format!(
            "io_uring opcode probe failed ({e}); using the threads backend"
        ));
    }
    for (code, name) in [(opcode::Write::CODE, "WRITE"), (opcode::Read::CODE, "READ")] {
        if !probe.is_supported(code) {
            return Err(format!(
                "this kernel's io_uring lacks IORING_OP_{name}; using the threads backend (a kernel >= 5.6 has it)"
            ));
        }
    }
    Ok(())
}

fn explain_setup_error(err: &std::io::Error) -> UringBlocked {
    let cause = match err.raw_os_error() {
        Some(libc::EPERM) => {
            "blocked by seccomp (e.g. a container's default profile) or sysctl kernel.io_uring_disabled; \
             allow io_uring_setup/io_uring_enter or set kernel.io_uring_disabled=0"
        }
        Some(libc::ENOSYS) => {
            "the kernel has no io_uring or a seccomp filter hides it; use a kernel >= 5.6 without that filter"
        }
        Some(libc::ENOMEM) => "locked-memory limit too small; raise `ulimit -l` (RLIMIT_MEMLOCK)",
        _ => "unexpected error",
    };
    format!(
        "io_uring unavailable ({err}): {cause}. Using the threads backend; set {BACKEND_ENV}=threads to silence this warning"
    )
}

/// Resolves a choice (and the `FASTPERSIST_BACKEND` override of `auto`) into a backend.
pub fn select(choice: BackendChoice) -> Result<Selection> {
    let choice = match choice {
        BackendChoice::Auto => match std::env::var(BACKEND_ENV) {
            Ok(text) if !text.is_empty() => match BackendChoice::parse(&text) {
                // A setting that silently writes nothing has no place in an environment.
                Ok(BackendChoice::Null) | Err(_) => {
                    return Err(Error::InvalidArgument(format!(
                        "environment variable {BACKEND_ENV}={text:?}: expected \"auto\", \"io_uring\" or \"threads\""
                    )));
                }
                Ok(parsed) => parsed,
            },
            _ => BackendChoice::Auto,
        },
        other => other,
    };
    match choice {
        BackendChoice::Threads => Ok(Selection {
            kind: BackendKind::Threads,
            fallback_reason: None,
        }),
        BackendChoice::Null => Ok(Selection {
            kind: BackendKind::Null,
            fallback_reason: None,
        }),
        BackendChoice::IoUring => match uring_status() {
            Ok(()) => Ok(Selection {
                kind: BackendKind::IoUring,
                fallback_reason: None,
            }),
            Err(why) => Err(Error::BackendUnavailable(format!(
                "backend \"io_uring\" was required but {why}"
            ))),
        },
        BackendChoice::Auto => Ok(match uring_status() {
            Ok(()) => Selection {
                kind: BackendKind::IoUring,
                fallback_reason: None,
            },
            Err(why) => Selection {
                kind: BackendKind::Threads,
                fallback_reason: Some(why.clone()),
            },
        }),
    }
}

/// Whether files in `dir` can be opened with O_DIRECT (ramfs, tmpfs before Linux 6.6 and some
/// FUSE filesystems refuse it).
pub fn direct_io_supported(dir: &Path) -> Result<bool> {
    let cookie = dir.join(format!(
        ".fastpersist-direct-probe-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let opened = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(&cookie);
    let result = match opened {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(Error::io("probe O_DIRECT in", dir, e)),
    };
    let _ = std::fs::remove_file(&cookie);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simulated_block_names_cause_and_fix() {
        for (errno, needle) in [
            (libc::EPERM, "seccomp"),
            (libc::ENOSYS, "kernel"),
            (libc::ENOMEM, "ulimit -l"),
        ] {
            let why = probe_uring(Some(errno)).unwrap_err();
            assert!(why.contains(needle), "{why}");
            assert!(why.contains("threads"), "{why}");
        }
    }

    #[test]
    fn real_probe_runs() {
        // io_uring may legitimately be blocked where tests run; the probe must answer, not panic.
        let _ = probe_uring(None);
    }

    #[test]
    fn parse_choice() {
        assert_eq!(
            BackendChoice::parse("threads").unwrap(),
            BackendChoice::Threads
        );
        assert!(BackendChoice::parse("uring").is_err());
        assert_eq!(BackendChoice::parse("null").unwrap(), BackendChoice::Null);
        assert_eq!(
            select(BackendChoice::Null).unwrap().kind.name(),
            "null",
            "the engine takes the null sink when asked by name"
        );
    }

    #[test]
    fn direct_probe_answers() {
        let dir = tempfile::tempdir().unwrap();
        let _ = direct_io_supported(dir.path()).unwrap();
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "cookie removed"
        );
    }
}
