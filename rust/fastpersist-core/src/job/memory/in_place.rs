//! The rest of a job whose arena is its one data file on a memory filesystem
//! ([`Arena::over_file`](crate::arena::Arena::over_file)): staging put every byte into the
//! file's pages already, so nothing is written; the chunks are checksummed from there by the
//! bounded pool of threads that a window's writes use (`arena_writes`). Whether a job is in
//! place is decided where it is made (`from_arena`, `is_in_place`).

use std::ops::Range;

use crate::checksum::crc32c;
use crate::error::{Error, Result};
use crate::job::WriteOptions;
use crate::job::WriteTarget;
use crate::job::arena_writes::{CrcBoard, crc_threads};
use crate::job::from_arena::{ArenaJob, Written};
use crate::job::progress::WriteGate;

impl ArenaJob<'_> {
    /// Stages `windows` (one, holding every cell, or none for an empty part) into the file,
    /// lets the sources go, waits for the write gate of a snapshot, then checksums the file's
    /// chunks and fsyncs it when durable.
    pub(in crate::job) fn write_in_place(
        mut self,
        windows: Vec<Range<usize>>,
        targets: &[WriteTarget],
        options: &WriteOptions,
        gate: Option<&WriteGate>,
    ) -> Result<Written> {
        debug_assert!(windows.len() <= 1, "in place, one window holds every cell");
        for window in &windows {
            self.stage(window.clone())?;
        }
        self.release_sources(); // every byte is in the file: the caller may go on
        self.progress.check_cancelled("while staging")?;
        if let Some(gate) = gate {
            gate.wait(self.progress)?; // a snapshot: checksummed and committed in its turn
        }
        if self.checksum {
            self.checksum_cells()?;
        }
        self.progress.add_written_bytes(targets[0].part.len_bytes);
        if options.durable {
            self.arena.sync_file(&targets[0].path)?;
        }
        self.progress
            .check_cancelled("after its data was written")?;
        Ok((std::mem::take(&mut self.crcs), vec![false]))
    }

    fn checksum_cells(&mut self) -> Result<()> {
        let board = CrcBoard::new(self.cells.len());
        let (arena, cells, cell_bytes) = (&self.arena, &self.cells, self.cell_bytes);
        std::thread::scope(|scope| {
            for _ in 0..crc_threads(cells.len()) {
                scope.spawn(|| {
                    board.work(|k| {
                        // SAFETY: every copy into the file has landed (staged and waited for),
                        // and nothing writes the arena until this job lets go of its lease.
                        crc32c(unsafe {
                            arena.bytes(k * cell_bytes, cells[k].chunk.len_bytes as usize)
                        })
                    });
                });
            }
        });
        for (k, crc) in board.into_values().into_iter().enumerate() {
            let cell = self.cells[k];
            self.crcs[cell.file][cell.chunk_in_file] = crc.ok_or_else(|| {
                Error::Internal("a checksum thread stopped before its chunks were done".into())
            })?;
        }
        Ok(())
    }
}
