//! Checksums with runtime SIMD dispatch: crc32c (Castagnoli, as used by iSCSI and ext4) for our
//! own chunks, and CRC-32 (IEEE 802.3, the one zip and gzip use) for the records of zip archives.

use crc_fast::{CrcAlgorithm, Digest};

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
