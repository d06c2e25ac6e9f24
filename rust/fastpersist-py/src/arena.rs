//! `Arena` and `ArenaLease`: the staging memory of device saves (`fastpersist_core::arena`), as
//! Python sees it: a writable buffer that Python registers with CUDA once, and leases that a
//! save takes for its job.

use std::os::raw::c_int;
use std::path::PathBuf;
use std::sync::Mutex;

use fastpersist_core::arena;
use pyo3::exceptions::{PyMemoryError, PyOSError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;

use crate::before_free::BeforeFree;
use crate::buffers::export_writable;
use crate::errors::to_pyerr;

/// Page-aligned memory that device saves stage into and write from, one job at a time. What
/// Python tied to it (its CUDA registration) is released by callbacks it calls before its
/// memory can be freed. Supports the buffer protocol (writable bytes).
#[pyclass(frozen, weakref, module = "fastpersist._core")]
pub(crate) struct Arena {
    // Declared first, so dropped first: the callbacks run while the memory is still mapped.
    before_free: BeforeFree,
    pub inner: arena::Arena,
}

#[pymethods]
impl Arena {
    #[new]
    fn new(len_bytes: usize) -> PyResult<Self> {
        let inner = arena::Arena::new(len_bytes).map_err(|e| {
            PyMemoryError::new_err(format!(
                "cannot map a staging arena of {len_bytes} bytes: {e}"
            ))
        })?;
        Ok(Arena {
            inner,
            before_free: BeforeFree::default(),
        })
    }

    /// An arena that is the open file `fd` (duplicated: the caller keeps and closes its own),
    /// named `name` in messages: a regular file of exactly `file_len` bytes, all allocated.
    #[staticmethod]
    fn over_file(py: Python<'_>, fd: i32, file_len: u64, name: PathBuf) -> PyResult<Self> {
        let file = crate::duplicate_fd(fd, &name)?;
        let inner = py
            .detach(|| arena::Arena::over_file(file, file_len, &name))
            .map_err(|e| to_pyerr(py, &e))?;
        Ok(Arena {
            inner,
            before_free: BeforeFree::default(),
        })
    }

    /// Whether it is a mapping of a file (made by `over_file`).
    #[getter]
    fn over_a_file(&self) -> bool {
        self.inner.is_file()
    }

    /// For an arena over a file: ``((st_dev, st_ino), st_nlink)`` of its file now (``st_nlink``
    /// is 0 once the file is deleted); None for anonymous memory.
    #[getter]
    fn file_status(&self) -> PyResult<Option<((u64, u64), u64)>> {
        self.inner
            .file_status()
            .transpose()
            .map_err(|e| PyOSError::new_err(format!("cannot stat a staging arena's file: {e}")))
    }

    /// Its length in bytes (the size asked for, rounded up to whole 2 MiB pages).
    #[getter]
    fn len_bytes(&self) -> usize {
        self.inner.len_bytes()
    }

    /// The address of its first byte.
    #[getter]
    fn address(&self) -> usize {
        self.inner.as_ptr() as usize
    }

    /// Whether a save's job holds it now.
    #[getter]
    fn leased(&self) -> bool {
        self.inner.is_leased()
    }

    /// A lease on the arena for one save, or None while another save holds it.
    fn try_lease(slf: Bound<'_, Self>) -> Option<ArenaLease> {
        let lease = slf.get().inner.try_lease()?;
        Some(ArenaLease {
            lease: Mutex::new(Some(lease)),
            arena: slf.unbind(),
        })
    }

    /// Calls `callback()` when the arena goes, before its memory can be freed (in the order
    /// given; an exception is reported as unraisable). It must not refer to the arena.
    fn call_before_free(&self, callback: Py<PyAny>) {
        self.before_free.push(callback);
    }

    fn __len__(&self) -> usize {
        self.inner.len_bytes()
    }

    /// # Safety
    /// Called by Python's buffer protocol with a valid `view`.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let (ptr, len) = {
            let this = slf.get();
            (this.inner.as_ptr(), this.inner.len_bytes())
        };
        // SAFETY: `view` is Python's (our caller's contract); the arena stays mapped while the
        // exporting object lives, and it is writable.
        unsafe { export_writable(slf.as_any(), view, flags, ptr, len) }
    }
}

/// One save's hold on an [`Arena`], handed to `start_write` (which takes it over); the arena is
/// free again once the save's job has ended, or the lease is dropped unused.
#[pyclass(frozen, module = "fastpersist._core")]
pub(crate) struct ArenaLease {
    lease: Mutex<Option<arena::ArenaLease>>,
    arena: Py<Arena>,
}

impl ArenaLease {
    /// The core lease, for a job; ValueError if a job took it already.
    pub fn take(&self) -> PyResult<arena::ArenaLease> {
        self.lease
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| PyValueError::new_err("this arena lease was handed to a save already"))
    }
}

#[pymethods]
impl ArenaLease {
    /// The arena it holds.
    #[getter]
    fn arena(&self, py: Python<'_>) -> Py<Arena> {
        self.arena.clone_ref(py)
    }
}
