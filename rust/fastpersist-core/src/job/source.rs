//! What a job reads: one [`SourceRegion`] per plan extent (host memory by pointer, or device
//! memory that a [`DeviceCopier`] stages), and the [`ExtentMap`] that finds the extents under
//! a range of the logical stream.

use crate::error::Result;
use crate::plan::Plan;

/// Read-only memory of one source extent (a tensor's bytes), referenced by raw pointer so that a
/// background thread can stage it while the caller keeps the owner alive.
#[derive(Debug, Clone, Copy)]
pub struct SourceRegion {
    pub(super) ptr: *const u8,
    pub(super) len_bytes: usize,
    /// The bytes live in device memory: a [`DeviceCopier`] puts them into the slot.
    pub(super) device: bool,
}

// SAFETY: a SourceRegion is only a promise (made in `new`) that the memory stays readable; the
// job reads it from one thread at a time and never writes it.
unsafe impl Send for SourceRegion {}

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
    /// [`DeviceCopier`] to copy them into each slot, and never dereferences a pointer for it.
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

/// Copies bytes of device-resident extents into host slots (a GPU's device-to-host copy).
///
/// A copy may be asynchronous: the job issues the next chunk's copies before it checksums the
/// current chunk, and calls [`DeviceCopier::wait`] before it reads a slot it asked copies into.
/// Until `wait` has returned the job neither reads, writes, submits nor frees that slot, and
/// keeps the sources, so a copier may go on writing `slot[range]` after `copy_to_host` returned.
pub trait DeviceCopier: Send {
    /// Copies (or queues the copy of) the bytes of extent `extent` starting at `offset_bytes`
    /// into `slot[range]`. The whole slot is passed so that a copier can register (pin) it once.
    fn copy_to_host(
        &mut self,
        extent: usize,
        offset_bytes: u64,
        slot: &mut [u8],
        range: std::ops::Range<usize>,
    ) -> Result<()>;

    /// Returns once every copy asked for so far has completed (a synchronous copier has
    /// nothing to wait for).
    fn wait(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Where each plan extent sits in the stream, for finding the extents under a byte range.
#[derive(Debug)]
pub(super) struct ExtentMap {
    starts: Vec<u64>,
    ends: Vec<u64>,
}

/// The part of one extent inside a byte range of the stream.
#[derive(Debug, Clone, Copy)]
pub(super) struct Overlap {
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
