//! The mutation guard's side of a job: small watched extents are copied into job-owned memory
//! at once, and the observer hears when each other watched extent has been staged whole (from
//! then on its source may change freely).

use super::WriteTarget;
use super::source::{ExtentMap, SourceRegion};
use crate::error::{Error, Result};
use crate::plan::Plan;
use crate::pool::{Block, Pool};

/// Told when extents have been staged whole: from then on their source may change freely.
pub trait StagingObserver: Send {
    /// `extents` (plan indices) just had the last of this job's bytes of them staged. An error
    /// fails the job (e.g. the source was modified before it was staged).
    fn extents_staged(&mut self, extents: &[usize]) -> Result<()>;
}

/// Which extents may change under a job, and who checks.
pub struct Guard {
    /// Per plan extent: its source may be modified by someone while the job runs.
    pub watched: Vec<bool>,
    /// Watched host extents copied into job-owned memory before the job reports
    /// [`super::JobProgress::wait_copied_early`]: nothing can race them afterwards. (Which ones
    /// is the caller's rule: small ones, the buffers a forward pass updates in place.)
    pub copy_early: Vec<usize>,
    /// Told when each remaining watched extent has been staged whole.
    pub observer: Box<dyn StagingObserver>,
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard")
            .field("watched", &self.watched.iter().filter(|w| **w).count())
            .field("copy_early", &self.copy_early.len())
            .finish_non_exhaustive()
    }
}

/// What the staging side keeps of a [`Guard`].
pub(super) struct GuardState {
    watched: Vec<bool>,
    /// Per extent, this job's bytes of it not yet staged (watched extents only).
    remaining_bytes: Vec<u64>,
    /// Extents staged whole since the observer was last told.
    just_staged: Vec<usize>,
    observer: Box<dyn StagingObserver>,
    /// Early copies of small watched extents; the job's sources point into it for those. Its
    /// memory never moves (sized once, never grown) and lives as long as the staging.
    _early_copies: Block,
}

impl GuardState {
    /// Counts this job's bytes of each watched extent, and copies the small ones at once
    /// (pointing their `sources` entry at the copy).
    pub fn start(
        guard: Guard,
        plan: &Plan,
        extents: &ExtentMap,
        targets: &[WriteTarget],
        sources: &mut [SourceRegion],
        pool: &Pool,
    ) -> Result<Self> {
        let extent_count = plan.extent_bytes.len();
        if guard.watched.len() != extent_count {
            return Err(Error::Internal(format!(
                "the guard watches {} extents, the plan has {extent_count}",
                guard.watched.len()
            )));
        }
        let mut watched = guard.watched;
        let mut remaining_bytes = vec![0u64; extent_count];
        for target in targets {
            let start = target.part.stream_offset_bytes;
            for overlap in extents.overlapping(start, start + target.part.len_bytes) {
                if watched[overlap.index] {
                    remaining_bytes[overlap.index] += overlap.to - overlap.from;
                }
            }
        }
        let mut small = guard.copy_early;
        small.sort_unstable();
        small.dedup();
        if let Some(&bad) = small
            .iter()
            .find(|&&i| i >= extent_count || sources[i].device || !watched[i])
        {
            return Err(Error::InvalidArgument(format!(
                "extent {bad} cannot be copied early: only watched host extents of the plan's {extent_count} can"
            )));
        }
        small.retain(|&i| remaining_bytes[i] > 0); // none of this job's bytes: nothing to copy
        let early_copies = copy_early(&small, sources, pool);
        for &i in &small {
            watched[i] = false;
            remaining_bytes[i] = 0;
        }
        Ok(GuardState {
            watched,
            remaining_bytes,
            just_staged: Vec::new(),
            observer: guard.observer,
            _early_copies: early_copies,
        })
    }

    /// Records that stream bytes `[start, start + len_bytes)` are staged, and tells the
    /// observer about the watched extents that are now staged whole.
    pub fn note_staged(&mut self, extents: &ExtentMap, start: u64, len_bytes: u64) -> Result<()> {
        self.record_staged(extents, start, len_bytes);
        self.tell_observer()
    }

    /// Records that stream bytes `[start, start + len_bytes)` are staged; the observer hears of
    /// the extents that became whole at the next [`Self::tell_observer`].
    pub fn record_staged(&mut self, extents: &ExtentMap, start: u64, len_bytes: u64) {
        for overlap in extents.overlapping(start, start + len_bytes) {
            let i = overlap.index;
            if self.watched[i] {
                self.remaining_bytes[i] -= overlap.to - overlap.from;
                if self.remaining_bytes[i] == 0 {
                    self.just_staged.push(i);
                }
            }
        }
    }

    /// Tells the observer, in one call, about the extents staged whole since it was last told.
    pub fn tell_observer(&mut self) -> Result<()> {
        if self.just_staged.is_empty() {
            return Ok(());
        }
        let told = self.observer.extents_staged(&self.just_staged);
        self.just_staged.clear();
        told
    }
}

/// Copies the extents `small` into one block of our own and points their sources at it.
///
/// The block is the pool's kept one ([`Pool::take_block`]), so that the copy lands in memory an
/// earlier save already faulted in: copying a 1 GiB state's 61 MiB of small tensors into fresh
/// memory took 15,600 page faults, most of `save_async`'s time to return.
fn copy_early(small: &[usize], sources: &mut [SourceRegion], pool: &Pool) -> Block {
    let mut block = pool.take_block(small.iter().map(|&i| sources[i].len_bytes).sum());
    let early_copies = block.as_mut_slice();
    let mut at = 0;
    for &i in small {
        let len = sources[i].len_bytes;
        let dst = &mut early_copies[at..at + len];
        // SAFETY: the region is readable (SourceRegion::new's contract; the job holds the
        // sources until it releases them, which has not happened yet), its length is the
        // extent's (checked when the staging was made), and `dst` is memory of our own.
        unsafe { std::ptr::copy_nonoverlapping(sources[i].ptr, dst.as_mut_ptr(), len) };
        // SAFETY: the returned block is never grown or dropped before the staging is, so the
        // region stays readable for as long as the job reads its sources.
        sources[i] = unsafe { SourceRegion::new(dst.as_ptr(), len) };
        at += len;
    }
    block
}
