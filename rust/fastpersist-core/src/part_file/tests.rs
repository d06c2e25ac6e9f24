//! The part-file writer's tests, and the simulated filesystem its writes meet under test.

use super::*;
use crate::checksum::crc32c;
use proptest::prelude::*;

/// A simulated filesystem under the writer: the faults this thread's writes meet.
pub(super) mod faults {
    use std::cell::Cell;
    use std::fs::File;
    use std::os::unix::fs::FileExt;

    use crate::DIRECT_ALIGN_BYTES;

    #[derive(Debug, Clone, Copy, Default)]
    pub struct Faults {
        /// Direct writes fail with EINVAL: O_DIRECT accepted at open, refused at write.
        pub refuse_direct: bool,
        /// Each write takes at most this many bytes (whole pages for a direct write, as a
        /// block device's short write would).
        pub max_write_bytes: Option<usize>,
    }

    thread_local! {
        static FAULTS: Cell<Faults> = Cell::new(Faults::default());
    }

    pub fn set(faults: Faults) {
        FAULTS.with(|c| c.set(faults));
    }

    pub fn write_once(
        file: &File,
        data: &[u8],
        offset: u64,
        direct: bool,
    ) -> std::io::Result<usize> {
        let faults = FAULTS.with(Cell::get);
        if direct && faults.refuse_direct {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        let mut n = faults
            .max_write_bytes
            .map_or(data.len(), |most| most.clamp(1, data.len()));
        if direct && n < data.len() {
            n = (n / DIRECT_ALIGN_BYTES).max(1) * DIRECT_ALIGN_BYTES;
        }
        file.write_at(&data[..n], offset)
    }
}

fn bytes(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 31 % 251) as u8).collect()
}

fn expected(data: &[u8], chunk_bytes: usize) -> Expected {
    Expected {
        chunk_crc32c: data.chunks(chunk_bytes).map(crc32c).collect(),
        chunk_bytes: chunk_bytes as u64,
    }
}

fn write_in_pieces(
    path: &Path,
    data: &[u8],
    cuts: &[usize],
    direct: bool,
) -> Result<PartFileWriter> {
    let mut w = PartFileWriter::create(
        path,
        data.len() as u64,
        expected(data, 64 << 10),
        Create::New,
        direct,
    )?;
    let mut lo = 0;
    for &hi in cuts.iter().chain(std::iter::once(&data.len())) {
        w.append(&data[lo..hi])?;
        lo = hi;
    }
    Ok(w)
}

#[test]
fn pieces_of_any_size_make_the_same_file_direct_or_not() {
    let dir = tempfile::tempdir().unwrap();
    let data = bytes((3 << 20) + 12_345);
    for direct in [true, false] {
        for cuts in [vec![], vec![1, 4096, 70_000, 2 << 20], vec![8192, 1 << 20]] {
            let path = dir.path().join(format!("f-{direct}-{}", cuts.len()));
            write_in_pieces(&path, &data, &cuts, direct)
                .unwrap()
                .finish(true)
                .unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), data);
        }
    }
}

#[test]
fn a_bad_chunk_is_refused_before_its_last_byte_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let data = bytes(300 << 10);
    let mut damaged = data.clone();
    damaged[(128 << 10) + 7] ^= 1; // the third 64 KiB chunk
    let path = dir.path().join("f");
    let mut w = PartFileWriter::create(
        &path,
        data.len() as u64,
        expected(&data, 64 << 10),
        Create::New,
        true,
    )
    .unwrap();
    w.append(&damaged[..100_000]).unwrap();
    let err = w.append(&damaged[100_000..]).expect_err("a damaged chunk");
    match err {
        Error::ChecksumMismatch {
            offset_bytes,
            len_bytes,
            ..
        } => {
            assert_eq!((offset_bytes, len_bytes), (128 << 10, 64 << 10));
        }
        other => panic!("{other}"),
    }
    w.discard().unwrap();
    assert!(!path.exists());
}

#[test]
fn a_short_file_fails_finish_and_a_long_one_fails_append() {
    let dir = tempfile::tempdir().unwrap();
    let data = bytes(10_000);
    let path = dir.path().join("short");
    let mut w =
        PartFileWriter::create(&path, 10_000, Expected::default(), Create::New, true).unwrap();
    w.append(&data[..9_999]).unwrap();
    assert!(matches!(
        w.finish(true),
        Err(Error::SizeMismatch {
            found_bytes: 9_999,
            ..
        })
    ));
    assert!(!path.exists());
    let path = dir.path().join("long");
    let mut w = PartFileWriter::create(&path, 10, Expected::default(), Create::New, false).unwrap();
    assert!(matches!(
        w.append(&data[..11]),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn new_refuses_an_existing_file_or_link_and_replace_truncates() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    std::fs::write(&path, b"old bytes, longer than the new").unwrap();
    assert!(PartFileWriter::create(&path, 3, Expected::default(), Create::New, true).is_err());
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&path, &link).unwrap();
    assert!(PartFileWriter::create(&link, 3, Expected::default(), Create::Replace, true).is_err());
    let mut w =
        PartFileWriter::create(&path, 3, Expected::default(), Create::Replace, true).unwrap();
    w.append(b"new").unwrap();
    w.finish(true).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"new");
}

#[test]
fn checksums_that_do_not_fit_the_length_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let bad = Expected {
        chunk_crc32c: vec![0; 3],
        chunk_bytes: 4096,
    };
    let err = PartFileWriter::create(&dir.path().join("f"), 4096, bad, Create::New, true).err();
    assert!(matches!(err, Some(Error::InvalidArgument(_))));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Whatever the filesystem does to the writes (direct writes refused after the open,
    /// short writes) and however the bytes arrive (pieces of any size, at any address), a
    /// finished file holds exactly the bytes appended.
    #[test]
    fn a_finished_file_holds_its_bytes_whatever_the_writes_meet(
        len in prop_oneof![0usize..70_000, (PART_FILE_BUFFER_BYTES - 5_000)..(2 * PART_FILE_BUFFER_BYTES + 9_000)],
        cut_fractions in proptest::collection::vec(0.0f64..1.0, 0..6),
        misalign in 0usize..2,
        direct in any::<bool>(),
        refuse_direct in any::<bool>(),
        max_write_bytes in proptest::option::of(997usize..(3 << 20)),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        // `misalign`: the pieces lie one byte past a page-aligned start, so none is written in place.
        let backing = AlignedBuf::zeroed(round_up(len + 1, DIRECT_ALIGN_BYTES).max(DIRECT_ALIGN_BYTES));
        let mut source = backing;
        let data = bytes(len);
        source[misalign..misalign + len].copy_from_slice(&data);
        let source = &source[misalign..misalign + len];
        let mut cuts: Vec<usize> = cut_fractions.iter().map(|f| (f * len as f64) as usize).collect();
        cuts.sort_unstable();
        faults::set(faults::Faults { refuse_direct, max_write_bytes });
        let written = write_in_pieces(&path, source, &cuts, direct).and_then(|w| w.finish(true));
        faults::set(faults::Faults::default());
        prop_assert!(written.is_ok(), "{written:?}");
        prop_assert!(std::fs::read(&path).unwrap() == data, "the file differs from its bytes");
    }
}
