//! A fake device for the arena job's tests: extents in host vectors, copied into the arena by
//! a thread of its own after a delay, as a queued DMA lands later.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use fastpersist_core::arena::Arena;
use fastpersist_core::error::{Error, Result};
use fastpersist_core::job::{CopyPiece, DeviceCopier, JobProgress};

use super::Setup;

/// What a fake device saw: each `copy` call's pieces, with the bytes written to disk so far
/// when it was made, and how many waits.
#[derive(Default)]
pub struct Seen {
    pub calls: Vec<(Vec<CopyPiece>, u64)>,
    pub waits: usize,
}

/// An asynchronous fake device: each `copy` call's pieces are copied by a thread of its own,
/// after a delay, as a queued DMA lands later; `wait` joins it. A job that read, checksummed
/// or wrote arena bytes before waiting would see stale ones.
pub struct ThreadDevice {
    memory: Arc<Vec<Vec<u8>>>,
    arena: Arena,
    in_flight: Vec<JoinHandle<()>>,
    pub progress: Arc<JobProgress>,
    pub seen: Arc<Mutex<Seen>>,
    pub fail_wait: bool,
}

impl ThreadDevice {
    pub fn new(memory: Vec<Vec<u8>>, arena: &Arena, progress: &Arc<JobProgress>) -> Self {
        ThreadDevice {
            memory: Arc::new(memory),
            arena: arena.clone(),
            in_flight: Vec::new(),
            progress: Arc::clone(progress),
            seen: Arc::default(),
            fail_wait: false,
        }
    }
}

impl DeviceCopier for ThreadDevice {
    fn copy(&mut self, pieces: &[CopyPiece]) -> Result<()> {
        self.seen
            .lock()
            .unwrap()
            .calls
            .push((pieces.to_vec(), self.progress.written_bytes()));
        let (memory, pieces) = (Arc::clone(&self.memory), pieces.to_vec());
        let arena_base = self.arena.as_ptr() as usize;
        self.in_flight.push(std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            for p in pieces {
                let src =
                    &memory[p.extent][p.extent_offset_bytes as usize..][..p.len_bytes as usize];
                // SAFETY: DeviceCopier's contract: the job leaves these arena bytes alone and
                // keeps the arena until `wait` has returned; the pieces lie inside it.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(
                        (arena_base + p.arena_offset_bytes as usize) as *mut u8,
                        p.len_bytes as usize,
                    )
                };
                dst.copy_from_slice(src);
            }
        }));
        Ok(())
    }

    fn wait(&mut self) -> Result<()> {
        self.seen.lock().unwrap().waits += 1;
        for copy in self.in_flight.drain(..) {
            copy.join().unwrap();
        }
        if self.fail_wait {
            return Err(Error::Cancelled("the fake device failed".into()));
        }
        Ok(())
    }
}

/// The bytes the file of `part` must hold: the extents of `data` laid out by the plan.
pub fn expected_file(s: &Setup, data: &[Vec<u8>], part: usize) -> Vec<u8> {
    let part = &s.targets[part].part;
    let mut bytes = vec![0u8; part.len_bytes as usize];
    for (i, extent) in data.iter().enumerate() {
        let (o, n) = (s.plan.extent_offsets[i], extent.len() as u64);
        let (a, b) = (
            o.max(part.stream_offset_bytes),
            (o + n).min(part.stream_offset_bytes + part.len_bytes),
        );
        if a < b {
            bytes[(a - part.stream_offset_bytes) as usize..(b - part.stream_offset_bytes) as usize]
                .copy_from_slice(&extent[(a - o) as usize..(b - o) as usize]);
        }
    }
    bytes
}

pub fn patterned(sizes: &[usize]) -> Vec<Vec<u8>> {
    sizes
        .iter()
        .enumerate()
        .map(|(e, &n)| (0..n).map(|i| ((i * 7 + e * 31) % 251) as u8).collect())
        .collect()
}

/// Bytes of the extents `device` inside the file of target `part`.
pub fn device_bytes_in(s: &Setup, device: &[usize], part: usize) -> u64 {
    let part = &s.targets[part].part;
    device
        .iter()
        .map(|&i| {
            let (o, n) = (s.plan.extent_offsets[i], s.plan.extent_bytes[i]);
            let (a, b) = (
                o.max(part.stream_offset_bytes),
                (o + n).min(part.stream_offset_bytes + part.len_bytes),
            );
            b.saturating_sub(a)
        })
        .sum()
}
