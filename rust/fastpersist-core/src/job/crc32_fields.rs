//! CRC-32 fields of the stream filled in while it is staged: the zip archive `torch.save`
//! writes records the CRC-32 (IEEE) of each record's bytes in the record's data descriptor
//! (right after the bytes) and in its central-directory entry (at the end of the archive).
//! A job given [`Crc32Field`]s hashes each field's range as its bytes pass through staging,
//! next to the chunk crc32c, and writes the CRC (little-endian) at every place the field names
//! once the range is complete, so the file is written once, already patched.
//!
//! This needs the stream staged in order (one file, or parts staged one after the other), and
//! every place to write after the end of its range: [`Crc32Patcher::new`] checks both.

use crate::checksum::Crc32;
use crate::error::{Error, Result};

/// Bytes a CRC-32 field occupies (little-endian `u32`).
pub const CRC32_FIELD_BYTES: u64 = 4;

/// A range of the logical stream whose CRC-32 (IEEE) is written at `write_at_bytes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Crc32Field {
    /// First byte of the range in the stream.
    pub start_bytes: u64,
    /// Length of the range.
    pub len_bytes: u64,
    /// Stream offsets where the 4-byte CRC goes; each at or after the range's end.
    pub write_at_bytes: Vec<u64>,
}

/// The running state of the fields while a job stages its stream in order.
#[derive(Debug)]
pub(super) struct Crc32Patcher {
    fields: Vec<Crc32Field>,
    digests: Vec<Crc32>,
    /// The CRC of each field once its range has been staged whole.
    values: Vec<Option<u32>>,
    /// (stream offset, field index), sorted by offset.
    writes: Vec<(u64, usize)>,
    /// The first field whose range is not yet complete.
    next_field: usize,
    /// The first write not yet complete.
    next_write: usize,
    /// The stream offset the next staged piece must start at.
    next_bytes: u64,
}

impl Crc32Patcher {
    /// Checks `fields` against a stream of `total_bytes`: ranges sorted and disjoint, every
    /// write inside the stream, after its range, disjoint from other writes and from all ranges.
    pub fn new(fields: Vec<Crc32Field>, total_bytes: u64) -> Result<Self> {
        let bad = |what: String| Err(Error::InvalidArgument(format!("crc32 fields: {what}")));
        let mut end_of_previous = 0;
        for (i, f) in fields.iter().enumerate() {
            let end = f.start_bytes.saturating_add(f.len_bytes);
            if f.start_bytes < end_of_previous || end > total_bytes {
                return bad(format!(
                    "field {i}'s range [{}, {end}) overlaps the previous one or ends past the stream ({total_bytes} bytes)",
                    f.start_bytes
                ));
            }
            end_of_previous = end;
        }
        let mut writes: Vec<(u64, usize)> = fields
            .iter()
            .enumerate()
            .flat_map(|(i, f)| f.write_at_bytes.iter().map(move |&at| (at, i)))
            .collect();
        writes.sort_unstable();
        let mut end_of_previous = 0;
        for &(at, i) in &writes {
            let f = &fields[i];
            let end = at.saturating_add(CRC32_FIELD_BYTES);
            if at < f.start_bytes + f.len_bytes || at < end_of_previous || end > total_bytes {
                return bad(format!(
                    "field {i}'s CRC at {at} comes before its range ends ({}), overlaps another CRC, or ends past the stream",
                    f.start_bytes + f.len_bytes
                ));
            }
            // Ranges are sorted: the last range starting before `end` is the only one that can overlap.
            let last = fields.partition_point(|g| g.start_bytes < end);
            if last > 0 && fields[last - 1].start_bytes + fields[last - 1].len_bytes > at {
                return bad(format!(
                    "field {i}'s CRC at {at} lies inside field {}'s range",
                    last - 1
                ));
            }
            end_of_previous = end;
        }
        Ok(Crc32Patcher {
            digests: vec![Crc32::default(); fields.len()],
            values: vec![None; fields.len()],
            fields,
            writes,
            next_field: 0,
            next_write: 0,
            next_bytes: 0,
        })
    }

    /// Takes in staged stream bytes `[start, start + piece.len())` (the pieces of the stream in
    /// order, gaps allowed): hashes what lies in the fields' ranges, then writes each finished
    /// CRC where it goes inside the piece.
    pub fn apply(&mut self, piece: &mut [u8], start: u64) -> Result<()> {
        if start < self.next_bytes {
            return Err(Error::Internal(format!(
                "crc32 fields: staged byte {start} after byte {} (the stream must be staged in order)",
                self.next_bytes
            )));
        }
        let end = start + piece.len() as u64;
        self.next_bytes = end;
        while let Some(f) = self.fields.get(self.next_field) {
            let f_end = f.start_bytes + f.len_bytes;
            if f.start_bytes >= end && f.len_bytes > 0 {
                break;
            }
            let (from, to) = (f.start_bytes.max(start), f_end.min(end));
            if from < to {
                self.digests[self.next_field]
                    .update(&piece[(from - start) as usize..(to - start) as usize]);
            }
            if f_end > end {
                break;
            }
            self.values[self.next_field] = Some(self.digests[self.next_field].finish());
            self.next_field += 1;
        }
        while let Some(&(at, field)) = self.writes.get(self.next_write) {
            if at >= end {
                break;
            }
            let Some(value) = self.values[field] else {
                return Err(Error::Internal(format!(
                    "crc32 fields: field {field}'s CRC is due at {at} before its range was staged"
                )));
            };
            for (k, byte) in value.to_le_bytes().into_iter().enumerate() {
                let pos = at + k as u64;
                if (start..end).contains(&pos) {
                    piece[(pos - start) as usize] = byte;
                }
            }
            if at + CRC32_FIELD_BYTES > end {
                break; // the rest of this CRC lies in the next piece
            }
            self.next_write += 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checksum::crc32;
    use proptest::prelude::*;

    fn field(start_bytes: u64, len_bytes: u64, at: &[u64]) -> Crc32Field {
        Crc32Field {
            start_bytes,
            len_bytes,
            write_at_bytes: at.to_vec(),
        }
    }

    /// Runs `fields` over `stream` cut into pieces of `piece_bytes`; returns the patched stream.
    fn run(stream: &[u8], fields: Vec<Crc32Field>, piece_bytes: usize) -> Vec<u8> {
        let mut out = stream.to_vec();
        let mut patcher = Crc32Patcher::new(fields, out.len() as u64).unwrap();
        for (i, piece) in out.chunks_mut(piece_bytes).enumerate() {
            patcher.apply(piece, (i * piece_bytes) as u64).unwrap();
        }
        out
    }

    #[test]
    fn writes_each_crc_after_its_range_at_any_piece_size() {
        let stream: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 253) as u8).collect();
        let fields = vec![
            field(10, 100, &[110, 990]),
            field(114, 0, &[]),
            field(200, 300, &[500, 600]),
        ];
        let mut expected = stream.clone();
        for (range, at) in [(10..110, [110, 990]), (200..500, [500, 600])] {
            let crc = crc32(&stream[range]).to_le_bytes();
            for a in at {
                expected[a..a + 4].copy_from_slice(&crc);
            }
        }
        for piece_bytes in [1, 3, 4, 7, 64, 111, 1000] {
            assert_eq!(
                run(&stream, fields.clone(), piece_bytes),
                expected,
                "pieces of {piece_bytes}"
            );
        }
    }

    #[test]
    fn refuses_fields_it_cannot_fill_in_one_pass() {
        let cases = [
            vec![field(10, 10, &[15])],                       // inside its own range
            vec![field(10, 10, &[5])],                        // before its range
            vec![field(10, 10, &[20]), field(30, 5, &[22])],  // CRCs overlap
            vec![field(10, 10, &[25]), field(24, 8, &[40])],  // CRC inside another range
            vec![field(10, 10, &[20]), field(15, 10, &[30])], // ranges overlap
            vec![field(10, 10, &[98])],                       // past the stream
        ];
        for fields in cases {
            let err = Crc32Patcher::new(fields.clone(), 100).unwrap_err();
            assert!(
                matches!(err, Error::InvalidArgument(_)),
                "{fields:?}: {err}"
            );
        }
    }

    #[test]
    fn pieces_out_of_order_are_an_error() {
        let mut patcher = Crc32Patcher::new(vec![field(0, 8, &[8])], 16).unwrap();
        let mut piece = [0u8; 8];
        patcher.apply(&mut piece, 8).unwrap();
        assert!(matches!(
            patcher.apply(&mut piece, 0),
            Err(Error::Internal(_))
        ));
    }

    proptest! {
        #[test]
        fn every_crc_matches_its_range(
            lens in proptest::collection::vec((0u64..300, 4u64..40), 1..12),
            piece_bytes in 1usize..500,
            seed in any::<u8>(),
        ) {
            // Back to back: [gap][range][4-byte CRC][gap]... with the CRC right after its range.
            let mut fields = Vec::new();
            let mut cursor = 0;
            for (len, gap) in &lens {
                fields.push(field(cursor + gap, *len, &[cursor + gap + len]));
                cursor += gap + len + CRC32_FIELD_BYTES;
            }
            let stream: Vec<u8> = (0..cursor).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect();
            let out = run(&stream, fields.clone(), piece_bytes);
            for f in &fields {
                let (s, e) = (f.start_bytes as usize, (f.start_bytes + f.len_bytes) as usize);
                let at = f.write_at_bytes[0] as usize;
                prop_assert_eq!(&out[at..at + 4], &crc32(&stream[s..e]).to_le_bytes());
                prop_assert_eq!(&out[s..e], &stream[s..e]);
            }
        }
    }
}
