//! fastpersist-core: the Python-free engine behind `fastpersist`.
//!
//! * [`plan`] lays tensors into one logical byte stream and cuts it into aligned parts and chunks.
//! * [`pool`] owns the page-aligned staging memory (its allocator `unsafe` is in [`align`]);
//!   [`arena`] is the staging memory of device saves, written from in place;
//!   [`pages`] maps the memory a load reads into and returns it to the OS piece by piece.
//! * [`backend`] moves chunks between memory and files: io_uring, or a thread pool of
//!   `pwrite`/`pread` where io_uring is blocked.
//! * [`job`] stages source bytes into the pool (checksumming while the bytes are hot) and drives
//!   a backend; [`read`] is the mirror for loads; [`part_file`] writes a part file from bytes
//!   that arrive from elsewhere (a level's copy, a download, a peer's share), checked as they pass.
//! * [`content_hash`] gives the XXH3-128 of each chunk's logical bytes, for incremental saves.
//! * [`durable`] holds fsync / rename helpers; [`probe`] decides which backend and whether
//!   O_DIRECT can be used.

#![warn(missing_docs)]

pub mod align;
pub mod arena;
pub mod backend;
pub mod checksum;
pub mod content_hash;
pub mod durable;
pub mod error;
pub mod job;
pub mod pages;
pub mod part_file;
pub mod plan;
pub mod pool;
pub mod probe;
pub mod read;

pub use error::{Error, Result};

/// Alignment of file offsets, lengths and buffer addresses for O_DIRECT.
pub const DIRECT_ALIGN_BYTES: usize = 4096;

/// Rounds `value` up to a multiple of `align` (a power of two).
pub fn round_up(value: usize, align: usize) -> usize {
    debug_assert!(align.is_power_of_two());
    (value + align - 1) & !(align - 1)
}

/// `round_up` for file offsets.
pub fn round_up_u64(value: u64, align: u64) -> u64 {
    debug_assert!(align.is_power_of_two());
    (value + align - 1) & !(align - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding() {
        assert_eq!(round_up(0, 4096), 0);
        assert_eq!(round_up(1, 4096), 4096);
        assert_eq!(round_up(4096, 4096), 4096);
        assert_eq!(round_up_u64(4097, 64), 4160);
    }
}
