//! `start_write`: a save job from Python arguments (plan, paths, source buffers, the mutation
//! guard's and the device copier's callbacks), run here or on a thread of its own.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use fastpersist_core::job::{
    Crc32Field, Guard, JobHooks, SourceRegion, WriteOptions, WriteTarget, write_parts_with,
};
use fastpersist_core::plan;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::buffers::HeldBuffer;
use crate::handle::{PyDeviceCopier, PyStagingObserver, Shared, WriteHandle};
use crate::{Plan, Pool};

/// Starts writing `writer`'s parts of `plan`, then those of each writer in `also_writers`, to
/// `paths` (one per part, in that order) from `sources` (one buffer per extent).
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
/// start, end)` is called (job's thread, GIL held) to copy, or queue the copy of, that extent's
/// bytes from `offset_bytes` into `slot[start:end]`; `slot` is a writable memoryview over a
/// whole staging slot, valid only during the call. `device_wait()` is called before the job
/// reads a slot it asked copies into: it returns once every copy asked for has completed (the
/// slot's memory stays the job's, untouched, until then). Without it copies must be done on
/// return.
///
/// `crc32_fields`: `(start_bytes, len_bytes, [write_at_bytes, ...])` per stream range whose
/// CRC-32 (IEEE) is written little-endian at each offset while staging (a zip archive's record
/// CRCs); the plan must then have one part.
#[pyfunction]
#[pyo3(signature = (plan, writer, paths, sources, pool, *, backend="auto", direct_io="auto", queue_depth=8, checksum=true, durable=true, background=false, watched=None, on_staged=None, copy_max_extent_bytes=0, copy_budget_bytes=0, device_copy=None, device_wait=None, also_writers=None, crc32_fields=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn start_write(
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
    device_wait: Option<Py<PyAny>>,
    also_writers: Option<Vec<usize>>,
    crc32_fields: Option<Vec<(u64, u64, Vec<u64>)>>,
) -> PyResult<WriteHandle> {
    let (selection, direct) = crate::io_choices(py, backend, direct_io)?;
    let options = WriteOptions {
        backend: selection.kind,
        direct,
        queue_depth,
        checksum,
        durable,
    };
    let targets = writer_targets(
        &plan.inner,
        writer,
        &also_writers.unwrap_or_default(),
        paths,
    )?;
    let extents = &plan.inner.extent_bytes;
    let (held, regions) = source_regions(&sources, extents)?;
    let guard = guard_from(
        watched,
        on_staged,
        copy_max_extent_bytes,
        copy_budget_bytes,
        extents.len(),
    )?;
    let hooks = JobHooks {
        guard,
        device: device_copy.map(|callback| {
            Box::new(PyDeviceCopier::new(callback, device_wait))
                as Box<dyn fastpersist_core::job::DeviceCopier>
        }),
        crc32_fields: crc32_fields_from(crc32_fields),
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

/// The mutation guard that `watched=` (an entry per extent) and `on_staged=` describe (both or
/// neither).
fn guard_from(
    watched: Option<Vec<bool>>,
    on_staged: Option<Py<PyAny>>,
    copy_max_extent_bytes: u64,
    copy_budget_bytes: u64,
    extent_count: usize,
) -> PyResult<Option<Guard>> {
    match (watched, on_staged) {
        (Some(watched), Some(_)) if watched.len() != extent_count => Err(PyValueError::new_err(
            format!("watched= has an entry per source, and the plan has {extent_count} extents"),
        )),
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

/// The core's fields from `crc32_fields=`'s `(start_bytes, len_bytes, [write_at_bytes])` tuples.
fn crc32_fields_from(fields: Option<Vec<(u64, u64, Vec<u64>)>>) -> Vec<Crc32Field> {
    fields
        .unwrap_or_default()
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
