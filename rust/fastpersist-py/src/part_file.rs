//! `PartFileWriter`: a part file written front to back from bytes that arrive from elsewhere
//! (a level's copy, a download, a peer's share), each chunk checked as it passes.

use std::path::PathBuf;
use std::sync::Mutex;

use fastpersist_core::part_file::{self, Create, Expected};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::buffers::HeldBuffer;
use crate::errors::IntoPyResult;

/// Creates `path` for `len_bytes` bytes whose chunks of `chunk_bytes` have the checksums
/// `chunk_crc32c` (empty: unchecked). `replace`: truncate an existing file (else one there is
/// refused); `direct`: O_DIRECT where the filesystem takes it. `append` each piece in order,
/// then `finish`; on an error, `discard` removes the file.
#[pyclass(frozen, module = "fastpersist._core")]
pub(crate) struct PartFileWriter {
    inner: Mutex<Option<part_file::PartFileWriter>>,
}

impl PartFileWriter {
    fn take(&self) -> PyResult<part_file::PartFileWriter> {
        self.inner
            .lock()
            .expect("never poisoned: no panics while held")
            .take()
            .ok_or_else(|| PyValueError::new_err("the part file was already finished or discarded"))
    }
}

#[pymethods]
impl PartFileWriter {
    #[new]
    #[pyo3(signature = (path, len_bytes, chunk_crc32c, chunk_bytes, *, replace = false, direct = true))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        len_bytes: u64,
        chunk_crc32c: Vec<u32>,
        chunk_bytes: u64,
        replace: bool,
        direct: bool,
    ) -> PyResult<Self> {
        let expected = Expected {
            chunk_crc32c,
            chunk_bytes,
        };
        let create = if replace {
            Create::Replace
        } else {
            Create::New
        };
        let writer = py
            .detach(|| {
                part_file::PartFileWriter::create(&path, len_bytes, expected, create, direct)
            })
            .into_py_result(py)?;
        Ok(PartFileWriter {
            inner: Mutex::new(Some(writer)),
        })
    }

    /// Appends the bytes of `data` (any C-contiguous buffer), the GIL released.
    fn append(&self, py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let held = HeldBuffer::get(data, false, "data")?;
        let mut writer = self.take()?;
        let result = py.detach(|| writer.append(held.as_slice()));
        *self.inner.lock().expect("never poisoned") = Some(writer);
        result.into_py_result(py)
    }

    /// Writes what is held and sets the size; `durable`: fsyncs.
    #[pyo3(signature = (*, durable = true))]
    fn finish(&self, py: Python<'_>, durable: bool) -> PyResult<()> {
        let writer = self.take()?;
        py.detach(|| writer.finish(durable)).into_py_result(py)
    }

    /// Closes and removes the unfinished file (nothing if already finished or discarded).
    fn discard(&self, py: Python<'_>) -> PyResult<()> {
        match self.inner.lock().expect("never poisoned").take() {
            Some(writer) => py.detach(|| writer.discard()).into_py_result(py),
            None => Ok(()),
        }
    }

    /// Bytes appended so far.
    #[getter]
    fn written_bytes(&self) -> u64 {
        self.inner
            .lock()
            .expect("never poisoned")
            .as_ref()
            .map_or(0, part_file::PartFileWriter::written_bytes)
    }

    /// Whether the file is written with O_DIRECT.
    #[getter]
    fn direct(&self) -> bool {
        self.inner
            .lock()
            .expect("never poisoned")
            .as_ref()
            .is_some_and(part_file::PartFileWriter::direct)
    }
}
