//! The handle of a write job, as Python sees it: two completion points (sources released,
//! everything written) and waits that honour Ctrl-C.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fastpersist_core::Error;
use fastpersist_core::job::{CopyPiece, DeviceCopier, JobProgress, StagingObserver, WriteReport};
use pyo3::exceptions::PyTimeoutError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::buffers::HeldBuffer;
use crate::errors::to_pyerr;

/// Wait slice between checks for Ctrl-C.
const WAIT_SLICE: Duration = Duration::from_millis(50);

/// State shared between the job's thread and the handle.
pub(crate) struct Shared {
    pub progress: JobProgress,
    outcome: Mutex<Option<(Result<WriteReport, Error>, Duration)>>,
    finished: Condvar,
    started: Instant,
}

impl Shared {
    pub fn new() -> Arc<Self> {
        Arc::new(Shared {
            progress: JobProgress::default(),
            outcome: Mutex::new(None),
            finished: Condvar::new(),
            started: Instant::now(),
        })
    }

    pub fn finish(&self, outcome: Result<WriteReport, Error>) {
        let mut slot = self.outcome.lock().unwrap_or_else(|e| e.into_inner());
        *slot = Some((outcome, self.started.elapsed()));
        self.finished.notify_all();
    }

    fn is_finished(&self) -> bool {
        self.outcome
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    fn wait_finished(&self, timeout: Duration) -> bool {
        let guard = self.outcome.lock().unwrap_or_else(|e| e.into_inner());
        let (guard, _) = self
            .finished
            .wait_timeout_while(guard, timeout, |o| o.is_none())
            .unwrap_or_else(|e| e.into_inner());
        guard.is_some()
    }
}

/// Waits in short slices with the GIL released, checking for signals in between.
fn wait_interruptibly(
    py: Python<'_>,
    timeout_s: Option<f64>,
    mut ready: impl FnMut(Duration) -> bool + Send,
) -> PyResult<bool> {
    let deadline = timeout_s.map(|t| Instant::now() + Duration::from_secs_f64(t.max(0.0)));
    loop {
        let slice = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()).min(WAIT_SLICE),
            None => WAIT_SLICE,
        };
        if py.detach(|| ready(slice)) {
            return Ok(true);
        }
        py.check_signals()?;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(false);
        }
    }
}

/// The mutation guard's check, in Python: called from the job's thread with the GIL.
pub(crate) struct PyStagingObserver {
    callback: Py<PyAny>,
}

impl PyStagingObserver {
    pub fn new(callback: Py<PyAny>) -> Self {
        PyStagingObserver { callback }
    }
}

impl StagingObserver for PyStagingObserver {
    fn extents_staged(&mut self, extents: &[usize]) -> fastpersist_core::Result<()> {
        let verdict = Python::try_attach(|py| {
            self.callback
                .call1(py, (extents.to_vec(),))
                .and_then(|ok| ok.bind(py).is_truthy())
        });
        match verdict {
            Some(Ok(true)) => Ok(()),
            Some(Ok(false)) => Err(Error::Cancelled(
                "a source was modified before its bytes were staged".into(),
            )),
            Some(Err(raised)) => Err(Error::Hook {
                what: "the staging check failed".into(),
                source: Box::new(raised),
            }),
            None => Err(Error::Cancelled(
                "the interpreter is shutting down; the save cannot be checked".into(),
            )),
        }
    }
}

/// The device-to-host copies, in Python (CUDA copies into the pinned arena): each window's
/// pieces in one call, and one wait for them; both from the job's thread, with the GIL.
pub(crate) struct PyDeviceCopier {
    copy: Py<PyAny>,
    wait: Py<PyAny>,
}

impl PyDeviceCopier {
    pub fn new(copy: Py<PyAny>, wait: Py<PyAny>) -> Self {
        PyDeviceCopier { copy, wait }
    }
}

impl DeviceCopier for PyDeviceCopier {
    fn copy(&mut self, pieces: &[CopyPiece]) -> fastpersist_core::Result<()> {
        let outcome = Python::try_attach(|py| -> PyResult<()> {
            let pieces: Vec<(usize, u64, u64, u64)> = pieces
                .iter()
                .map(|p| {
                    (
                        p.extent,
                        p.extent_offset_bytes,
                        p.arena_offset_bytes,
                        p.len_bytes,
                    )
                })
                .collect();
            self.copy.call1(py, (pieces,)).map(|_| ())
        });
        match outcome {
            Some(Ok(())) => Ok(()),
            Some(Err(raised)) => Err(Error::Hook {
                what: "the device-to-host copies failed".into(),
                source: Box::new(raised),
            }),
            None => Err(Error::Cancelled(
                "the interpreter is shutting down; device memory cannot be staged".into(),
            )),
        }
    }

    fn wait(&mut self) -> fastpersist_core::Result<()> {
        match Python::try_attach(|py| self.wait.call0(py).map(|_| ())) {
            Some(Ok(())) => Ok(()),
            Some(Err(raised)) => Err(Error::Hook {
                what: "waiting for the device-to-host copies failed".into(),
                source: Box::new(raised),
            }),
            None => Err(Error::Cancelled(
                "the interpreter is shutting down; device memory cannot be staged".into(),
            )),
        }
    }
}

/// Holds a write job's writes back until opened (`fastpersist_core::job::WriteGate`): a
/// snapshot staged now is written once the disk is free.
#[pyclass(frozen, module = "fastpersist._core")]
pub(crate) struct WriteGate {
    pub inner: Arc<fastpersist_core::job::WriteGate>,
}

#[pymethods]
impl WriteGate {
    #[new]
    fn new() -> Self {
        WriteGate {
            inner: Arc::default(),
        }
    }

    /// Lets the job write.
    fn open(&self) {
        self.inner.open();
    }

    /// Whether it was opened.
    #[getter]
    fn is_open(&self) -> bool {
        self.inner.is_open()
    }
}

/// A running (or finished) write job.
#[pyclass(frozen, module = "fastpersist._core")]
pub(crate) struct WriteHandle {
    pub shared: Arc<Shared>,
    pub sources: Mutex<Option<Vec<HeldBuffer>>>,
    pub backend: &'static str,
    pub fallback_reason: Option<String>,
    pub thread: Mutex<Option<JoinHandle<()>>>,
}

impl WriteHandle {
    /// Drops the buffer exports once the job no longer reads them.
    fn release_sources_if_staged(&self) {
        if self.shared.progress.sources_released_after().is_some() {
            self.sources
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
        }
    }
}

#[pymethods]
impl WriteHandle {
    /// Waits until the job no longer reads the source buffers (they may be modified after).
    /// Raises TimeoutError if `timeout` seconds pass first.
    #[pyo3(signature = (timeout=None))]
    fn wait_staged(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let shared = Arc::clone(&self.shared);
        if !wait_interruptibly(py, timeout, |slice| {
            shared.progress.wait_sources_released(slice)
        })? {
            return Err(PyTimeoutError::new_err(
                "the save was not staged within the timeout",
            ));
        }
        self.release_sources_if_staged();
        Ok(())
    }

    /// Waits until every byte is written (and fsynced when durable); returns the report dict or
    /// raises the job's error. Raises TimeoutError if `timeout` seconds pass first.
    #[pyo3(signature = (timeout=None))]
    fn wait<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyDict>> {
        let shared = Arc::clone(&self.shared);
        if !wait_interruptibly(py, timeout, |slice| shared.wait_finished(slice))? {
            return Err(PyTimeoutError::new_err(
                "the save did not finish within the timeout",
            ));
        }
        self.release_sources_if_staged();
        if let Some(thread) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            py.detach(|| thread.join()).ok();
        }
        let outcome = self
            .shared
            .outcome
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let (result, elapsed) = outcome.as_ref().expect("finished");
        match result {
            Ok(report) => report_dict(py, report, self, *elapsed),
            Err(e) => Err(to_pyerr(py, e)),
        }
    }

    /// True once the job has finished (successfully or not).
    fn done(&self) -> bool {
        let finished = self.shared.is_finished();
        if finished {
            self.release_sources_if_staged();
        }
        finished
    }

    /// True once the source buffers are no longer read.
    fn staged(&self) -> bool {
        let staged = self.shared.progress.sources_released_after().is_some();
        if staged {
            self.release_sources_if_staged();
        }
        staged
    }

    /// Asks the job to stop; it then fails with SaveCancelledError.
    fn cancel(&self) {
        self.shared.progress.cancel();
    }

    /// Bytes copied into the staging pool so far.
    #[getter]
    fn bytes_staged(&self) -> u64 {
        self.shared.progress.staged_bytes()
    }

    /// Bytes whose write has completed so far.
    #[getter]
    fn bytes_written(&self) -> u64 {
        self.shared.progress.written_bytes()
    }

    /// `"io_uring"` or `"threads"`.
    #[getter]
    fn backend(&self) -> &'static str {
        self.backend
    }

    /// Why `auto` fell back to threads, if it did.
    #[getter]
    fn fallback_reason(&self) -> Option<String> {
        self.fallback_reason.clone()
    }

    /// Seconds from the start until the sources were released, once they are.
    #[getter]
    fn staged_seconds(&self) -> Option<f64> {
        self.shared
            .progress
            .sources_released_after()
            .map(|d| d.as_secs_f64())
    }
}

impl Drop for WriteHandle {
    fn drop(&mut self) {
        // The job may still be reading source memory that these exports keep alive: hold them
        // until it stops (staging is bounded; the job never waits on Python).
        let sources = self.sources.get_mut().unwrap_or_else(|e| e.into_inner());
        if sources.is_some() {
            let progress = &self.shared.progress;
            let forever = Duration::from_secs(u64::MAX / 4);
            // The job's staging check needs the GIL: let go of it while waiting.
            Python::try_attach(|py| py.detach(|| progress.wait_sources_released(forever)))
                .unwrap_or_else(|| progress.wait_sources_released(forever));
        }
    }
}

fn report_dict<'py>(
    py: Python<'py>,
    report: &WriteReport,
    handle: &WriteHandle,
    elapsed: Duration,
) -> PyResult<Bound<'py, PyDict>> {
    let parts = PyList::empty(py);
    for part in &report.parts {
        let entry = PyDict::new(py);
        entry.set_item("path", part.path.to_string_lossy())?;
        entry.set_item("len_bytes", part.len_bytes)?;
        entry.set_item("chunk_crc32c", &part.chunk_crc32c)?;
        entry.set_item("direct", part.direct)?;
        parts.append(entry)?;
    }
    let dict = PyDict::new(py);
    dict.set_item("parts", parts)?;
    dict.set_item("bytes_written", report.bytes_written)?;
    dict.set_item("backend", handle.backend)?;
    dict.set_item("seconds", elapsed.as_secs_f64())?;
    dict.set_item(
        "staged_seconds",
        handle
            .shared
            .progress
            .sources_released_after()
            .map(|d| d.as_secs_f64()),
    )?;
    Ok(dict)
}
