//! Borrowing bytes from Python objects through the buffer protocol.

use std::os::raw::c_int;

use fastpersist_core::job::SourceRegion;
use fastpersist_core::pages::{PageSpan, SharedPages};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyMemoryError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;

/// A held buffer export: the exporter cannot free or resize the memory while this lives.
pub(crate) struct HeldBuffer {
    buffer: PyUntypedBuffer,
}

impl HeldBuffer {
    /// Gets a C-contiguous buffer from `obj`; `writable` additionally requires write access.
    pub fn get(obj: &Bound<'_, PyAny>, writable: bool, what: &str) -> PyResult<Self> {
        let buffer = PyUntypedBuffer::get(obj)?;
        if !buffer.is_c_contiguous() {
            return Err(PyValueError::new_err(format!(
                "{what} must be C-contiguous"
            )));
        }
        if writable && buffer.readonly() {
            return Err(PyValueError::new_err(format!("{what} must be writable")));
        }
        Ok(HeldBuffer { buffer })
    }

    /// The region for a write job.
    pub fn region(&self) -> SourceRegion {
        // SAFETY: the memory stays valid and un-resized while `self` (the buffer export) is
        // held; every caller keeps the HeldBuffer until the job reports its sources released.
        unsafe { SourceRegion::new(self.buffer.buf_ptr() as *const u8, self.buffer.len_bytes()) }
    }

    /// The exported memory.
    pub fn as_slice(&self) -> &[u8] {
        let len = self.buffer.len_bytes();
        if len == 0 {
            return &[];
        }
        // SAFETY: the export keeps `buf_ptr..+len` valid while `self` lives.
        unsafe { std::slice::from_raw_parts(self.buffer.buf_ptr() as *const u8, len) }
    }

    /// The exported memory as a mutable slice.
    ///
    /// # Safety
    /// The buffer must have been obtained with `writable = true`, and no other reference to the
    /// same memory may be used while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        let len = self.buffer.len_bytes();
        if len == 0 {
            return &mut [];
        }
        // SAFETY: the export keeps `buf_ptr..+len` valid and writable (checked in `get`); the
        // caller guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.buffer.buf_ptr() as *mut u8, len) }
    }
}

/// Page-aligned memory for loads whose pages go back to the OS span by span: `span(offset,
/// len)` gives a buffer that keeps only the pages under it mapped. Supports the buffer
/// protocol (writable bytes).
#[pyclass(frozen, module = "fastpersist._core")]
pub(crate) struct PagedBuffer {
    span: PageSpan,
}

#[pymethods]
impl PagedBuffer {
    #[new]
    fn new(len_bytes: usize) -> PyResult<Self> {
        let span = SharedPages::map(len_bytes).map_err(|e| {
            PyMemoryError::new_err(format!("cannot map {len_bytes} bytes for a load: {e}"))
        })?;
        Ok(PagedBuffer { span })
    }

    /// A buffer over `len_bytes` at `offset_bytes` of this one, holding only those pages.
    fn span(&self, offset_bytes: usize, len_bytes: usize) -> PyResult<Self> {
        let span = self.span.sub(offset_bytes, len_bytes).ok_or_else(|| {
            PyValueError::new_err(format!(
                "span [{offset_bytes}, +{len_bytes}) runs past the buffer's {} bytes",
                self.span.len_bytes()
            ))
        })?;
        Ok(PagedBuffer { span })
    }

    fn __len__(&self) -> usize {
        self.span.len_bytes()
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
            (this.span.as_ptr(), this.span.len_bytes())
        };
        // SAFETY: `view` is Python's (our caller's contract); the span's pages stay mapped
        // while the exporting object lives, and they are writable.
        unsafe { export_writable(slf.as_any(), view, flags, ptr, len) }
    }
}

/// Fills `view` with the writable bytes `[ptr, ptr + len)` that `owner` keeps alive: the
/// `__getbuffer__` of the memory objects this module and `arena` export.
///
/// # Safety
/// `view` must come from Python's buffer machinery, and `ptr..ptr + len` must stay valid and
/// writable for as long as `owner` lives (the view holds a reference to it).
pub(crate) unsafe fn export_writable(
    owner: &Bound<'_, PyAny>,
    view: *mut ffi::Py_buffer,
    flags: c_int,
    ptr: *mut u8,
    len: usize,
) -> PyResult<()> {
    // SAFETY: the caller's contract above; PyBuffer_FillInfo takes a new reference to `owner`.
    let rc = unsafe {
        ffi::PyBuffer_FillInfo(
            view,
            owner.as_ptr(),
            ptr.cast(),
            len as ffi::Py_ssize_t,
            0,
            flags,
        )
    };
    if rc != 0 {
        return Err(PyErr::fetch(owner.py()));
    }
    Ok(())
}
