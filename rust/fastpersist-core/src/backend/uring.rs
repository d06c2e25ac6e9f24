//! The io_uring backend: one ring per job, owned by the thread that drives the job.
//!
//! Every op pushed to the ring lives in `in_flight` (keyed by `user_data`) until its completion
//! is reaped, so the memory the kernel reads or writes is never freed or reused early, even on
//! error paths. Short transfers are resubmitted from where they stopped.

use std::io;

use io_uring::{IoUring, opcode, squeue, types};

use super::{Direction, IoBuf, IoOp, OpenFile, Progress, Submitter, advance};
use crate::error::{Error, Result};

/// Entries in a ring's registered-buffer table (slots with a higher index use plain writes).
const FIXED_SLOT_TABLE: usize = 4096;

pub(super) struct UringSubmitter<'f, 'a> {
    ring: IoUring,
    direction: Direction,
    files: &'f [OpenFile],
    fixed_files: bool,
    /// Pool slots registered with this ring (by slot index), when the kernel allowed a
    /// buffer table at all; a write from a registered slot skips pinning its pages.
    fixed_slots: Option<Vec<bool>>,
    in_flight: Vec<Option<IoOp<'a>>>,
    free_keys: Vec<usize>,
    unsubmitted: usize,
}

fn build_ring(entries: u32) -> io::Result<IoUring> {
    // single_issuer + coop_taskrun cut kernel overhead when one thread submits and reaps; older
    // kernels reject them with EINVAL, so fall back to a plain ring.
    IoUring::builder()
        .setup_single_issuer()
        .setup_coop_taskrun()
        .build(entries)
        .or_else(|_| IoUring::new(entries))
}

impl<'f, 'a> UringSubmitter<'f, 'a> {
    pub(super) fn new(
        direction: Direction,
        files: &'f [OpenFile],
        queue_depth: usize,
    ) -> Result<Self> {
        let entries = (queue_depth as u32).next_power_of_two().max(4);
        let ring = build_ring(entries).map_err(|e| {
            Error::BackendUnavailable(format!(
                "io_uring setup failed ({e}); use backend=\"threads\""
            ))
        })?;
        let fds: Vec<_> = files.iter().map(OpenFile::fd).collect();
        // Registered files save a file-table lookup per op; "try, fall back" when refused.
        let fixed_files = !fds.is_empty() && ring.submitter().register_files(&fds).is_ok();
        // A sparse table costs nothing until a slot is registered into it (on first use, see
        // `register_slot`); "try, fall back" to plain writes when refused (memlock, old kernel).
        let fixed_slots = (direction == Direction::Write
            && ring
                .submitter()
                .register_buffers_sparse(FIXED_SLOT_TABLE as u32)
                .is_ok())
        .then(|| vec![false; FIXED_SLOT_TABLE]);
        Ok(UringSubmitter {
            ring,
            direction,
            files,
            fixed_files,
            fixed_slots,
            in_flight: Vec::with_capacity(queue_depth),
            free_keys: Vec::new(),
            unsubmitted: 0,
        })
    }

    /// Registers pool slot `index` (memory `base..base+len`) on first use; whether it is registered.
    fn register_slot(&mut self, index: usize, base: *mut u8, len: usize) -> bool {
        let Some(table) = self.fixed_slots.as_mut() else {
            return false;
        };
        if index >= table.len() {
            return false;
        }
        if !table[index] {
            let iov = libc::iovec {
                iov_base: base.cast(),
                iov_len: len,
            };
            // SAFETY: a slot's memory is allocated once and stays allocated (at the same address)
            // for the life of its pool, which the job borrows for longer than this ring lives;
            // the registration is dropped with the ring (or unregistered in Drop).
            let registered = unsafe {
                self.ring
                    .submitter()
                    .register_buffers_update(index as u32, &[iov], None)
            };
            if registered.is_err() {
                self.fixed_slots = None;
                return false;
            }
            table[index] = true;
        }
        true
    }

    fn entry_for(&mut self, key: usize) -> squeue::Entry {
        let slot = match &mut self.in_flight[key]
            .as_mut()
            .expect("op present for its key")
            .buf
        {
            IoBuf::Slot(slot) if self.direction == Direction::Write => Some((
                slot.index(),
                slot.buf_mut().as_mut_ptr(),
                slot.buf().len_bytes(),
            )),
            _ => None,
        };
        let fixed_index = slot
            .and_then(|(index, base, len)| self.register_slot(index, base, len).then_some(index));
        let op = self.in_flight[key]
            .as_mut()
            .expect("op present for its key");
        // SAFETY: `done_bytes < len_bytes <= capacity` (checked before push, and `advance` only
        // resubmits when bytes remain), so the pointer stays inside the op's buffer.
        let ptr = unsafe { op.buf.as_mut_ptr().add(op.done_bytes) };
        let len = (op.len_bytes - op.done_bytes) as u32;
        let offset = op.offset_bytes + op.done_bytes as u64;
        let fd = self.files[op.file].fd();
        if let Some(index) = fixed_index {
            let entry = if self.fixed_files {
                opcode::WriteFixed::new(types::Fixed(op.file as u32), ptr, len, index as u16)
                    .offset(offset)
                    .build()
            } else {
                opcode::WriteFixed::new(types::Fd(fd), ptr, len, index as u16)
                    .offset(offset)
                    .build()
            };
            return entry.user_data(key as u64);
        }
        let entry = match (self.direction, self.fixed_files) {
            (Direction::Write, true) => opcode::Write::new(types::Fixed(op.file as u32), ptr, len)
                .offset(offset)
                .build(),
            (Direction::Write, false) => opcode::Write::new(types::Fd(fd), ptr, len)
                .offset(offset)
                .build(),
            (Direction::Read, true) => opcode::Read::new(types::Fixed(op.file as u32), ptr, len)
                .offset(offset)
                .build(),
            (Direction::Read, false) => opcode::Read::new(types::Fd(fd), ptr, len)
                .offset(offset)
                .build(),
        };
        entry.user_data(key as u64)
    }

    /// Pushes the entry for the op stored under `key`, submitting first if the queue is full.
    fn push_key(&mut self, key: usize) -> Result<()> {
        let entry = self.entry_for(key);
        loop {
            // SAFETY: the entry points into the buffer of the op stored in `self.in_flight[key]`,
            // which is removed (and so freed or reused) only after its completion is reaped in
            // `wait`, or never if the ring fails (see Drop). The fd is kept open by `self.files`,
            // which outlives the ring.
            let pushed = unsafe { self.ring.submission().push(&entry) };
            if pushed.is_ok() {
                self.unsubmitted += 1;
                return Ok(());
            }
            self.submit(0)?;
        }
    }

    fn submit(&mut self, want: usize) -> Result<()> {
        loop {
            match self.ring.submit_and_wait(want) {
                Ok(_) => {
                    self.unsubmitted = 0;
                    return Ok(());
                }
                Err(e) => match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    // The completion queue is full or the kernel is short of memory: reaping
                    // completions makes room.
                    Some(libc::EBUSY) | Some(libc::EAGAIN) => return Ok(()),
                    _ => {
                        return Err(Error::Sys {
                            op: "io_uring_enter",
                            source: e,
                        });
                    }
                },
            }
        }
    }
}

impl<'a> Submitter<'a> for UringSubmitter<'_, 'a> {
    fn push(&mut self, op: IoOp<'a>) -> Result<()> {
        let key = match self.free_keys.pop() {
            Some(key) => {
                self.in_flight[key] = Some(op);
                key
            }
            None => {
                self.in_flight.push(Some(op));
                self.in_flight.len() - 1
            }
        };
        self.push_key(key)?;
        // Submit at once: the next op is staged by this same thread, and the device should be
        // busy with this one meanwhile.
        self.submit(0)
    }

    fn wait(&mut self, finished: &mut Vec<(IoOp<'a>, Result<()>)>) -> Result<()> {
        self.submit(1)?;
        self.reap(finished)
    }

    fn poll(&mut self, finished: &mut Vec<(IoOp<'a>, Result<()>)>) -> Result<()> {
        // Entering the kernel also runs the task work that posts completions (COOP_TASKRUN).
        self.submit(0)?;
        self.reap(finished)
    }
}

impl<'a> UringSubmitter<'_, 'a> {
    /// Takes every completion the ring holds: finished ops are appended, short ones resubmitted.
    fn reap(&mut self, finished: &mut Vec<(IoOp<'a>, Result<()>)>) -> Result<()> {
        let reaped: Vec<(usize, i32)> = self
            .ring
            .completion()
            .map(|cqe| (cqe.user_data() as usize, cqe.result()))
            .collect();
        for (key, result) in reaped {
            let mut op = self.in_flight[key]
                .take()
                .expect("completion for a live op");
            let file = &self.files[op.file];
            let outcome = if result < 0 {
                let name = if self.direction == Direction::Write {
                    "write"
                } else {
                    "read"
                };
                Err(Error::io(
                    name,
                    &file.path,
                    io::Error::from_raw_os_error(-result),
                ))
            } else {
                advance(&mut op, self.direction, result as usize, file)
            };
            match outcome {
                Ok(Progress::Resubmit) => {
                    self.in_flight[key] = Some(op);
                    self.push_key(key)?;
                }
                Ok(Progress::Complete) => {
                    self.free_keys.push(key);
                    finished.push((op, Ok(())));
                }
                Err(e) => {
                    self.free_keys.push(key);
                    finished.push((op, Err(e)));
                }
            }
        }
        Ok(())
    }
}

impl Drop for UringSubmitter<'_, '_> {
    fn drop(&mut self) {
        let live = self.in_flight.iter().filter(|op| op.is_some()).count();
        if live == 0 {
            // The kernel tears a ring down asynchronously, and registered files keep their
            // files open until it has: a caller that deletes a file it just wrote would see
            // the space come back later, and an unmount could fail with EBUSY. Unregistering
            // while the ring is alive drops those references now.
            if self.fixed_files {
                let _ = self.ring.submitter().unregister_files();
            }
            // Likewise unpin the registered slots now rather than at the asynchronous teardown.
            if self.fixed_slots.is_some() {
                let _ = self.ring.submitter().unregister_buffers();
            }
            return;
        }
        // Only reached when io_uring_enter itself failed with ops in flight. Try to reap them;
        // memory the kernel may still write must never be freed or handed back.
        for _ in 0..1000 {
            if self.ring.submit_and_wait(1).is_err() {
                break;
            }
            let keys: Vec<usize> = self
                .ring
                .completion()
                .map(|c| c.user_data() as usize)
                .collect();
            for key in keys {
                self.in_flight[key] = None;
            }
            if self.in_flight.iter().all(Option::is_none) {
                return;
            }
        }
        for op in self.in_flight.drain(..).flatten() {
            match op.buf {
                // Leak the slot: the pool shrinks by one rather than reusing memory the kernel may touch.
                super::IoBuf::Slot(slot) => std::mem::forget(slot),
                // Caller-owned memory cannot be kept alive from here.
                super::IoBuf::Slice(_) => std::process::abort(),
                // Leak the span, and with it the arena's mapping, for the same reason.
                super::IoBuf::Arena(span) => std::mem::forget(span),
            }
        }
    }
}
