//! fastpersist-core: the Python-free engine behind `fastpersist`.
//!
//! * [`plan`] lays tensors into one logical byte stream and cuts it into aligned parts and chunks.
//! * [`pool`] owns the page-aligned staging memory (its allocator `unsafe` is in [`align`]);
//!   [`arena`] is the staging memory of device saves, written from in place;
//!   [`pages`] maps the memory a load reads into and returns it to the OS piece by piece.
//! * [`backend`] moves chunks between memory and files: io_uring, or a thread pool of
//!   `pwrite`/`pread` where io_uring is blocked.
//! * [`job`] stages source bytes into the pool (checksumming while the bytes are hot) and drives
//!   a backend; [`read`] is the mirror for loads.
//! * [`durable`] holds fsync / rename helpers; [`probe`] decides which backend and whether
//!   O_DIRECT can be used.

#![warn(missing_docs)]

pub mod align;
pub mod arena;
pub mod backend;
pub mod checksum;
pub mod durable;
pub mod error;
pub mod job;
pub mod pages;
pub mod plan;
pub mod pool;
pub mod probe;
pub mod read;

pub use error::{Error, Result};

/// Alignment of file offsets, lengths and buffer addresses for O_DIRECT.
pub const DIRECT_ALIGN_BYTES: usize = 4096;
