//! `fastpersist._core`: a thin translator between Python and `fastpersist-core`. Functions
//! extract arguments, release the GIL around the core call, and map errors.

mod arena;
mod before_free;
mod buffers;
mod errors;
mod file_ahead;
mod handle;
mod part_file;
mod read;
mod walk;
mod write;

use std::path::PathBuf;
use std::sync::Arc;

use fastpersist_core::probe::{self, BackendChoice, DirectMode};
use fastpersist_core::{checksum, content_hash, durable, plan, pool};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use before_free::BeforeFree;
use buffers::{HeldBuffer, PagedBuffer};
use errors::IntoPyResult;
use handle::WriteHandle;

/// The layout of a checkpoint: where each extent sits in the stream and which parts exist.
#[pyclass(frozen, module = "fastpersist._core")]
struct Plan {
    inner: Arc<plan::Plan>,
}

#[pymethods]
impl Plan {
    #[new]
    // A literal default (not `8 << 20`) so that the text signature shows it, not `...`.
    #[pyo3(signature = (extent_bytes, writer_count=1, stripe_count=1, chunk_bytes=8388608))]
    fn new(
        py: Python<'_>,
        extent_bytes: Vec<u64>,
        writer_count: usize,
        stripe_count: usize,
        chunk_bytes: u64,
    ) -> PyResult<Self> {
        let inner = plan::Plan::new(&extent_bytes, writer_count, stripe_count, chunk_bytes)
            .into_py_result(py)?;
        Ok(Plan {
            inner: Arc::new(inner),
        })
    }

    /// Logical stream length in bytes.
    #[getter]
    fn total_bytes(&self) -> u64 {
        self.inner.total_bytes
    }

    /// Size of one aligned write.
    #[getter]
    fn chunk_bytes(&self) -> u64 {
        self.inner.chunk_bytes
    }

    /// Offset of each extent in the stream.
    #[getter]
    fn extent_offsets(&self) -> Vec<u64> {
        self.inner.extent_offsets.clone()
    }

    /// Parts as `(writer, stripe, stream_offset_bytes, len_bytes)`.
    #[getter]
    fn parts(&self) -> Vec<(usize, usize, u64, u64)> {
        self.inner
            .parts
            .iter()
            .map(|p| (p.writer, p.stripe, p.stream_offset_bytes, p.len_bytes))
            .collect()
    }
}

/// Page-aligned staging memory, reused across saves. What Python tied to the pool's memory (CUDA
/// registrations of its slots) is released by callbacks the pool calls before that memory is
/// freed (see `before_free`).
#[pyclass(frozen, weakref, module = "fastpersist._core")]
struct Pool {
    // Declared first, so dropped first: the callbacks run while the memory is still allocated.
    before_free: BeforeFree,
    inner: pool::Pool,
}

#[pymethods]
impl Pool {
    #[new]
    fn new(slot_bytes: usize, pool_bytes: usize) -> PyResult<Self> {
        if slot_bytes == 0 || slot_bytes > plan::MAX_CHUNK_BYTES as usize {
            return Err(PyValueError::new_err(format!(
                "slot_bytes must be in 1..={}",
                plan::MAX_CHUNK_BYTES
            )));
        }
        Ok(Pool {
            inner: pool::Pool::new(slot_bytes, pool_bytes),
            before_free: BeforeFree::default(),
        })
    }

    /// Calls `callback()` when the pool goes, before its memory is freed (in the order given;
    /// an exception is reported as unraisable). It must not refer to the pool.
    fn call_before_free(&self, callback: Py<PyAny>) {
        self.before_free.push(callback);
    }

    /// Bytes per slot.
    #[getter]
    fn slot_bytes(&self) -> usize {
        self.inner.slot_bytes()
    }

    /// Number of slots.
    #[getter]
    fn slot_count(&self) -> usize {
        self.inner.slot_count()
    }

    /// Bytes allocated so far (slots are allocated on first use).
    #[getter]
    fn allocated_bytes(&self) -> usize {
        self.inner.allocated_bytes()
    }

    /// Bytes of the block kept for the next job's early copies (0 if none).
    #[getter]
    fn spare_bytes(&self) -> usize {
        self.inner.spare_bytes()
    }

    /// Allocates every slot not allocated yet and faults its pages in, the GIL released;
    /// returns the bytes faulted in.
    fn prefault(&self, py: Python<'_>) -> usize {
        py.detach(|| self.inner.prefault())
    }
}

/// Raises ValueError unless `chunk_bytes` is a chunk size the engine writes and reads: a
/// positive multiple of `DIRECT_ALIGN_BYTES` up to `MAX_CHUNK_BYTES`.
#[pyfunction]
fn check_chunk_bytes(py: Python<'_>, chunk_bytes: u64) -> PyResult<()> {
    plan::check_chunk_bytes(chunk_bytes).into_py_result(py)
}

/// Number of chunks of `chunk_bytes` that a range of `len_bytes` is cut into.
#[pyfunction]
fn chunk_count(py: Python<'_>, len_bytes: u64, chunk_bytes: u64) -> PyResult<u64> {
    plan::check_chunk_bytes(chunk_bytes).into_py_result(py)?;
    Ok(plan::chunk_count(len_bytes, chunk_bytes))
}

/// `(offset_bytes, len_bytes)` of each chunk of a range of `len_bytes`, from the range's start:
/// every chunk is `chunk_bytes` long but the last.
#[pyfunction]
fn chunk_spans(py: Python<'_>, len_bytes: u64, chunk_bytes: u64) -> PyResult<Vec<(u64, u64)>> {
    plan::check_chunk_bytes(chunk_bytes).into_py_result(py)?;
    Ok(plan::chunk_spans(len_bytes, chunk_bytes)
        .map(|span| (span.offset_bytes, span.len_bytes))
        .collect())
}

/// `[start, end)` of each of `count` near-equal runs of whole chunks that cut bytes
/// `[start_bytes, end_bytes)` (`start_bytes` chunk-aligned), as the plan shares chunks among
/// writers; a run is empty when there are fewer chunks than runs.
#[pyfunction]
fn chunk_runs(
    py: Python<'_>,
    start_bytes: u64,
    end_bytes: u64,
    chunk_bytes: u64,
    count: usize,
) -> PyResult<Vec<(u64, u64)>> {
    plan::check_chunk_bytes(chunk_bytes).into_py_result(py)?;
    if count == 0 || end_bytes < start_bytes || !start_bytes.is_multiple_of(chunk_bytes) {
        return Err(PyValueError::new_err(format!(
            "chunk_runs needs count >= 1 and a chunk-aligned start_bytes <= end_bytes \
             (got count={count}, [{start_bytes}, {end_bytes}), chunk_bytes={chunk_bytes})"
        )));
    }
    Ok(plan::chunk_runs(start_bytes, end_bytes, chunk_bytes, count).collect())
}

/// The XXH3-128 of each chunk of `plan`'s logical stream (`sources`: a C-contiguous buffer per
/// extent, as `start_write` takes them), hashed on `threads` threads with the GIL released:
/// 16 little-endian bytes per chunk, concatenated.
#[pyfunction]
#[pyo3(signature = (plan, sources, threads=1))]
fn chunk_hashes<'py>(
    py: Python<'py>,
    plan: PyRef<'py, Plan>,
    sources: Vec<Option<Bound<'py, PyAny>>>,
    threads: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    if let Some(i) = sources.iter().position(Option::is_none) {
        return Err(PyValueError::new_err(format!(
            "source {i} is device-resident: chunk_hashes reads host memory"
        )));
    }
    let plan = &plan.inner;
    let (held, regions) = write::source_regions(&sources, &plan.extent_bytes)?;
    let hashes = py
        .detach(|| content_hash::chunk_hashes(plan, &regions, threads))
        .into_py_result(py)?;
    drop(held);
    let digests: Vec<u8> = hashes.iter().flat_map(|h| h.to_le_bytes()).collect();
    Ok(PyBytes::new(py, &digests))
}

/// `(backend, fallback_reason)` that `choice` resolves to here (honours FASTPERSIST_BACKEND).
#[pyfunction]
#[pyo3(signature = (choice="auto"))]
fn select_backend(py: Python<'_>, choice: &str) -> PyResult<(&'static str, Option<String>)> {
    let selection = selected_backend(py, choice)?;
    Ok((selection.kind.name(), selection.fallback_reason))
}

/// The backend that the `backend=` string of a bindings call selects here.
fn selected_backend(py: Python<'_>, choice: &str) -> PyResult<probe::Selection> {
    probe::select(BackendChoice::parse(choice).into_py_result(py)?).into_py_result(py)
}

/// What a job's `backend=` and `direct_io=` strings ask for: the selected backend and the
/// O_DIRECT policy.
fn io_choices(
    py: Python<'_>,
    backend: &str,
    direct_io: &str,
) -> PyResult<(probe::Selection, DirectMode)> {
    let selection = selected_backend(py, backend)?;
    Ok((selection, DirectMode::parse(direct_io).into_py_result(py)?))
}

/// A file owning a duplicate of `fd`, an open descriptor the caller only lends for the call
/// (it keeps and closes its own); `name` is for messages.
pub(crate) fn duplicate_fd(fd: i32, name: &std::path::Path) -> PyResult<std::fs::File> {
    if fd < 0 {
        return Err(PyValueError::new_err(format!(
            "fd must be an open file descriptor, not {fd}"
        )));
    }
    // SAFETY: the caller holds `fd` open for this call; it is duplicated at once, and the
    // duplicate is what the returned file owns.
    let owned = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) }
        .try_clone_to_owned()
        .map_err(|e| {
            pyo3::exceptions::PyOSError::new_err(format!(
                "cannot duplicate fd {fd} of {}: {e}",
                name.display()
            ))
        })?;
    Ok(std::fs::File::from(owned))
}

/// Probes io_uring now (uncached): None if usable, else why not. `simulate_errno` is a test hook.
#[pyfunction]
#[pyo3(signature = (simulate_errno=None))]
fn probe_uring(simulate_errno: Option<i32>) -> Option<String> {
    probe::probe_uring(simulate_errno).err()
}

/// Whether files in `directory` can be opened with O_DIRECT.
#[pyfunction]
fn direct_io_supported(py: Python<'_>, directory: PathBuf) -> PyResult<bool> {
    py.detach(|| probe::direct_io_supported(&directory))
        .into_py_result(py)
}

/// Whether `directory` lies on a memory filesystem (tmpfs, ramfs): the in-memory level, written
/// through mappings of reused files.
#[pyfunction]
fn is_memory_fs(py: Python<'_>, directory: PathBuf) -> PyResult<bool> {
    py.detach(|| fastpersist_core::job::is_memory_fs(&directory))
        .into_py_result(py)
}

/// Whether a job with `backend=` and `direct_io=` writes the files at `paths` in memory
/// (tmpfs, ramfs): through mappings of them, or a device save staged into its file's own
/// mapping. The engine's one rule for it.
#[pyfunction]
fn writes_in_memory(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    backend: &str,
    direct_io: &str,
) -> PyResult<bool> {
    let (selection, direct) = io_choices(py, backend, direct_io)?;
    let paths: Vec<&std::path::Path> = paths.iter().map(PathBuf::as_path).collect();
    Ok(py.detach(|| fastpersist_core::job::writes_in_memory(&paths, direct, selection.kind)))
}

/// crc32c (Castagnoli) of a buffer.
#[pyfunction]
fn crc32c(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<u32> {
    let held = HeldBuffer::get(data, false, "data")?;
    Ok(py.detach(|| checksum::crc32c(held.as_slice())))
}

/// Checks `data`, the bytes at chunk-aligned `offset_bytes` of the part file `path`, against
/// `chunk_crc32c` (every chunk of that file): `ChecksumMismatchError` naming the first chunk that
/// differs.
#[pyfunction]
fn check_chunks(
    py: Python<'_>,
    path: PathBuf,
    data: &Bound<'_, PyAny>,
    offset_bytes: u64,
    chunk_bytes: u64,
    chunk_crc32c: Vec<u32>,
) -> PyResult<()> {
    let held = HeldBuffer::get(data, false, "data")?;
    py.detach(|| {
        checksum::check_chunks(
            &path,
            held.as_slice(),
            offset_bytes,
            chunk_bytes,
            &chunk_crc32c,
        )
    })
    .into_py_result(py)
}

/// fsyncs a file.
#[pyfunction]
fn fsync_path(py: Python<'_>, path: PathBuf) -> PyResult<()> {
    py.detach(|| durable::fsync_path(&path)).into_py_result(py)
}

/// fsyncs a directory (makes renames and new entries in it durable).
#[pyfunction]
fn fsync_dir(py: Python<'_>, path: PathBuf) -> PyResult<()> {
    py.detach(|| durable::fsync_dir(&path)).into_py_result(py)
}

/// Atomically puts `src` at `dst`, exchanging with an existing `dst` (which then sits at `src`).
/// Returns whether an exchange happened.
#[pyfunction]
fn replace_atomically(py: Python<'_>, src: PathBuf, dst: PathBuf) -> PyResult<bool> {
    py.detach(|| durable::replace_atomically(&src, &dst))
        .into_py_result(py)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("DIRECT_ALIGN_BYTES", fastpersist_core::DIRECT_ALIGN_BYTES)?;
    m.add("EXTENT_ALIGN_BYTES", plan::EXTENT_ALIGN_BYTES)?;
    m.add("MAX_CHUNK_BYTES", plan::MAX_CHUNK_BYTES)?;
    m.add(
        "MAX_QUEUE_DEPTH",
        fastpersist_core::backend::MAX_QUEUE_DEPTH,
    )?;
    m.add_class::<Plan>()?;
    m.add_class::<Pool>()?;
    m.add_class::<arena::Arena>()?;
    m.add_class::<arena::ArenaLease>()?;
    m.add_class::<WriteHandle>()?;
    m.add_class::<handle::WriteGate>()?;
    m.add_class::<PagedBuffer>()?;
    m.add_class::<part_file::PartFileWriter>()?;
    m.add_class::<file_ahead::MemoryFileAhead>()?;
    m.add_function(wrap_pyfunction!(write::start_write, m)?)?;
    m.add_function(wrap_pyfunction!(read::read_ranges_into, m)?)?;
    m.add_function(wrap_pyfunction!(check_chunk_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(chunk_count, m)?)?;
    m.add_function(wrap_pyfunction!(chunk_spans, m)?)?;
    m.add_function(wrap_pyfunction!(chunk_runs, m)?)?;
    m.add_function(wrap_pyfunction!(chunk_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(select_backend, m)?)?;
    m.add_function(wrap_pyfunction!(probe_uring, m)?)?;
    m.add_function(wrap_pyfunction!(direct_io_supported, m)?)?;
    m.add_function(wrap_pyfunction!(is_memory_fs, m)?)?;
    m.add_function(wrap_pyfunction!(writes_in_memory, m)?)?;
    m.add_function(wrap_pyfunction!(crc32c, m)?)?;
    m.add_function(wrap_pyfunction!(check_chunks, m)?)?;
    m.add_function(wrap_pyfunction!(fsync_path, m)?)?;
    m.add_function(wrap_pyfunction!(fsync_dir, m)?)?;
    m.add_function(wrap_pyfunction!(replace_atomically, m)?)?;
    m.add_function(wrap_pyfunction!(walk::flatten_walk, m)?)?;
    Ok(())
}
