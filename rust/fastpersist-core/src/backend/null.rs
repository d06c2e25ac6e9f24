//! The null sink: a backend that completes every write at once, in full, without a system call.
//!
//! It measures everything a save does except the disk (staging, checksums, the driver loop, the
//! bindings), so a benchmark can tell whether the pipeline or the drive bounds a save. It is
//! never a user's choice: `Config` does not offer it, `FASTPERSIST_BACKEND` refuses it, reads
//! refuse it, and the files it "writes" are left empty (their checksums would not match).

use super::{IoOp, Submitter};
use crate::error::Result;

/// Completes each op in full as soon as it is pushed; `wait` hands them all back.
#[derive(Debug)]
pub(super) struct NullDisk<'a> {
    done: Vec<IoOp<'a>>,
}

impl NullDisk<'_> {
    pub(super) fn new(queue_depth: usize) -> Self {
        NullDisk {
            done: Vec::with_capacity(queue_depth),
        }
    }
}

impl<'a> Submitter<'a> for NullDisk<'a> {
    fn push(&mut self, mut op: IoOp<'a>) -> Result<()> {
        op.done_bytes = op.len_bytes;
        self.done.push(op);
        Ok(())
    }
    fn wait(&mut self, finished: &mut Vec<(IoOp<'a>, Result<()>)>) -> Result<()> {
        finished.extend(self.done.drain(..).map(|op| (op, Ok(()))));
        Ok(())
    }
    fn poll(&mut self, finished: &mut Vec<(IoOp<'a>, Result<()>)>) -> Result<()> {
        self.wait(finished)
    }
}
