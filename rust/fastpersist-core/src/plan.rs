//! The pure layout step: tensors → one logical byte stream → parts (per writer, then per stripe)
//! → aligned chunks.
//!
//! Every tensor's bytes start at an [`EXTENT_ALIGN_BYTES`]-aligned offset of the stream (gaps are
//! zero). The stream is cut at chunk boundaries: writers get near-equal runs of whole chunks,
//! and each writer's run is cut the same way across its stripe directories. A part is one file
//! holding a contiguous range of the stream, written from file offset 0 in chunk-sized aligned
//! writes; only the final chunk of a part may be short (it is padded for O_DIRECT and the file
//! is truncated to the logical length afterwards).
//!
//! The chunk rule lives here once: [`check_chunk_bytes`] (what a chunk size may be),
//! [`chunk_count`] and [`chunk_spans`] (how a range is cut into chunks, for writes and reads
//! alike) and [`chunk_runs`] (how whole chunks are shared out). The bindings export them, so
//! the Python side derives nothing itself.

use crate::DIRECT_ALIGN_BYTES;
use crate::error::{Error, Result};
use crate::round_up_u64;

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
        chunk_spans(self.len_bytes, chunk_bytes).map(move |span| Chunk {
            file_offset_bytes: span.offset_bytes,
            stream_offset_bytes: self.stream_offset_bytes + span.offset_bytes,
            len_bytes: span.len_bytes,
        })
    }
}

/// One chunk of a range, relative to the range's first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkSpan {
    /// Offset from the start of the range (a multiple of the chunk size).
    pub offset_bytes: u64,
    /// Bytes of the chunk (only the last chunk of a range may be shorter).
    pub len_bytes: u64,
}

/// Checks that `chunk_bytes` is a chunk size the engine can write and read: a positive
/// multiple of [`DIRECT_ALIGN_BYTES`] up to [`MAX_CHUNK_BYTES`].
pub fn check_chunk_bytes(chunk_bytes: u64) -> Result<()> {
    if chunk_bytes == 0
        || !chunk_bytes.is_multiple_of(DIRECT_ALIGN_BYTES as u64)
        || chunk_bytes > MAX_CHUNK_BYTES
    {
        return Err(Error::InvalidArgument(format!(
            "chunk_bytes ({chunk_bytes}) must be a positive multiple of {DIRECT_ALIGN_BYTES} up to {MAX_CHUNK_BYTES}"
        )));
    }
    Ok(())
}

/// Number of chunks of `chunk_bytes` that a range of `len_bytes` is cut into.
pub fn chunk_count(len_bytes: u64, chunk_bytes: u64) -> u64 {
    len_bytes.div_ceil(chunk_bytes)
}

/// The chunks of a range of `len_bytes`, in order: every one `chunk_bytes` long but the last.
pub fn chunk_spans(len_bytes: u64, chunk_bytes: u64) -> impl Iterator<Item = ChunkSpan> {
    (0..chunk_count(len_bytes, chunk_bytes)).map(move |i| {
        let offset_bytes = i * chunk_bytes;
        ChunkSpan {
            offset_bytes,
            len_bytes: chunk_bytes.min(len_bytes - offset_bytes),
        }
    })
}

/// Bytes `[start_bytes, end_bytes)` (`start_bytes` chunk-aligned) cut into `count` near-equal
/// runs of whole chunks, `[start, end)` each, in order; a run is empty when there are fewer
/// chunks than runs. Writers, their stripes and the ranks of a group load share chunks so.
pub fn chunk_runs(
    start_bytes: u64,
    end_bytes: u64,
    chunk_bytes: u64,
    count: usize,
) -> impl Iterator<Item = (u64, u64)> {
    let len_bytes = end_bytes - start_bytes;
    let chunks = u128::from(chunk_count(len_bytes, chunk_bytes));
    let at = move |i: usize| {
        let first_chunk = (chunks * i as u128 / count as u128) as u64;
        start_bytes + (first_chunk * chunk_bytes).min(len_bytes)
    };
    (0..count).map(move |i| (at(i), at(i + 1)))
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
        check_chunk_bytes(chunk_bytes)?;
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
        let mut parts = Vec::new();
        for (writer, (w_start, w_end)) in
            chunk_runs(0, total_bytes, chunk_bytes, writer_count).enumerate()
        {
            for (stripe, (start, end)) in
                chunk_runs(w_start, w_end, chunk_bytes, stripe_count).enumerate()
            {
                if start < end {
                    parts.push(Part {
                        writer,
                        stripe,
                        stream_offset_bytes: start,
                        len_bytes: end - start,
                    });
                }
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

    #[test]
    fn chunk_sizes_are_checked_in_one_place() {
        assert!(check_chunk_bytes(4096).is_ok());
        assert!(check_chunk_bytes(MAX_CHUNK_BYTES).is_ok());
        for bad in [0, 1000, 4096 + 512, MAX_CHUNK_BYTES + 4096] {
            let message = check_chunk_bytes(bad).unwrap_err().to_string();
            assert!(
                message.contains(&format!("chunk_bytes ({bad})")),
                "{message}"
            );
        }
    }

    #[test]
    fn spans_cut_a_range_into_whole_chunks_and_a_short_tail() {
        let spans: Vec<_> = chunk_spans(10_000, 4096)
            .map(|s| (s.offset_bytes, s.len_bytes))
            .collect();
        assert_eq!(spans, vec![(0, 4096), (4096, 4096), (8192, 1808)]);
        assert_eq!(chunk_count(10_000, 4096), 3);
        assert_eq!(chunk_spans(0, 4096).count(), 0);
    }

    proptest! {
        #[test]
        fn runs_share_whole_chunks_contiguously_and_evenly(
            first_chunk in 0u64..50,
            len_bytes in 0u64..200_000,
            count in 1usize..9,
        ) {
            let start = first_chunk * CHUNK;
            let end = start + len_bytes;
            let runs: Vec<_> = chunk_runs(start, end, CHUNK, count).collect();
            prop_assert_eq!(runs.len(), count);
            prop_assert_eq!(runs[0].0, start);
            prop_assert_eq!(runs[count - 1].1, end);
            for pair in runs.windows(2) {
                prop_assert_eq!(pair[0].1, pair[1].0);
            }
            let sizes: Vec<u64> = runs.iter().map(|(a, b)| chunk_count(b - a, CHUNK)).collect();
            prop_assert_eq!(sizes.iter().sum::<u64>(), chunk_count(len_bytes, CHUNK));
            prop_assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
            for (a, b) in &runs {
                prop_assert!(*a % CHUNK == 0 && (*b % CHUNK == 0 || *b == end));
            }
        }

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
                .map(|w| plan.parts_of_writer(w).map(|p| chunk_count(p.len_bytes, chunk)).sum())
                .collect();
            let (lo, hi) = (per_writer.iter().min().unwrap(), per_writer.iter().max().unwrap());
            prop_assert!(hi - lo <= 1);
        }
    }
}
