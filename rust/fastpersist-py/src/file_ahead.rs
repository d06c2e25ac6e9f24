//! `MemoryFileAhead`: a memory-level file made ready for the next save a slice at a time, the
//! GIL released for each (`fastpersist_core::job::FileAhead`; its Python driver is
//! `fastpersist/memory_level/spares.py`).

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use fastpersist_core::job::FileAhead;
use pyo3::prelude::*;

use crate::errors::IntoPyResult;

/// A file on a memory filesystem being made ready (allocated, mapped, its page tables
/// populated) for the save that will overwrite it.
#[pyclass(module = "fastpersist._core")]
pub(crate) struct MemoryFileAhead {
    // A mutex, so the object may be shared between threads (its mapping's pointer is not).
    inner: Mutex<FileAhead>,
}

impl MemoryFileAhead {
    fn lock(&self) -> MutexGuard<'_, FileAhead> {
        // A panic mid-advance leaves counters that only ever trail the work done: still usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl MemoryFileAhead {
    /// Starts on the open file `fd` (duplicated: the caller keeps and closes its own), named
    /// `name` in messages, which the next save overwrites with `len_bytes` bytes.
    #[new]
    fn new(py: Python<'_>, fd: i32, len_bytes: u64, name: PathBuf) -> PyResult<Self> {
        let file = crate::duplicate_fd(fd, &name)?;
        let inner = py
            .detach(|| FileAhead::new(file, len_bytes, &name))
            .into_py_result(py)?;
        Ok(MemoryFileAhead {
            inner: Mutex::new(inner),
        })
    }

    /// Does the next piece of at most `max_bytes` of the work; whether the file is ready.
    fn advance(&self, py: Python<'_>, max_bytes: u64) -> PyResult<bool> {
        py.detach(|| self.lock().advance(max_bytes))
            .into_py_result(py)
    }

    /// Bytes of the file allocated so far.
    #[getter]
    fn allocated_bytes(&self) -> u64 {
        self.lock().allocated_bytes()
    }
}
