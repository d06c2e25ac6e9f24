//! The fallback backend: a pool of threads doing blocking `pwrite`/`pread`, fed through a
//! bounded queue. Each worker finishes its op completely (short transfers are looped).

use std::os::unix::fs::FileExt;
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex};

use super::{Direction, IoOp, OpenFile, Progress, Submitter, advance};
use crate::error::{Error, Result};

type Finished<'a> = (IoOp<'a>, Result<()>);

pub(super) struct ThreadWorkers<'a> {
    ops: Option<SyncSender<IoOp<'a>>>,
    finished: Receiver<Finished<'a>>,
}

/// Starts `queue_depth` workers (at most 32) for the duration of `body`.
pub(super) fn with_workers<'a, R>(
    direction: Direction,
    files: &[OpenFile],
    queue_depth: usize,
    body: impl FnOnce(&mut ThreadWorkers<'a>) -> R,
) -> R {
    std::thread::scope(|scope| {
        let (op_tx, op_rx) = mpsc::sync_channel::<IoOp<'a>>(queue_depth);
        let op_rx = Arc::new(Mutex::new(op_rx));
        let (done_tx, done_rx) = mpsc::channel::<Finished<'a>>();
        for _ in 0..queue_depth.min(32) {
            let (op_rx, done_tx): (_, Sender<Finished<'a>>) = (Arc::clone(&op_rx), done_tx.clone());
            std::thread::Builder::new()
                .name("fastpersist-io".into())
                .spawn_scoped(scope, move || {
                    loop {
                        let next = op_rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                        let Ok(mut op) = next else { break };
                        let result = transfer(direction, &files[op.file], &mut op);
                        if done_tx.send((op, result)).is_err() {
                            break;
                        }
                    }
                })
                .expect("spawn I/O worker thread");
        }
        drop(done_tx);
        let mut workers = ThreadWorkers {
            ops: Some(op_tx),
            finished: done_rx,
        };
        let result = body(&mut workers);
        // Closing the queue lets the workers exit; the scope joins them.
        workers.ops = None;
        result
    })
}

fn transfer(direction: Direction, file: &OpenFile, op: &mut IoOp<'_>) -> Result<()> {
    loop {
        let offset = op.offset_bytes + op.done_bytes as u64;
        let range = op.done_bytes..op.len_bytes;
        let outcome = match direction {
            Direction::Write => file.file.write_at(&op.buf.bytes()[range], offset),
            Direction::Read => file.file.read_at(&mut op.buf.bytes_mut()[range], offset),
        };
        let transferred = match outcome {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                let op_name = if direction == Direction::Write {
                    "write"
                } else {
                    "read"
                };
                return Err(Error::io(op_name, &file.path, e));
            }
        };
        if let Progress::Complete = advance(op, direction, transferred, file)? {
            return Ok(());
        }
    }
}

impl<'a> Submitter<'a> for ThreadWorkers<'a> {
    fn push(&mut self, op: IoOp<'a>) -> Result<()> {
        let queue = self.ops.as_ref().expect("queue open while driving");
        queue
            .send(op)
            .map_err(|_| Error::Internal("I/O workers exited early".into()))
    }

    fn wait(&mut self, finished: &mut Vec<Finished<'a>>) -> Result<()> {
        let first = self
            .finished
            .recv()
            .map_err(|_| Error::Internal("I/O workers exited early".into()))?;
        finished.push(first);
        finished.extend(self.finished.try_iter());
        Ok(())
    }

    fn poll(&mut self, finished: &mut Vec<Finished<'a>>) -> Result<()> {
        finished.extend(self.finished.try_iter());
        Ok(())
    }
}
