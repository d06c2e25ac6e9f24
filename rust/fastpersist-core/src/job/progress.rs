//! A job's progress as others see it: byte counters, cancellation, and the two moments callers
//! wait for (small watched extents copied; sources released).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// A moment in a job's life that others wait for: set once, with the time since the job began.
#[derive(Debug, Default)]
struct Latch {
    after: Mutex<Option<Duration>>,
    reached: Condvar,
}

impl Latch {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Duration>> {
        self.after.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set(&self, elapsed: Duration) {
        let mut after = self.lock();
        if after.is_none() {
            *after = Some(elapsed);
            self.reached.notify_all();
        }
    }

    fn get(&self) -> Option<Duration> {
        *self.lock()
    }

    fn wait(&self, timeout: Duration) -> bool {
        let guard = self.lock();
        let (guard, _) = self
            .reached
            .wait_timeout_while(guard, timeout, |after| after.is_none())
            .unwrap_or_else(|e| e.into_inner());
        guard.is_some()
    }
}

/// Progress shared between a job and whoever waits on it.
#[derive(Debug)]
pub struct JobProgress {
    started: Instant,
    staged_bytes: AtomicU64,
    written_bytes: AtomicU64,
    cancelled: AtomicBool,
    copied_early: Latch,
    released: Latch,
}

impl Default for JobProgress {
    fn default() -> Self {
        JobProgress {
            started: Instant::now(),
            staged_bytes: AtomicU64::new(0),
            written_bytes: AtomicU64::new(0),
            cancelled: AtomicBool::new(false),
            copied_early: Latch::default(),
            released: Latch::default(),
        }
    }
}

impl JobProgress {
    /// Bytes copied into the pool so far.
    pub fn staged_bytes(&self) -> u64 {
        self.staged_bytes.load(Ordering::Relaxed)
    }

    pub(super) fn add_staged_bytes(&self, bytes: u64) {
        self.staged_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Bytes whose write completed so far.
    pub fn written_bytes(&self) -> u64 {
        self.written_bytes.load(Ordering::Relaxed)
    }

    pub(super) fn add_written_bytes(&self, bytes: u64) {
        self.written_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Asks the job to stop. It fails with [`Error::Cancelled`] at its next chunk, or at the
    /// latest before it reports success: a cancelled job never succeeds.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
    }

    /// Whether [`JobProgress::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }

    pub(super) fn check_cancelled(&self, when: &str) -> Result<()> {
        if self.is_cancelled() {
            return Err(Error::Cancelled(format!("the save was cancelled {when}")));
        }
        Ok(())
    }

    pub(super) fn mark_copied_early(&self) {
        self.copied_early.set(self.started.elapsed());
    }

    /// Waits until the job has copied the extents a [`super::Guard`] asked to copy at once (or
    /// failed, or finished staging). Returns false on timeout.
    pub fn wait_copied_early(&self, timeout: Duration) -> bool {
        self.copied_early.wait(timeout)
    }

    pub(super) fn mark_sources_released(&self) {
        self.mark_copied_early();
        self.released.set(self.started.elapsed());
    }

    /// Time from job start until the sources were released, once they are.
    pub fn sources_released_after(&self) -> Option<Duration> {
        self.released.get()
    }

    /// Waits until the job no longer reads source memory. Returns false on timeout.
    pub fn wait_sources_released(&self, timeout: Duration) -> bool {
        self.released.wait(timeout)
    }
}

/// Holds a job's writes back until it is opened: a snapshot staged now is written once the
/// disk is free (a `Checkpointer` saving every step). The job stages as usual, releases its
/// sources, then waits here before its first write; a cancelled job stops waiting and fails.
#[derive(Debug, Default)]
pub struct WriteGate {
    opened: Latch,
}

impl WriteGate {
    /// Lets the job write.
    pub fn open(&self) {
        self.opened.set(Duration::ZERO);
    }

    /// Whether [`WriteGate::open`] was called.
    pub fn is_open(&self) -> bool {
        self.opened.get().is_some()
    }

    /// Returns once the gate is open; fails if the job is cancelled first.
    pub(super) fn wait(&self, progress: &JobProgress) -> Result<()> {
        while !self.opened.wait(Duration::from_millis(20)) {
            progress.check_cancelled("while its snapshot waited for the disk")?;
        }
        Ok(())
    }
}
