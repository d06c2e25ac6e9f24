//! `start_write`: a save job from a Python write request (plan, paths, source buffers, the
//! mutation guard's and the device staging's callbacks), run here or on a thread of its own.
//! The request's fields are documented once, on `WriteRequest` in `_core.pyi`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use fastpersist_core::job::{
    Crc32Field, Guard, JobHooks, SourceRegion, WriteOptions, WriteTarget, write_parts_with,
};
use fastpersist_core::plan;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::arena::ArenaLease;
use crate::buffers::HeldBuffer;
use crate::handle::{PyDeviceCopier, PyStagingObserver, Shared, WriteGate, WriteHandle};
use crate::{Plan, Pool};

/// What `start_write` is asked to do: the attributes of a Python `WriteRequest`
/// (`fastpersist.engine.WriteRequest`; each field is documented in `_core.pyi`), nested as the
/// core's job is.
#[derive(FromPyObject)]
pub(crate) struct WriteRequest<'py> {
    #[pyo3(attribute)]
    plan: PyRef<'py, Plan>,
    #[pyo3(attribute)]
    writer: usize,
    #[pyo3(attribute)]
    also_writers: Vec<usize>,
    #[pyo3(attribute)]
    paths: Vec<PathBuf>,
    #[pyo3(attribute)]
    sources: Vec<Option<Bound<'py, PyAny>>>,
    #[pyo3(attribute)]
    pool: PyRef<'py, Pool>,
    #[pyo3(attribute)]
    background: bool,
    #[pyo3(attribute)]
    options: WriteOptionsAttrs,
    #[pyo3(attribute)]
    hooks: JobHooksAttrs<'py>,
}

/// A request's `options` (`fastpersist.engine.WriteOptions`): the core's `WriteOptions`.
#[derive(FromPyObject)]
pub(crate) struct WriteOptionsAttrs {
    #[pyo3(attribute)]
    backend: String,
    #[pyo3(attribute)]
    direct_io: String,
    #[pyo3(attribute)]
    queue_depth: usize,
    #[pyo3(attribute)]
    checksum: bool,
    #[pyo3(attribute)]
    durable: bool,
    #[pyo3(attribute)]
    staging_threads: usize,
}

/// A request's `hooks` (`fastpersist.engine.JobHooks`): the core's `JobHooks`.
#[derive(FromPyObject)]
pub(crate) struct JobHooksAttrs<'py> {
    #[pyo3(attribute)]
    guard: Option<GuardAttrs>,
    #[pyo3(attribute)]
    device: Option<Bound<'py, PyAny>>,
    #[pyo3(attribute)]
    crc32_fields: Vec<(u64, u64, Vec<u64>)>,
    #[pyo3(attribute)]
    write_gate: Option<PyRef<'py, WriteGate>>,
}

/// The hooks' `guard` (`fastpersist.engine.Guard`): the core's mutation `Guard`.
#[derive(FromPyObject)]
pub(crate) struct GuardAttrs {
    #[pyo3(attribute)]
    watched: Vec<bool>,
    #[pyo3(attribute)]
    on_staged: Py<PyAny>,
    #[pyo3(attribute)]
    copy_early: Vec<usize>,
}

/// Starts the write that `request` describes (see `WriteRequest` in `_core.pyi`).
#[pyfunction]
pub(crate) fn start_write(py: Python<'_>, request: WriteRequest<'_>) -> PyResult<WriteHandle> {
    let asked = &request.options;
    let (selection, direct) = crate::io_choices(py, &asked.backend, &asked.direct_io)?;
    let options = WriteOptions {
        backend: selection.kind,
        direct,
        queue_depth: asked.queue_depth,
        checksum: asked.checksum,
        durable: asked.durable,
        staging_threads: asked.staging_threads,
    };
    let plan = &request.plan.inner;
    let targets = writer_targets(plan, request.writer, &request.also_writers, request.paths)?;
    let extents = &plan.extent_bytes;
    let (held, regions) = source_regions(&request.sources, extents)?;
    let given = request.hooks;
    let guard = given
        .guard
        .map(|guard| guard_from(guard, extents.len()))
        .transpose()?;
    let (device, arena) = match given.device {
        Some(staging) => {
            let lease = staging.getattr("lease")?;
            let lease = lease.cast::<ArenaLease>()?.get().take()?;
            let copier = PyDeviceCopier::new(
                staging.getattr("copy")?.unbind(),
                staging.getattr("wait")?.unbind(),
            );
            (
                Some(Box::new(copier) as Box<dyn fastpersist_core::job::DeviceCopier>),
                Some(lease),
            )
        }
        None => (None, None),
    };
    let hooks = JobHooks {
        guard,
        device,
        arena,
        crc32_fields: crc32_fields_from(given.crc32_fields),
        write_gate: given.write_gate.map(|gate| Arc::clone(&gate.inner)),
    };
    let shared = Shared::new();
    let (job_plan, job_pool, job_shared) = (
        Arc::clone(plan),
        request.pool.inner.clone(),
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
    let thread = run_job(py, job, request.background, &shared)?;
    Ok(WriteHandle {
        shared,
        sources: Mutex::new(Some(held)),
        backend: selection.kind.name(),
        fallback_reason: selection.fallback_reason,
        thread: Mutex::new(thread),
    })
}

/// The core's mutation guard from the request's (`watched` has an entry per extent).
fn guard_from(guard: GuardAttrs, extent_count: usize) -> PyResult<Guard> {
    if guard.watched.len() != extent_count {
        return Err(PyValueError::new_err(format!(
            "watched has an entry per source, and the plan has {extent_count} extents"
        )));
    }
    Ok(Guard {
        watched: guard.watched,
        copy_early: guard.copy_early,
        observer: Box::new(PyStagingObserver::new(guard.on_staged)),
    })
}

/// The core's fields from `crc32_fields`' `(start_bytes, len_bytes, [write_at_bytes])` tuples.
fn crc32_fields_from(fields: Vec<(u64, u64, Vec<u64>)>) -> Vec<Crc32Field> {
    fields
        .into_iter()
        .map(|(start_bytes, len_bytes, write_at_bytes)| Crc32Field {
            start_bytes,
            len_bytes,
            write_at_bytes,
        })
        .collect()
}

/// `writer`'s parts of `plan`, then each of `also_writers`' parts, each with the path it is
/// written to.
fn writer_targets(
    plan: &plan::Plan,
    writer: usize,
    also_writers: &[usize],
    paths: Vec<PathBuf>,
) -> PyResult<Vec<WriteTarget>> {
    if let Some(w) = also_writers
        .iter()
        .enumerate()
        .find_map(|(i, w)| (*w == writer || also_writers[..i].contains(w)).then_some(w))
    {
        return Err(PyValueError::new_err(format!(
            "writer {w} is named twice (writer={writer}, also_writers={also_writers:?})"
        )));
    }
    let parts: Vec<_> = std::iter::once(writer)
        .chain(also_writers.iter().copied())
        .flat_map(|w| plan.parts_of_writer(w).copied())
        .collect();
    if parts.len() != paths.len() {
        return Err(PyValueError::new_err(format!(
            "writers {writer} and {also_writers:?} have {} parts but {} paths were given",
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

/// The exported buffers of `sources` (to hold for as long as the regions are read: by a job,
/// until it releases its sources) and a region per extent; None stands for a device-resident
/// extent.
pub(crate) fn source_regions(
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
