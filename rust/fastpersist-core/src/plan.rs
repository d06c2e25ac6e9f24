//! The pure layout step: tensors → one logical byte stream → parts (per writer, then per stripe)
//! → aligned chunks.
//!
//! Every tensor's bytes start at an [`EXTENT_ALIGN_BYTES`]-aligned offset of the stream (gaps are
//! zero). The stream is cut at chunk boundaries: writers get near-equal runs of whole chunks,
//! and each writer's run is cut the same way across its stripe directories. A part is one file
//! holding a contiguous range of the stream, written from file offset 0 in chunk-sized aligned
//! writes; only the final chunk of a part may be short (it is padded for O_DIRECT and the file
//! is truncated to the logical length afterwards).

use crate::DIRECT_ALIGN_BYTES;
use crate::align::round_up_u64;
use crate::error::{Error, Result};

/// Alignment of each tensor inside the logical stream (matches torch's CPU allocator).
pub const EXTENT_ALIGN_BYTES: u64 = 64;

/// Largest chunk (one transfer must fit the kernel's 32-bit length).
pub const MAX_CHUNK_BYTES: u64 = 1 << 30;

/// One file of a checkpoint: a contiguous range of the logical stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    /// Data-parallel writer that writes this part.
    pub writer: usize,
    /// Stripe directory index (within the writer's stripes).
    pub stripe: usize,
    /// First byte of the part in the logical stream.
    pub stream_offset_bytes: u64,
    /// Logical length of the part (the file's final size).
    pub len_bytes: u64,
}

/// One aligned write (or read) of a part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// Offset in the part's file (a multiple of the chunk size).
    pub file_offset_bytes: u64,
    /// Offset in the logical stream.
    pub stream_offset_bytes: u64,
    /// Logical bytes in this chunk (only the last chunk of a part may be shorter).
    pub len_bytes: u64,
}

impl Part {
    /// Chunks of this part, in file order.
    pub fn chunks(&self, chunk_bytes: u64) -> impl Iterator<Item = Chunk> + '_ {
        let count = self.len_bytes.div_ceil(chunk_bytes);
        (0..count).map(move |i| {
            let file_offset_bytes = i * chunk_bytes;
            Chunk {
                file_offset_bytes,
                stream_offset_bytes: self.stream_offset_bytes + file_offset_bytes,
                len_bytes: chunk_bytes.min(self.len_bytes - file_offset_bytes),
            }
        })
    }

    /// Number of chunks.
    pub fn chunk_count(&self, chunk_bytes: u64) -> u64 {
        self.len_bytes.div_ceil(chunk_bytes)
    }
}

/// The layout of one checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Offset of each source extent in the logical stream (same order as the input).
    pub extent_offsets: Vec<u64>,
    /// Length of each source extent.
    pub extent_bytes: Vec<u64>,
    /// Logical stream length (end of the last extent).
    pub total_bytes: u64,
    /// Size of one aligned write.
    pub chunk_bytes: u64,
    /// Non-empty parts, ordered by (writer, stripe).
    pub parts: Vec<Part>,
}

impl Plan {
    /// Lays out `extent_bytes` and splits the stream across `writer_count` writers, each with
    /// `stripe_count` stripe directories.
    pub fn new(
        extent_bytes: &[u64],
        writer_count: usize,
        stripe_count: usize,
        chunk_bytes: u64,
    ) -> Result<Self> {
        if writer_count == 0 || stripe_count == 0 {
            return Err(Error::InvalidArgument(format!(
                "writer_count ({writer_count}) and stripe_count ({stripe_count}) must be at least 1"
            )));
        }
        if chunk_bytes == 0
            || !chunk_bytes.is_multiple_of(DIRECT_ALIGN_BYTES as u64)
            || chunk_bytes > MAX_CHUNK_BYTES
        {
            return Err(Error::InvalidArgument(format!(
                "chunk_bytes ({chunk_bytes}) must be a positive multiple of {DIRECT_ALIGN_BYTES} up to {MAX_CHUNK_BYTES}"
            )));
        }
        let mut extent_offsets = Vec::with_capacity(extent_bytes.len());
        let mut cursor = 0u64;
        for &len in extent_bytes {
            let overflow = || Error::InvalidArgument("total checkpoint size overflows u64".into());
            let start = round_up_u64(
                cursor
                    .checked_add(EXTENT_ALIGN_BYTES)
                    .ok_or_else(overflow)?,
                EXTENT_ALIGN_BYTES,
            ) - EXTENT_ALIGN_BYTES;
            extent_offsets.push(start);
            cursor = start.checked_add(len).ok_or_else(overflow)?;
        }
        let total_bytes = cursor;
        let chunk_total = total_bytes.div_ceil(chunk_bytes);
        let chunk_to_byte = |chunk: u64| (chunk * chunk_bytes).min(total_bytes);
        let mut parts = Vec::new();
        for writer in 0..writer_count {
            let (w_first, w_end) = split(chunk_total, writer_count, writer);
            for stripe in 0..stripe_count {
                let (s_first, s_end) = split(w_end - w_first, stripe_count, stripe);
                let (first, end) = (w_first + s_first, w_first + s_end);
                if first == end {
                    continue;
                }
                let start = chunk_to_byte(first);
                parts.push(Part {
                    writer,
                    stripe,
                    stream_offset_bytes: start,
                    len_bytes: chunk_to_byte(end) - start,
                });
            }
        }
        Ok(Plan {
            extent_offsets,
            extent_bytes: extent_bytes.to_vec(),
            total_bytes,
            chunk_bytes,
            parts,
        })
    }

    /// Parts written by `writer`.
    pub fn parts_of_writer(&self, writer: usize) -> impl Iterator<Item = &Part> {
        self.parts.iter().filter(move |p| p.writer == writer)
    }
}

/// The `index`-th of `count` near-equal runs of `0..total`: `[start, end)`.
fn split(total: u64, count: usize, index: usize) -> (u64, u64) {
    let (count, index) = (count as u128, index as u128);
    let at = |i: u128| ((total as u128 * i) / count) as u64;
    (at(index), at(index + 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const CHUNK: u64 = 4 * 4096;

    fn covered(plan: &Plan) -> Vec<u8> {
        let mut seen = vec![0u8; plan.total_bytes as usize];
        for part in &plan.parts {
            for chunk in part.chunks(plan.chunk_bytes) {
                for b in chunk.stream_offset_bytes..chunk.stream_offset_bytes + chunk.len_bytes {
                    seen[b as usize] += 1;
                }
            }
        }
        seen
    }

    #[test]
    fn empty_state_has_no_parts() {
        let plan = Plan::new(&[], 2, 2, CHUNK).unwrap();
        assert_eq!(plan.total_bytes, 0);
        assert!(plan.parts.is_empty());
        let plan = Plan::new(&[0, 0], 1, 1, CHUNK).unwrap();
        assert!(plan.parts.is_empty());
    }

    #[test]
    fn extents_are_64_aligned() {
        let plan = Plan::new(&[1, 3, 64, 0, 65], 1, 1, CHUNK).unwrap();
        assert_eq!(plan.extent_offsets, vec![0, 64, 128, 192, 192]);
        assert_eq!(plan.total_bytes, 257);
    }

    #[test]
    fn rejects_bad_arguments() {
        assert!(Plan::new(&[1], 0, 1, CHUNK).is_err());
        assert!(Plan::new(&[1], 1, 0, CHUNK).is_err());
        assert!(Plan::new(&[1], 1, 1, 1000).is_err());
        assert!(Plan::new(&[u64::MAX, 1], 1, 1, CHUNK).is_err());
    }

    proptest! {
        #[test]
        fn covers_every_byte_once_aligned_and_balanced(
            extents in proptest::collection::vec(0u64..100_000, 0..40),
            writers in 1usize..6,
            stripes in 1usize..5,
            chunk_pages in 1u64..5,
        ) {
            let chunk = chunk_pages * 4096;
            let plan = Plan::new(&extents, writers, stripes, chunk).unwrap();
            // Every byte of the stream belongs to exactly one chunk of one part.
            prop_assert!(covered(&plan).iter().all(|&n| n == 1));
            // Extents are aligned, in order, non-overlapping and inside the stream.
            let mut end = 0;
            for (off, len) in plan.extent_offsets.iter().zip(&extents) {
                prop_assert_eq!(off % EXTENT_ALIGN_BYTES, 0);
                prop_assert!(*off >= end);
                end = off + len;
            }
            prop_assert_eq!(end, plan.total_bytes);
            // Every write is aligned; only a part's last chunk may be short.
            for part in &plan.parts {
                prop_assert_eq!(part.stream_offset_bytes % chunk, 0);
                let chunks: Vec<_> = part.chunks(chunk).collect();
                for (i, c) in chunks.iter().enumerate() {
                    prop_assert_eq!(c.file_offset_bytes % 4096, 0);
                    if i + 1 < chunks.len() { prop_assert_eq!(c.len_bytes, chunk); }
                }
            }
            // Writers get within one chunk of each other.
            let per_writer: Vec<u64> = (0..writers)
                .map(|w| plan.parts_of_writer(w).map(|p| p.chunk_count(chunk)).sum())
                .collect();
            let (lo, hi) = (per_writer.iter().min().unwrap(), per_writer.iter().max().unwrap());
            prop_assert!(hi - lo <= 1);
        }
    }
}
