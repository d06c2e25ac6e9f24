//! Borrowing bytes from Python objects through the buffer protocol.

use fastpersist_core::job::SourceRegion;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::PyValueError;
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
