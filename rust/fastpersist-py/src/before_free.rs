//! Callbacks that run when a Rust-owned memory object goes, before its memory is freed (a weak
//! reference's callback would run only after: pyo3 drops the value first).

use std::sync::Mutex;

use pyo3::prelude::*;

/// The callbacks of one object, called in the order given when it is dropped; an exception is
/// reported as unraisable. Not called while the interpreter is finalizing: nothing may call
/// into Python or CUDA then, and the process's exit releases what they would.
#[derive(Default)]
pub(crate) struct BeforeFree(Mutex<Vec<Py<PyAny>>>);

impl BeforeFree {
    pub fn push(&self, callback: Py<PyAny>) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(callback);
    }
}

impl Drop for BeforeFree {
    fn drop(&mut self) {
        let callbacks = std::mem::take(self.0.get_mut().unwrap_or_else(|e| e.into_inner()));
        if callbacks.is_empty() {
            return;
        }
        Python::try_attach(|py| {
            for callback in callbacks {
                if let Err(raised) = callback.call0(py) {
                    raised.write_unraisable(py, None);
                }
            }
        });
    }
}
