//! What a job reads: one [`SourceRegion`] per plan extent (host memory by pointer, or device
//! memory that a [`DeviceCopier`] copies into the job's arena), and the [`ExtentMap`] that
//! finds the extents under a range of the logical stream.

use crate::error::{Error, Result};
use crate::plan::Plan;

/// Read-only memory of one source extent (a tensor's bytes), referenced by raw pointer so that a
/// background thread can stage it while the caller keeps the owner alive.
#[derive(Debug, Clone, Copy)]
pub struct SourceRegion {
    pub(crate) ptr: *const u8,
    pub(crate) len_bytes: usize,
    /// The bytes live in device memory: a [`DeviceCopier`] puts them into the arena.
    pub(crate) device: bool,
}

// SAFETY: a SourceRegion is only a promise (made in `new`) that the memory stays readable until
// the job releases its sources; the job only ever reads it, never writes it.
unsafe impl Send for SourceRegion {}
// SAFETY: as for Send: shared `&SourceRegion`s give only reads of memory nobody writes while the
// job holds it (a concurrent write by the caller is its bug: torn data, as one thread reading
// would see), so a job's staging threads may read disjoint ranges of it at once.
unsafe impl Sync for SourceRegion {}

impl SourceRegion {
    /// # Safety
    /// `ptr..ptr+len_bytes` must stay valid for reads until the job that receives this region
    /// reports its sources released ([`super::JobProgress::wait_sources_released`]) or returns.
    /// Concurrent writes to it are a caller bug that gives torn (not unsafe-to-write) data.
    pub unsafe fn new(ptr: *const u8, len_bytes: usize) -> Self {
        SourceRegion {
            ptr,
            len_bytes,
            device: false,
        }
    }

    /// An extent whose bytes are in device (e.g. GPU) memory: the job asks its
    /// [`DeviceCopier`] to copy them into its arena, and never dereferences a pointer for it.
    pub fn device(len_bytes: usize) -> Self {
        SourceRegion {
            ptr: std::ptr::null(),
            len_bytes,
            device: true,
        }
    }

    /// A region over a slice. The region does not borrow the slice, so this is `unsafe`.
    ///
    /// # Safety
    /// As for [`SourceRegion::new`]: `bytes` must stay alive (not freed, moved or resized)
    /// until the job that receives the region releases its sources or returns.
    pub unsafe fn from_slice(bytes: &[u8]) -> Self {
        SourceRegion {
            ptr: bytes.as_ptr(),
            len_bytes: bytes.len(),
            device: false,
        }
    }

    /// Length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }
}

/// One device-to-host copy of a device save: bytes `[extent_offset_bytes, +len_bytes)` of
/// extent `extent` into bytes `[arena_offset_bytes, +len_bytes)` of the job's arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyPiece {
    /// The extent's index in the plan.
    pub extent: usize,
    /// Where the bytes start in the extent.
    pub extent_offset_bytes: u64,
    /// Where they go in the arena.
    pub arena_offset_bytes: u64,
    /// How many bytes.
    pub len_bytes: u64,
}

/// Copies bytes of device-resident extents into the job's arena (a GPU's device-to-host copy).
///
/// The job asks for a whole window of the arena at once, one [`CopyPiece`] per contiguous run
/// (for a state that fits the arena: one call, one piece per tensor), then waits once. Copies
/// may be asynchronous: until [`DeviceCopier::wait`] has returned, the job neither reads nor
/// writes the arena bytes it asked copies into, and neither lets go of the arena nor of the
/// sources, so a copier may go on writing them after `copy` returned.
pub trait DeviceCopier: Send {
    /// Copies (or queues the copies of) `pieces` into the arena the job was given.
    fn copy(&mut self, pieces: &[CopyPiece]) -> Result<()>;

    /// Returns once every copy asked for so far has completed (a synchronous copier has
    /// nothing to wait for).
    fn wait(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Checks that there is one source per plan extent, each of its extent's length.
pub(crate) fn check_against_plan(plan: &Plan, sources: &[SourceRegion]) -> Result<()> {
    if sources.len() != plan.extent_bytes.len()
        || sources
            .iter()
            .zip(&plan.extent_bytes)
            .any(|(s, &l)| s.len_bytes as u64 != l)
    {
        return Err(Error::Internal(
            "source regions do not match the plan's extents".into(),
        ));
    }
    Ok(())
}

/// Where each plan extent sits in the stream, for finding the extents under a byte range.
#[derive(Debug)]
pub(crate) struct ExtentMap {
    starts: Vec<u64>,
    ends: Vec<u64>,
}

/// The part of one extent inside a byte range of the stream.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Overlap {
    /// The extent's index in the plan.
    pub index: usize,
    /// The extent's first byte in the stream.
    pub extent_start: u64,
    /// Stream bytes `[from, to)` of the extent inside the range (never empty).
    pub from: u64,
    pub to: u64,
}

impl ExtentMap {
    pub fn new(plan: &Plan) -> Self {
        ExtentMap {
            starts: plan.extent_offsets.clone(),
            ends: plan
                .extent_offsets
                .iter()
                .zip(&plan.extent_bytes)
                .map(|(o, l)| o + l)
                .collect(),
        }
    }

    /// The extents with bytes inside stream bytes `[start, end)`, in stream order.
    pub fn overlapping(&self, start: u64, end: u64) -> impl Iterator<Item = Overlap> + '_ {
        let first = self.ends.partition_point(|&e| e <= start);
        (first..self.ends.len())
            .take_while(move |&index| self.starts[index] < end)
            .map(move |index| Overlap {
                index,
                extent_start: self.starts[index],
                from: self.starts[index].max(start),
                to: self.ends[index].min(end),
            })
            .filter(|overlap| overlap.from < overlap.to)
    }
}
