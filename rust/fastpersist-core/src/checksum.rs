//! Checksums with runtime SIMD dispatch: crc32c (Castagnoli, as used by iSCSI and ext4) for our
//! own chunks, and CRC-32 (IEEE 802.3, the one zip and gzip use) for the records of zip archives.

use std::path::Path;

use crc_fast::{CrcAlgorithm, Digest};

use crate::error::{Error, Result};

/// Incremental crc32c.
#[derive(Clone)]
pub struct Crc32c(Digest);

impl std::fmt::Debug for Crc32c {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Crc32c")
    }
}

impl Default for Crc32c {
    fn default() -> Self {
        Crc32c(Digest::new(CrcAlgorithm::Crc32Iscsi))
    }
}

impl Crc32c {
    /// Feeds more bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The checksum of everything fed so far.
    pub fn finish(&self) -> u32 {
        self.0.finalize() as u32
    }
}

/// crc32c of `bytes` in one call.
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc_fast::checksum(CrcAlgorithm::Crc32Iscsi, bytes) as u32
}

/// Checks `bytes`, which lie at `offset_bytes` (a multiple of `chunk_bytes`) of the file `path`,
/// chunk by chunk against `expected`, the recorded crc32c of every chunk of that file: the one
/// check of bytes that arrived from elsewhere (a download, a store's piece) before they count.
/// The first chunk that differs is `Error::ChecksumMismatch`, naming `path` and its offsets.
pub fn check_chunks(
    path: &Path,
    bytes: &[u8],
    offset_bytes: u64,
    chunk_bytes: u64,
    expected: &[u32],
) -> Result<()> {
    if chunk_bytes == 0 || !offset_bytes.is_multiple_of(chunk_bytes) {
        return Err(Error::InvalidArgument(format!(
            "{}: offset {offset_bytes} is not a multiple of the chunk size {chunk_bytes}",
            path.display()
        )));
    }
    let first = offset_bytes / chunk_bytes;
    let mut at = offset_bytes;
    for (i, piece) in bytes.chunks(chunk_bytes as usize).enumerate() {
        let index = first + i as u64;
        let Some(&want) = usize::try_from(index).ok().and_then(|k| expected.get(k)) else {
            return Err(Error::InvalidArgument(format!(
                "{}: bytes [{at}, {}) run past the {} chunks the manifest records",
                path.display(),
                at + piece.len() as u64,
                expected.len()
            )));
        };
        let found = crc32c(piece);
        if found != want {
            return Err(Error::ChecksumMismatch {
                path: path.to_path_buf(),
                offset_bytes: at,
                len_bytes: piece.len() as u64,
                expected: want,
                found,
            });
        }
        at += piece.len() as u64;
    }
    Ok(())
}

/// crc32c of `a` followed by `b`, from `crc32c(a)`, `crc32c(b)` and `b`'s length: how the
/// checksums of a chunk's shares, staged by several threads, become the chunk's.
pub fn crc32c_combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    crc_fast::checksum_combine(
        CrcAlgorithm::Crc32Iscsi,
        u64::from(crc_a),
        u64::from(crc_b),
        len_b,
    ) as u32
}

/// Incremental CRC-32 (IEEE 802.3, reflected, as in zip's local headers and central directory).
#[derive(Clone)]
pub struct Crc32(Digest);

impl std::fmt::Debug for Crc32 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Crc32")
    }
}

impl Default for Crc32 {
    fn default() -> Self {
        Crc32(Digest::new(CrcAlgorithm::Crc32IsoHdlc))
    }
}

impl Crc32 {
    /// Feeds more bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The checksum of everything fed so far.
    pub fn finish(&self) -> u32 {
        self.0.finalize() as u32
    }
}

/// CRC-32 (IEEE) of `bytes` in one call: what `zlib.crc32` returns.
pub fn crc32(bytes: &[u8]) -> u32 {
    crc_fast::checksum(CrcAlgorithm::Crc32IsoHdlc, bytes) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vectors() {
        // RFC 3720 B.4 test vectors for CRC32C.
        assert_eq!(crc32c(b""), 0);
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
    }

    #[test]
    fn combined_shares_match_the_whole() {
        let bytes: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        for cut in [0, 1, 4096, 65_537, 99_999, 100_000] {
            let (a, b) = bytes.split_at(cut);
            assert_eq!(
                crc32c_combine(crc32c(a), crc32c(b), b.len() as u64),
                crc32c(&bytes)
            );
        }
    }

    #[test]
    fn check_chunks_names_the_first_chunk_that_differs() {
        let path = Path::new("store/step-3/data-w0-s0.bin");
        let file: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let crcs: Vec<u32> = file.chunks(4096).map(crc32c).collect();
        assert!(check_chunks(path, &file, 0, 4096, &crcs).is_ok());
        assert!(check_chunks(path, &file[4096..], 4096, 4096, &crcs).is_ok());
        let mut bad = file[4096..].to_vec();
        bad[5000] ^= 1; // inside the file's last chunk, [8192, 10000)
        match check_chunks(path, &bad, 4096, 4096, &crcs) {
            Err(Error::ChecksumMismatch {
                offset_bytes,
                len_bytes,
                expected,
                ..
            }) => assert_eq!((offset_bytes, len_bytes, expected), (8192, 1808, crcs[2])),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            check_chunks(path, &file, 100, 4096, &crcs),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            check_chunks(path, &file[8192..], 12288, 4096, &crcs),
            Err(Error::InvalidArgument(_))
        ));
        assert!(check_chunks(path, &[], 12288, 4096, &crcs).is_ok());
    }

    #[test]
    fn incremental_matches_one_shot() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut crc = Crc32c::default();
        for piece in data.chunks(4097) {
            crc.update(piece);
        }
        assert_eq!(crc.finish(), crc32c(&data));
    }

    #[test]
    fn crc32_ieee_known_vectors() {
        // The check value of CRC-32/ISO-HDLC, and values zlib.crc32 gives.
        assert_eq!(crc32(b""), 0);
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(&[0u8; 32]), 0x190A_55AD);
        assert_eq!(
            crc32(b"The quick brown fox jumps over the lazy dog"),
            0x414F_A339
        );
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 13 % 251) as u8).collect();
        let mut crc = Crc32::default();
        for piece in data.chunks(4097) {
            crc.update(piece);
        }
        assert_eq!(crc.finish(), crc32(&data));
    }
}
