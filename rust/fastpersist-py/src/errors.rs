//! Maps engine errors onto the Python exception tree and onto real `OSError`s that keep errno.
//!
//! The classes are defined once, in `fastpersist.errors` (one hierarchy for Rust and Python);
//! `import_exception!` imports each the first time it is raised and keeps it, so an error is
//! raised by its type, never looked up by name. An error a Python callback raised inside a job
//! (`Error::Hook` holding the `PyErr`) is raised again as itself.

use fastpersist_core::Error;
use fastpersist_core::error::DISK_FULL_HINT;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

pyo3::import_exception!(fastpersist.errors, CorruptCheckpointError);
pyo3::import_exception!(fastpersist.errors, ChecksumMismatchError);
pyo3::import_exception!(fastpersist.errors, BackendUnavailableError);
pyo3::import_exception!(fastpersist.errors, SaveCancelledError);

/// Converts an engine error into the Python exception users catch.
pub(crate) fn to_pyerr(py: Python<'_>, err: &Error) -> PyErr {
    match err {
        Error::Io { op, path, source } => os_error(op, path, source, err),
        Error::SizeMismatch { .. } => CorruptCheckpointError::new_err(err.to_string()),
        Error::ChecksumMismatch {
            path,
            offset_bytes,
            len_bytes,
            expected,
            found,
        } => {
            let error = ChecksumMismatchError::new_err(err.to_string());
            // The details travel as attributes, so callers need not parse the message.
            let value = error.value(py);
            let set = value
                .setattr("filename", path.to_string_lossy().into_owned())
                .and_then(|()| value.setattr("offset_bytes", offset_bytes))
                .and_then(|()| value.setattr("len_bytes", len_bytes))
                .and_then(|()| value.setattr("expected", expected))
                .and_then(|()| value.setattr("found", found));
            match set {
                Ok(()) => error,
                Err(e) => e,
            }
        }
        Error::BackendUnavailable(_) => BackendUnavailableError::new_err(err.to_string()),
        Error::Cancelled(_) => SaveCancelledError::new_err(err.to_string()),
        Error::InvalidArgument(_) => PyValueError::new_err(err.to_string()),
        Error::Sys { source, .. } => {
            PyOSError::new_err((source.raw_os_error().unwrap_or(libc::EIO), err.to_string()))
        }
        Error::Hook { source, .. } => match source.downcast_ref::<PyErr>() {
            Some(raised) => raised.clone_ref(py),
            None => PyRuntimeError::new_err(err.to_string()),
        },
        Error::Internal(_) => PyRuntimeError::new_err(err.to_string()),
    }
}

/// `OSError(errno, strerror, filename)`: Python picks the subclass (FileNotFoundError, ...)
/// and fills `.errno` and `.filename`.
fn os_error(op: &str, path: &std::path::Path, source: &std::io::Error, err: &Error) -> PyErr {
    let filename = path.to_string_lossy().into_owned();
    let Some(errno) = source.raw_os_error() else {
        return PyOSError::new_err((libc::EIO, err.to_string(), filename));
    };
    let mut message = format!("{op}: {}", std::io::Error::from_raw_os_error(errno));
    if let Some(pos) = message.find(" (os error") {
        message.truncate(pos);
    }
    if errno == libc::ENOSPC {
        message.push_str(&format!(" ({DISK_FULL_HINT})"));
    }
    PyOSError::new_err((errno, message, filename))
}

/// Result conversion helper for bindings functions.
pub(crate) trait IntoPyResult<T> {
    /// Maps the error with [`to_pyerr`].
    fn into_py_result(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, Error> {
    fn into_py_result(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_pyerr(py, &e))
    }
}
