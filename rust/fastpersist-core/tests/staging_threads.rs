//! Host staging on several threads: each chunk shared among them, the same bytes and checksums.

mod common;

use common::{expected_stream, pseudo_random};
use fastpersist_core::job::{JobProgress, WriteOptions, WriteTarget, write_parts};
use fastpersist_core::plan::Plan;
use fastpersist_core::pool::Pool;
use fastpersist_core::probe::DirectMode;

#[test]
fn chunks_staged_by_several_threads_are_the_bytes_and_checksums_of_one() {
    // Chunks of 8 MiB shared among 1, 2 and 3 threads (shares of 4 and ~2.7 MiB, across
    // extent boundaries and gaps), on a pool too small for the stream (slots reused while
    // writes drain): every file and every chunk crc32c equal the one thread's.
    const BIG_CHUNK: u64 = 8 << 20;
    let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut data: Vec<Vec<u8>> = [5 << 20, 3, 13 << 20, 100]
        .iter()
        .enumerate()
        .map(|(i, &n)| pseudo_random(n, i as u64 + 11))
        .collect();
    let lens: Vec<u64> = data.iter().map(|d| d.len() as u64).collect();
    let plan = Plan::new(&lens, 1, 1, BIG_CHUNK).unwrap();
    let pool = Pool::new(BIG_CHUNK as usize, 2 * BIG_CHUNK as usize);
    let written: Vec<(Vec<u32>, Vec<u8>)> = [1, 2, 3]
        .into_iter()
        .map(|threads| {
            let options = WriteOptions {
                direct: DirectMode::Auto,
                staging_threads: threads,
                ..common::options()
            };
            let path = root.path().join(format!("threads{threads}.bin"));
            let targets = [WriteTarget {
                part: plan.parts[0],
                path: path.clone(),
            }];
            let sources = common::regions(&mut data);
            let progress = JobProgress::default();
            let report = write_parts(&plan, &targets, sources, &pool, &options, &progress).unwrap();
            assert_eq!(
                progress.staged_bytes(),
                plan.total_bytes,
                "{threads} threads"
            );
            (
                report.parts[0].chunk_crc32c.clone(),
                std::fs::read(path).unwrap(),
            )
        })
        .collect();
    assert_eq!(written[0].1, expected_stream(&plan, &data));
    for (crcs, bytes) in &written[1..] {
        assert_eq!(crcs, &written[0].0);
        assert!(bytes == &written[0].1);
    }
}
