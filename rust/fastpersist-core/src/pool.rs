//! A bounded pool of page-aligned staging slots, reused across saves.
//!
//! A slot is checked out as a [`Slot`] guard and goes back to the pool when dropped, so a slot
//! that sits in an in-flight table returns only once its I/O has completed.

use std::fmt;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::align::AlignedBuf;

struct PoolState {
    free: Vec<(usize, AlignedBuf)>,
    /// Slots allocated so far (they are allocated lazily, at most `slot_count`).
    allocated: usize,
}

struct PoolInner {
    slot_bytes: usize,
    slot_count: usize,
    state: Mutex<PoolState>,
    returned: Condvar,
    /// The largest [`Block`] given back, kept for the next job's early copies.
    spare: Mutex<Option<AlignedBuf>>,
}

/// Page-aligned staging memory: `slot_count` slots of `slot_bytes` each.
#[derive(Clone)]
pub struct Pool {
    inner: Arc<PoolInner>,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("slot_bytes", &self.inner.slot_bytes)
            .field("slot_count", &self.inner.slot_count)
            .finish()
    }
}

impl Pool {
    /// A pool of at most `pool_bytes` (but never fewer than two slots: double buffering).
    pub fn new(slot_bytes: usize, pool_bytes: usize) -> Self {
        let slot_bytes = crate::round_up(slot_bytes.max(1), crate::DIRECT_ALIGN_BYTES);
        let slot_count = (pool_bytes / slot_bytes).max(2);
        Pool {
            inner: Arc::new(PoolInner {
                slot_bytes,
                slot_count,
                state: Mutex::new(PoolState {
                    free: Vec::with_capacity(slot_count),
                    allocated: 0,
                }),
                returned: Condvar::new(),
                spare: Mutex::new(None),
            }),
        }
    }

    /// Bytes per slot (a multiple of the O_DIRECT alignment).
    pub fn slot_bytes(&self) -> usize {
        self.inner.slot_bytes
    }

    /// Number of slots.
    pub fn slot_count(&self) -> usize {
        self.inner.slot_count
    }

    /// Bytes currently allocated by the pool.
    pub fn allocated_bytes(&self) -> usize {
        self.lock().allocated * self.inner.slot_bytes
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        // A panic while holding this lock cannot leave the free list inconsistent (push/pop
        // only), so a poisoned lock is still usable.
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A free slot, or `None` if all are checked out.
    pub fn try_acquire(&self) -> Option<Slot> {
        let mut state = self.lock();
        self.take(&mut state)
    }

    /// A free slot, waiting up to `timeout` for one to be returned.
    pub fn acquire_timeout(&self, timeout: Duration) -> Option<Slot> {
        let mut state = self.lock();
        loop {
            if let Some(slot) = self.take(&mut state) {
                return Some(slot);
            }
            let (next, result) = self
                .inner
                .returned
                .wait_timeout(state, timeout)
                .unwrap_or_else(|e| e.into_inner());
            state = next;
            if result.timed_out() {
                return self.take(&mut state);
            }
        }
    }

    /// Allocates every slot not allocated yet and writes each of its pages once, so that a
    /// save stages into memory the kernel has already handed over; returns the bytes faulted
    /// in. The first touch of fresh memory costs more than the copy into it (zeroing each page;
    /// on a VM, also the host backing it: 256 MiB took 0.35-0.5 s here against 0.03 s for the
    /// copy), and a process's first save would pay it. A save running meanwhile takes the
    /// slots already made, allocating the others itself as usual.
    pub fn prefault(&self) -> usize {
        let mut faulted = 0;
        loop {
            let index = {
                let mut state = self.lock();
                if state.allocated >= self.inner.slot_count {
                    break;
                }
                state.allocated += 1;
                state.allocated - 1
            };
            let mut buf = AlignedBuf::zeroed(self.inner.slot_bytes);
            buf.fill(0); // a store to every page (the compiler cannot know they read as zero)
            faulted += buf.len_bytes();
            self.lock().free.push((index, buf));
            self.inner.returned.notify_one();
        }
        faulted
    }

    fn take(&self, state: &mut PoolState) -> Option<Slot> {
        let (index, buf) = if let Some(entry) = state.free.pop() {
            entry
        } else if state.allocated < self.inner.slot_count {
            state.allocated += 1;
            (
                state.allocated - 1,
                AlignedBuf::zeroed(self.inner.slot_bytes),
            )
        } else {
            return None;
        };
        Some(Slot {
            index,
            buf: Some(buf),
            pool: Arc::clone(&self.inner),
        })
    }
}

impl Pool {
    /// A zeroed-or-reused block of at least `len_bytes` (its contents are unspecified), kept by
    /// the pool when dropped: a job's early copies (`job::guard`) then land in memory faulted
    /// in by an earlier job instead of taking a page fault per page every save. The pool keeps
    /// one such block, the largest given back, for as long as it lives.
    pub fn take_block(&self, len_bytes: usize) -> Block {
        let mut spare = self.inner.spare.lock().unwrap_or_else(|e| e.into_inner());
        let buf = match spare.take() {
            Some(buf) if buf.len_bytes() >= len_bytes => buf,
            kept => {
                *spare = kept; // too small for this job: left for a smaller one
                drop(spare);
                AlignedBuf::zeroed(len_bytes)
            }
        };
        Block {
            buf: Some(buf),
            len_bytes,
            pool: Arc::clone(&self.inner),
        }
    }

    /// Bytes held by the kept block (0 if none).
    pub fn spare_bytes(&self) -> usize {
        let spare = self.inner.spare.lock().unwrap_or_else(|e| e.into_inner());
        spare.as_ref().map_or(0, AlignedBuf::len_bytes)
    }
}

/// Memory of a pool's kept block (see [`Pool::take_block`]); goes back to the pool on drop.
pub struct Block {
    buf: Option<AlignedBuf>,
    len_bytes: usize,
    pool: Arc<PoolInner>,
}

impl Block {
    /// The block's first `len_bytes`, as asked for.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.len_bytes;
        &mut self.buf.as_mut().expect("block present until drop")[..len]
    }
}

impl fmt::Debug for Block {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Block")
            .field("len_bytes", &self.len_bytes)
            .finish()
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            let mut spare = self.pool.spare.lock().unwrap_or_else(|e| e.into_inner());
            if spare
                .as_ref()
                .is_none_or(|kept| kept.len_bytes() < buf.len_bytes())
            {
                *spare = Some(buf);
            }
        }
    }
}

/// A checked-out staging slot. Returns to its pool on drop.
pub struct Slot {
    index: usize,
    buf: Option<AlignedBuf>,
    pool: Arc<PoolInner>,
}

impl Slot {
    /// Stable index of this slot within its pool (for registered buffers).
    pub fn index(&self) -> usize {
        self.index
    }

    /// The slot's memory.
    pub fn buf(&self) -> &AlignedBuf {
        self.buf.as_ref().expect("slot buffer present until drop")
    }

    /// The slot's memory, mutably.
    pub fn buf_mut(&mut self) -> &mut AlignedBuf {
        self.buf.as_mut().expect("slot buffer present until drop")
    }
}

impl fmt::Debug for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Slot").field("index", &self.index).finish()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            let mut state = self.pool.state.lock().unwrap_or_else(|e| e.into_inner());
            state.free.push((self.index, buf));
            drop(state);
            self.pool.returned.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_and_reused() {
        let pool = Pool::new(8192, 3 * 8192);
        assert_eq!(pool.slot_count(), 3);
        let a = pool.try_acquire().unwrap();
        let b = pool.try_acquire().unwrap();
        let c = pool.try_acquire().unwrap();
        assert!(pool.try_acquire().is_none());
        let a_index = a.index();
        drop(a);
        let again = pool.try_acquire().unwrap();
        assert_eq!(again.index(), a_index);
        assert_eq!(pool.allocated_bytes(), 3 * 8192);
        drop((b, c, again));
        assert_eq!(pool.allocated_bytes(), 3 * 8192);
    }

    #[test]
    fn a_block_is_kept_and_reused() {
        let pool = Pool::new(4096, 4 * 4096);
        assert_eq!(pool.spare_bytes(), 0);
        let mut a = pool.take_block(3 << 20);
        assert_eq!(a.as_mut_slice().len(), 3 << 20);
        a.as_mut_slice()[0] = 7;
        let first = a.as_mut_slice().as_ptr();
        drop(a);
        assert_eq!(pool.spare_bytes(), 3 << 20);
        // a smaller job reuses it; a concurrent one gets memory of its own
        let mut b = pool.take_block(1 << 20);
        assert_eq!(b.as_mut_slice().as_ptr(), first);
        assert_eq!(b.as_mut_slice().len(), 1 << 20);
        let mut c = pool.take_block(1 << 20);
        assert_ne!(c.as_mut_slice().as_ptr(), first);
        drop(c);
        assert_eq!(pool.spare_bytes(), 1 << 20);
        drop(b); // the larger block is the one kept
        assert_eq!(pool.spare_bytes(), 3 << 20);
        // a larger job allocates, and its block replaces the kept one
        let d = pool.take_block(4 << 20);
        assert_eq!(pool.spare_bytes(), 3 << 20);
        drop(d);
        assert_eq!(pool.spare_bytes(), 4 << 20);
    }

    #[test]
    fn prefaulted_slots_are_the_pools_own() {
        let pool = Pool::new(8192, 4 * 8192);
        let held = pool.try_acquire().unwrap(); // allocated by a save before the prefault ran
        assert_eq!(pool.prefault(), 3 * 8192);
        assert_eq!(pool.allocated_bytes(), 4 * 8192);
        assert_eq!(pool.prefault(), 0);
        let mut slots: Vec<_> = (0..3).map(|_| pool.try_acquire().unwrap()).collect();
        assert!(pool.try_acquire().is_none());
        slots.push(held);
        let mut indices: Vec<_> = slots.iter().map(Slot::index).collect();
        indices.sort_unstable();
        assert_eq!(indices, [0, 1, 2, 3]);
    }

    #[test]
    fn at_least_two_slots() {
        let pool = Pool::new(1 << 20, 0);
        assert_eq!(pool.slot_count(), 2);
    }

    #[test]
    fn acquire_waits_for_return() {
        let pool = Pool::new(4096, 2 * 4096);
        let a = pool.try_acquire().unwrap();
        let _b = pool.try_acquire().unwrap();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            drop(a);
        });
        assert!(pool.acquire_timeout(Duration::from_secs(5)).is_some());
        t.join().unwrap();
    }
}
