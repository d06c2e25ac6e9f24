//! The staging arena of device saves: one page-aligned mapping, reused by every save that
//! stages device memory, leased to one job at a time.
//!
//! A device save copies its device bytes into the arena (the caller registers the arena with
//! the device's runtime once, so that the copies run at pinned speed), and the job writes its
//! chunks straight from it. The arena holds the job's chunks in stream order, one
//! `chunk_bytes` cell each, so that a tensor's bytes are one contiguous run of the arena and
//! need one device copy; a job whose chunks outnumber the cells stages them in arena-sized
//! windows, one after another.
//!
//! Writes reference arena memory through [`ArenaSpan`]s that keep the mapping alive: a backend
//! that has to give up on an in-flight write leaks its span (and so the mapping) rather than
//! let the memory go while the kernel may still read it.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::DIRECT_ALIGN_BYTES;
use crate::pages::{HUGE_PAGE_BYTES, map_huge_aligned, unmap_anonymous};
use crate::round_up;

struct ArenaMemory {
    base: NonNull<u8>,
    len_bytes: usize,
    leased: AtomicBool,
}

// SAFETY: the mapping is owned by this struct alone. Its bytes are written only by the one job
// that holds the lease (and by the device copies that job asked for, which it waits for before
// it lets go of the lease), and read by that job's writes and checksums.
unsafe impl Send for ArenaMemory {}
// SAFETY: see above; the lease flag is atomic.
unsafe impl Sync for ArenaMemory {}

impl Drop for ArenaMemory {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by map_huge_aligned in Arena::new with this length, and
        // nothing refers to it any more (every Arena, lease and span holds the Arc).
        unsafe { unmap_anonymous(self.base, self.len_bytes) };
    }
}

/// A staging arena: `len_bytes` of page-aligned memory (huge-page aligned and advised for
/// transparent huge pages), zeroed when made. Clones share the memory.
#[derive(Clone)]
pub struct Arena {
    memory: Arc<ArenaMemory>,
}

impl fmt::Debug for Arena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Arena")
            .field("len_bytes", &self.memory.len_bytes)
            .field("leased", &self.is_leased())
            .finish()
    }
}

impl Arena {
    /// Maps an arena of at least `len_bytes` (rounded up to whole huge pages).
    pub fn new(len_bytes: usize) -> std::io::Result<Arena> {
        let len_bytes = round_up(len_bytes.max(DIRECT_ALIGN_BYTES), HUGE_PAGE_BYTES);
        let base = map_huge_aligned(len_bytes)?;
        Ok(Arena {
            memory: Arc::new(ArenaMemory {
                base,
                len_bytes,
                leased: AtomicBool::new(false),
            }),
        })
    }

    /// Its length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.memory.len_bytes
    }

    /// Its first byte, for registering the memory with a device runtime. The memory is valid
    /// while any clone, lease or span of this arena lives.
    pub fn as_ptr(&self) -> *mut u8 {
        self.memory.base.as_ptr()
    }

    /// Whether a job holds the arena now.
    pub fn is_leased(&self) -> bool {
        self.memory.leased.load(Ordering::Acquire)
    }

    /// The arena for one job, unless another job holds it.
    pub fn try_lease(&self) -> Option<ArenaLease> {
        self.memory
            .leased
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| ArenaLease {
                memory: Arc::clone(&self.memory),
            })
    }
}

/// One job's hold on an [`Arena`]; the arena is free again when it is dropped.
pub struct ArenaLease {
    memory: Arc<ArenaMemory>,
}

impl fmt::Debug for ArenaLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ArenaLease")
            .field("len_bytes", &self.memory.len_bytes)
            .finish()
    }
}

impl Drop for ArenaLease {
    fn drop(&mut self) {
        self.memory.leased.store(false, Ordering::Release);
    }
}

impl ArenaLease {
    /// The arena's length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.memory.len_bytes
    }

    /// The arena's first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.memory.base.as_ptr()
    }

    /// The arena's bytes `[offset_bytes, offset_bytes + len_bytes)`, for a write to read from;
    /// None if they run past its end.
    pub fn span(&self, offset_bytes: usize, len_bytes: usize) -> Option<ArenaSpan> {
        let end = offset_bytes.checked_add(len_bytes)?;
        (end <= self.memory.len_bytes).then(|| ArenaSpan {
            memory: Arc::clone(&self.memory),
            offset_bytes,
            len_bytes,
        })
    }

    /// The arena's bytes `[offset_bytes, offset_bytes + len_bytes)`, read-only.
    ///
    /// # Safety
    /// Nothing may write those bytes while the slice lives: no device copy into them may be in
    /// flight (the job has waited for its copies) and the job does not fill them meanwhile.
    pub unsafe fn bytes(&self, offset_bytes: usize, len_bytes: usize) -> &[u8] {
        assert!(offset_bytes + len_bytes <= self.memory.len_bytes);
        // SAFETY: in bounds (asserted); the mapping lives as long as `self`; no writer (the
        // caller's promise).
        unsafe { std::slice::from_raw_parts(self.as_ptr().add(offset_bytes), len_bytes) }
    }

    /// The arena's bytes `[offset_bytes, offset_bytes + len_bytes)`, writable.
    ///
    /// # Safety
    /// Nothing else may read or write those bytes while the slice lives: no device copy into
    /// them in flight, no write or checksum reading them.
    #[allow(clippy::mut_from_ref)] // the lease is the job's alone; the caller keeps ranges apart
    pub unsafe fn bytes_mut(&self, offset_bytes: usize, len_bytes: usize) -> &mut [u8] {
        assert!(offset_bytes + len_bytes <= self.memory.len_bytes);
        // SAFETY: in bounds (asserted); the mapping lives as long as `self`; exclusive (the
        // caller's promise).
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr().add(offset_bytes), len_bytes) }
    }
}

/// Bytes of an arena that a write reads; keeps the arena's memory mapped while it lives.
pub struct ArenaSpan {
    memory: Arc<ArenaMemory>,
    offset_bytes: usize,
    len_bytes: usize,
}

impl fmt::Debug for ArenaSpan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ArenaSpan")
            .field("offset_bytes", &self.offset_bytes)
            .field("len_bytes", &self.len_bytes)
            .finish()
    }
}

impl ArenaSpan {
    /// The span's first byte.
    pub fn as_ptr(&self) -> *const u8 {
        // SAFETY: offset_bytes + len_bytes <= the mapping's length (checked in ArenaLease::span).
        unsafe { self.memory.base.as_ptr().add(self.offset_bytes) }
    }

    /// Its length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// The span's bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: in bounds (see as_ptr), mapped while `self` lives. A span is made only for a
        // range the job has finished filling (its device copies waited for), and nothing writes
        // it until the write reading it has completed and the span is dropped.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len_bytes) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_lease_at_a_time() {
        let arena = Arena::new(3 << 20).unwrap();
        assert_eq!(arena.len_bytes(), 4 << 20);
        assert_eq!(arena.as_ptr() as usize % HUGE_PAGE_BYTES, 0);
        let lease = arena.try_lease().unwrap();
        assert!(arena.is_leased());
        assert!(arena.try_lease().is_none());
        drop(lease);
        assert!(!arena.is_leased());
        assert!(arena.try_lease().is_some());
    }

    #[test]
    fn spans_keep_the_memory_and_stay_inside() {
        let arena = Arena::new(1).unwrap();
        let lease = arena.try_lease().unwrap();
        // SAFETY: nothing else touches the arena in this test.
        unsafe { lease.bytes_mut(4096, 3).copy_from_slice(&[1, 2, 3]) };
        let span = lease.span(4096, 4096).unwrap();
        assert!(lease.span(arena.len_bytes() - 1, 2).is_none());
        drop((lease, arena));
        assert_eq!(&span.bytes()[..4], &[1, 2, 3, 0]);
    }
}
