//! `read_ranges_into`: a load's read job from Python arguments (file ranges, a destination
//! buffer), run with the GIL released.

use std::path::PathBuf;

use fastpersist_core::read::{ReadOptions, ReadPart, read_parts};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::buffers::HeldBuffer;
use crate::errors::IntoPyResult;

/// `(path, file_len_bytes, file_offset_bytes, len_bytes, dest_offset_bytes, chunk_crc32c)`.
type ReadRange = (PathBuf, u64, u64, u64, u64, Vec<u32>);

/// Reads ranges of part files into `dest` (a writable C-contiguous buffer), verifying chunk
/// checksums. `ranges` holds `(path, file_len_bytes, file_offset_bytes, len_bytes,
/// dest_offset_bytes, chunk_crc32c)`: a range starts at a chunk boundary of its file (a whole
/// file is `(path, n, 0, n, ...)`) and `chunk_crc32c` lists its chunks' checksums, or is empty
/// to skip verification. The engine adds its measures (`bytes`, `crc32c_s`) to `stats`.
/// Returns the bytes read.
#[pyfunction]
#[pyo3(signature = (ranges, dest, *, chunk_bytes, backend="auto", direct_io="auto", queue_depth=8, stats=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn read_ranges_into(
    py: Python<'_>,
    ranges: Vec<ReadRange>,
    dest: &Bound<'_, PyAny>,
    chunk_bytes: u64,
    backend: &str,
    direct_io: &str,
    queue_depth: usize,
    stats: Option<&Bound<'_, PyDict>>,
) -> PyResult<u64> {
    let parts: Vec<ReadPart> = ranges
        .into_iter()
        .map(
            |(path, file_len_bytes, file_offset_bytes, len_bytes, dest_offset_bytes, crcs)| {
                ReadPart {
                    path,
                    file_len_bytes,
                    file_offset_bytes,
                    len_bytes,
                    dest_offset_bytes,
                    chunk_crc32c: crcs,
                }
            },
        )
        .collect();
    let (selection, direct) = crate::io_choices(py, backend, direct_io)?;
    let options = ReadOptions {
        backend: selection.kind,
        direct,
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
