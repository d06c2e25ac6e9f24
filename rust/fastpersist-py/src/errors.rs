//! Maps engine errors onto the Python exception tree (defined in `fastpersist.errors`, so
//! there is one hierarchy for Rust and Python) and onto real `OSError`s that keep errno.

use fastpersist_core::Error;
use fastpersist_core::error::DISK_FULL_HINT;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

fn python_error(py: Python<'_>, class: &str, message: String) -> PyErr {
    python_error_with(py, class, message, &[])
}

/// Builds `fastpersist.errors.<class>(message)` and sets `attributes` on it, so callers can
/// react to the details (which file, which byte range) without parsing the message.
fn python_error_with(
    py: Python<'_>,
    class: &str,
    message: String,
    attributes: &[(&str, Py<PyAny>)],
) -> PyErr {
    let built = py
        .import("fastpersist.errors")
        .and_then(|m| m.getattr(class))
        .and_then(|cls| cls.call1((message,)))
        .and_then(|instance| {
            for (name, value) in attributes {
                instance.setattr(*name, value.bind(py))?;
            }
            Ok(instance)
        });
    match built {
        Ok(instance) => PyErr::from_value(instance),
        Err(e) => e,
    }
}

/// Converts an engine error into the Python exception users catch.
pub(crate) fn to_pyerr(py: Python<'_>, err: &Error) -> PyErr {
    match err {
        Error::Io { op, path, source } => match source.raw_os_error() {
            // OSError(errno, strerror, filename) picks the subclass (FileNotFoundError, ...)
            // and fills .errno and .filename.
            Some(errno) => {
                let mut message = format!("{op}: {}", std::io::Error::from_raw_os_error(errno));
                if let Some(pos) = message.find(" (os error") {
                    message.truncate(pos);
                }
                if errno == libc::ENOSPC {
                    message.push_str(&format!(" ({DISK_FULL_HINT})"));
                }
                PyOSError::new_err((errno, message, path.to_string_lossy().into_owned()))
            }
            None => PyOSError::new_err((
                libc::EIO,
                err.to_string(),
                path.to_string_lossy().into_owned(),
            )),
        },
        Error::SizeMismatch { .. } => python_error(py, "CorruptCheckpointError", err.to_string()),
        Error::ChecksumMismatch {
            path,
            offset_bytes,
            len_bytes,
            expected,
            found,
        } => {
            let attributes = (|| -> PyResult<Vec<(&str, Py<PyAny>)>> {
                Ok(vec![
                    (
                        "filename",
                        path.to_string_lossy()
                            .into_owned()
                            .into_pyobject(py)?
                            .into_any()
                            .unbind(),
                    ),
                    (
                        "offset_bytes",
                        offset_bytes.into_pyobject(py)?.into_any().unbind(),
                    ),
                    (
                        "len_bytes",
                        len_bytes.into_pyobject(py)?.into_any().unbind(),
                    ),
                    ("expected", expected.into_pyobject(py)?.into_any().unbind()),
                    ("found", found.into_pyobject(py)?.into_any().unbind()),
                ])
            })();
            match attributes {
                Ok(attributes) => {
                    python_error_with(py, "ChecksumMismatchError", err.to_string(), &attributes)
                }
                Err(e) => e,
            }
        }
        Error::BackendUnavailable(_) => {
            python_error(py, "BackendUnavailableError", err.to_string())
        }
        Error::Cancelled(_) => python_error(py, "SaveCancelledError", err.to_string()),
        Error::InvalidArgument(_) => PyValueError::new_err(err.to_string()),
        Error::Sys { source, .. } => {
            PyOSError::new_err((source.raw_os_error().unwrap_or(libc::EIO), err.to_string()))
        }
        Error::Internal(_) => PyRuntimeError::new_err(err.to_string()),
    }
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
