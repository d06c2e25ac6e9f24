//! `fastpersist._core`: a thin translator between Python and `fastpersist-core`. Functions
//! extract arguments, release the GIL around the core call, and map errors.

mod buffers;
mod errors;
mod handle;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use fastpersist_core::job::{
    Guard, JobHooks, SourceRegion, WriteOptions, WriteTarget, write_parts_with,
};
use fastpersist_core::probe::{self, BackendChoice, DirectMode};
use fastpersist_core::read::{ReadOptions, ReadPart, read_parts};
use fastpersist_core::{checksum, durable, plan, pool};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use buffers::{HeldBuffer, PagedBuffer};
use errors::IntoPyResult;
use handle::{PyDeviceCopier, PyStagingObserver, Shared, WriteHandle};

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

/// Page-aligned staging memory, reused across saves. Weak references let Python release what
/// it tied to the pool's memory (CUDA registrations of its slots) when the pool goes.
#[pyclass(frozen, weakref, module = "fastpersist._core")]
struct Pool {
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
        })
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
}

/// Starts writing `writer`'s parts of `plan` to `paths` from `sources` (one buffer per extent).
/// With `background=False` the write runs on this thread (GIL released) and the returned
/// handle is already finished.
///
/// The mutation guard: `watched[i]` says extent `i`'s source may be modified while the job
/// runs. Watched extents of at most `copy_max_extent_bytes` are copied (smallest first, up to
/// `copy_budget_bytes`) before this returns; `on_staged(extents)` is called (from the job's
/// thread, with the GIL) once each other watched extent is staged whole, and a false result
/// (or an exception) fails the job.
///
/// A source given as None lives in device memory: `device_copy(extent, offset_bytes, slot,
/// start, end)` is called (job's thread, GIL held) to copy that extent's bytes from
/// `offset_bytes` into `slot[start:end]`; `slot` is a writable memoryview over a whole staging
/// slot, valid only during the call.
#[pyfunction]
#[pyo3(signature = (plan, writer, paths, sources, pool, *, backend="auto", direct_io="auto", queue_depth=8, checksum=true, durable=true, background=false, watched=None, on_staged=None, copy_max_extent_bytes=0, copy_budget_bytes=0, device_copy=None))]
#[allow(clippy::too_many_arguments)]
fn start_write(
    py: Python<'_>,
    plan: &Plan,
    writer: usize,
    paths: Vec<PathBuf>,
    sources: Vec<Option<Bound<'_, PyAny>>>,
    pool: &Pool,
    backend: &str,
    direct_io: &str,
    queue_depth: usize,
    checksum: bool,
    durable: bool,
    background: bool,
    watched: Option<Vec<bool>>,
    on_staged: Option<Py<PyAny>>,
    copy_max_extent_bytes: u64,
    copy_budget_bytes: u64,
    device_copy: Option<Py<PyAny>>,
) -> PyResult<WriteHandle> {
    let guard = guard_from(watched, on_staged, copy_max_extent_bytes, copy_budget_bytes)?;
    let selection =
        probe::select(BackendChoice::parse(backend).into_py_result(py)?).into_py_result(py)?;
    let options = WriteOptions {
        backend: selection.kind,
        direct: DirectMode::parse(direct_io).into_py_result(py)?,
        queue_depth,
        checksum,
        durable,
    };
    let targets = writer_targets(&plan.inner, writer, paths)?;
    let extents = &plan.inner.extent_bytes;
    let (held, regions) = source_regions(&sources, extents)?;
    if guard
        .as_ref()
        .is_some_and(|g| g.watched.len() != extents.len())
    {
        return Err(PyValueError::new_err(format!(
            "watched= has an entry per source, and the plan has {} extents",
            extents.len()
        )));
    }
    let hooks = JobHooks {
        guard,
        device: device_copy.map(|callback| {
            Box::new(PyDeviceCopier::new(callback)) as Box<dyn fastpersist_core::job::DeviceCopier>
        }),
    };
    let shared = Shared::new();
    let (job_plan, job_pool, job_shared) = (
        Arc::clone(&plan.inner),
        pool.inner.clone(),
        Arc::clone(&shared),
    );
    let job = move || {
        let outcome = write_parts_with(
            &job_plan,
            &targets,
            regions,
            &job_pool,
            &options,
            &job_shared.progress,
            hooks,
        );
        job_shared.finish(outcome);
    };
    let thread = run_job(py, job, background, &shared)?;
    Ok(WriteHandle {
        shared,
        sources: Mutex::new(Some(held)),
        backend: selection.kind.name(),
        fallback_reason: selection.fallback_reason,
        thread: Mutex::new(thread),
    })
}

/// The mutation guard that `watched=` and `on_staged=` describe (both or neither).
fn guard_from(
    watched: Option<Vec<bool>>,
    on_staged: Option<Py<PyAny>>,
    copy_max_extent_bytes: u64,
    copy_budget_bytes: u64,
) -> PyResult<Option<Guard>> {
    match (watched, on_staged) {
        (Some(watched), Some(callback)) => Ok(Some(Guard {
            watched,
            copy_max_extent_bytes,
            copy_budget_bytes,
            observer: Box::new(PyStagingObserver::new(callback)),
        })),
        (None, None) => Ok(None),
        _ => Err(PyValueError::new_err("watched= and on_staged= go together")),
    }
}

/// `writer`'s parts of `plan`, each with the path it is written to.
fn writer_targets(
    plan: &plan::Plan,
    writer: usize,
    paths: Vec<PathBuf>,
) -> PyResult<Vec<WriteTarget>> {
    let parts: Vec<_> = plan.parts_of_writer(writer).copied().collect();
    if parts.len() != paths.len() {
        return Err(PyValueError::new_err(format!(
            "writer {writer} has {} parts but {} paths were given",
            parts.len(),
            paths.len()
        )));
    }
    Ok(parts
        .into_iter()
        .zip(paths)
        .map(|(part, path)| WriteTarget { part, path })
        .collect())
}

/// The exported buffers of `sources` (held until the job releases them) and a region per
/// extent; None stands for a device-resident extent.
fn source_regions(
    sources: &[Option<Bound<'_, PyAny>>],
    extents: &[u64],
) -> PyResult<(Vec<HeldBuffer>, Vec<SourceRegion>)> {
    if sources.len() != extents.len() {
        return Err(PyValueError::new_err(format!(
            "source regions do not match the plan's extents: {} sources for {} extents",
            sources.len(),
            extents.len()
        )));
    }
    let mut held = Vec::with_capacity(sources.len());
    let mut regions = Vec::with_capacity(sources.len());
    for (i, (source, &len)) in sources.iter().zip(extents).enumerate() {
        match source {
            Some(obj) => {
                let buffer = HeldBuffer::get(obj, false, &format!("source {i}"))?;
                regions.push(buffer.region());
                held.push(buffer);
            }
            None => regions.push(SourceRegion::device(len as usize)),
        }
    }
    if regions
        .iter()
        .zip(extents)
        .any(|(r, &n)| r.len_bytes() as u64 != n)
    {
        return Err(PyValueError::new_err(format!(
            "source regions do not match the plan's extents: a source's length differs from its extent's ({} extents)",
            extents.len()
        )));
    }
    Ok((held, regions))
}

/// Runs `job` on a thread of its own (returned once the small watched sources are copied) or,
/// without `background`, here with the GIL released.
fn run_job(
    py: Python<'_>,
    job: impl FnOnce() + Send + 'static,
    background: bool,
    shared: &Shared,
) -> PyResult<Option<std::thread::JoinHandle<()>>> {
    if !background {
        py.detach(job);
        return Ok(None);
    }
    let spawned = std::thread::Builder::new()
        .name("fastpersist-save".into())
        .spawn(job);
    let thread = spawned.map_err(|e| {
        pyo3::exceptions::PyOSError::new_err(format!("cannot start the save thread: {e}"))
    })?;
    // Small watched sources are copied before the caller may touch them again.
    py.detach(|| {
        shared
            .progress
            .wait_copied_early(std::time::Duration::from_secs(u64::MAX / 4))
    });
    Ok(Some(thread))
}

/// Reads part files into `dest` (a writable C-contiguous buffer), verifying chunk checksums.
/// `parts` holds `(path, len_bytes, dest_offset_bytes, chunk_crc32c)`; an empty checksum list
/// skips verification. Returns the bytes read.
#[pyfunction]
#[pyo3(signature = (parts, dest, *, chunk_bytes, backend="auto", direct_io="auto", queue_depth=8, stats=None))]
#[allow(clippy::too_many_arguments)]
fn read_into(
    py: Python<'_>,
    parts: Vec<(PathBuf, u64, u64, Vec<u32>)>,
    dest: &Bound<'_, PyAny>,
    chunk_bytes: u64,
    backend: &str,
    direct_io: &str,
    queue_depth: usize,
    stats: Option<&Bound<'_, PyDict>>,
) -> PyResult<u64> {
    let parts = parts
        .into_iter()
        .map(|(path, len, dest_offset, crcs)| ReadPart::whole(path, len, dest_offset, crcs))
        .collect();
    read_parts_into(
        py,
        parts,
        dest,
        chunk_bytes,
        backend,
        direct_io,
        queue_depth,
        stats,
    )
}

/// Reads ranges of part files into `dest`, verifying chunk checksums. `ranges` holds
/// `(path, file_len_bytes, file_offset_bytes, len_bytes, dest_offset_bytes, chunk_crc32c)`: a
/// range starts at a chunk boundary and `chunk_crc32c` lists its chunks' checksums (or is
/// empty). Returns the bytes read.
#[pyfunction]
#[pyo3(signature = (ranges, dest, *, chunk_bytes, backend="auto", direct_io="auto", queue_depth=8, stats=None))]
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
fn read_ranges_into(
    py: Python<'_>,
    ranges: Vec<(PathBuf, u64, u64, u64, u64, Vec<u32>)>,
    dest: &Bound<'_, PyAny>,
    chunk_bytes: u64,
    backend: &str,
    direct_io: &str,
    queue_depth: usize,
    stats: Option<&Bound<'_, PyDict>>,
) -> PyResult<u64> {
    let parts = ranges
        .into_iter()
        .map(
            |(
                path,
                file_len_bytes,
                file_offset_bytes,
                len_bytes,
                dest_offset_bytes,
                chunk_crc32c,
            )| ReadPart {
                path,
                file_len_bytes,
                file_offset_bytes,
                len_bytes,
                dest_offset_bytes,
                chunk_crc32c,
            },
        )
        .collect();
    read_parts_into(
        py,
        parts,
        dest,
        chunk_bytes,
        backend,
        direct_io,
        queue_depth,
        stats,
    )
}

#[allow(clippy::too_many_arguments)]
fn read_parts_into(
    py: Python<'_>,
    parts: Vec<ReadPart>,
    dest: &Bound<'_, PyAny>,
    chunk_bytes: u64,
    backend: &str,
    direct_io: &str,
    queue_depth: usize,
    stats: Option<&Bound<'_, PyDict>>,
) -> PyResult<u64> {
    let selection =
        probe::select(BackendChoice::parse(backend).into_py_result(py)?).into_py_result(py)?;
    let options = ReadOptions {
        backend: selection.kind,
        direct: DirectMode::parse(direct_io).into_py_result(py)?,
        queue_depth,
        chunk_bytes,
    };
    let held = HeldBuffer::get(dest, true, "dest")?;
    // SAFETY: `held` was obtained writable, stays alive for this call, and nothing else in this
    // process touches it meanwhile (the caller handed it over for the read).
    let dest_slice = unsafe { held.as_mut_slice() };
    let measured = py
        .detach(|| read_parts(&parts, dest_slice, &options))
        .into_py_result(py)?;
    if let Some(stats) = stats {
        // Added to what the dict holds, so that one dict can total several reads.
        add_stat(stats, "bytes", measured.bytes as f64)?;
        add_stat(stats, "crc32c_s", measured.crc32c_ns as f64 * 1e-9)?;
    }
    Ok(measured.bytes)
}

fn add_stat(stats: &Bound<'_, PyDict>, key: &str, value: f64) -> PyResult<()> {
    let before: f64 = match stats.get_item(key)? {
        Some(held) => held.extract()?,
        None => 0.0,
    };
    stats.set_item(key, before + value)
}

/// `(backend, fallback_reason)` that `choice` resolves to here (honours FASTPERSIST_BACKEND).
#[pyfunction]
#[pyo3(signature = (choice="auto"))]
fn select_backend(py: Python<'_>, choice: &str) -> PyResult<(&'static str, Option<String>)> {
    let selection =
        probe::select(BackendChoice::parse(choice).into_py_result(py)?).into_py_result(py)?;
    Ok((selection.kind.name(), selection.fallback_reason))
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

/// crc32c (Castagnoli) of a buffer.
#[pyfunction]
fn crc32c(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<u32> {
    let held = HeldBuffer::get(data, false, "data")?;
    Ok(py.detach(|| checksum::crc32c(held.as_slice())))
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
    m.add_class::<WriteHandle>()?;
    m.add_class::<PagedBuffer>()?;
    m.add_function(wrap_pyfunction!(start_write, m)?)?;
    m.add_function(wrap_pyfunction!(read_into, m)?)?;
    m.add_function(wrap_pyfunction!(read_ranges_into, m)?)?;
    m.add_function(wrap_pyfunction!(select_backend, m)?)?;
    m.add_function(wrap_pyfunction!(probe_uring, m)?)?;
    m.add_function(wrap_pyfunction!(direct_io_supported, m)?)?;
    m.add_function(wrap_pyfunction!(crc32c, m)?)?;
    m.add_function(wrap_pyfunction!(fsync_path, m)?)?;
    m.add_function(wrap_pyfunction!(fsync_dir, m)?)?;
    m.add_function(wrap_pyfunction!(replace_atomically, m)?)?;
    Ok(())
}
