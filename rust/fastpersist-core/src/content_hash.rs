//! Content hashes for incremental saves: the XXH3-128 of each chunk's logical bytes (its
//! extents' bytes and the zero padding between them), so that a later save can compare each
//! chunk's hash with the previous save's and skip writing the chunks that did not change.

use xxhash_rust::xxh3::Xxh3Default;

use crate::error::{Error, Result};
use crate::job::SourceRegion;
use crate::job::source::{ExtentMap, Overlap, check_against_plan};
use crate::plan::{self, Plan};

/// Zeros fed to the hasher for the gaps between extents (at most `EXTENT_ALIGN_BYTES - 1`
/// long in a plan from `Plan::new`), so that no gap is ever materialised.
static ZEROS: [u8; 4096] = [0; 4096];

/// The XXH3-128 digest of each chunk of `plan`'s logical stream, in order: chunk `j` is stream
/// bytes `[j * chunk_bytes, min((j + 1) * chunk_bytes, total_bytes))`, each extent's bytes at
/// its offset and zeros between extents, so a digest equals `xxh3_128` of the materialised
/// chunk. `sources` are read on `max(1, threads)` threads, a contiguous run of chunks each;
/// they must stay readable until this returns.
///
/// Errors with [`Error::InvalidArgument`] if the sources do not match the plan's extents, if
/// any is device-resident, or if the plan's extents do not lie in order inside its stream.
pub fn chunk_hashes(plan: &Plan, sources: &[SourceRegion], threads: usize) -> Result<Vec<u128>> {
    check_inputs(plan, sources)?;
    let chunk_count = plan::chunk_count(plan.total_bytes, plan.chunk_bytes) as usize;
    let mut hashes = vec![0u128; chunk_count];
    let extents = ExtentMap::new(plan);
    let runs = threads.clamp(1, chunk_count.max(1));
    let mut rest = hashes.as_mut_slice();
    std::thread::scope(|scope| {
        for (start, end) in plan::chunk_runs(0, plan.total_bytes, plan.chunk_bytes, runs) {
            let run_chunks = plan::chunk_count(end - start, plan.chunk_bytes) as usize;
            let (run_hashes, after) = std::mem::take(&mut rest).split_at_mut(run_chunks);
            rest = after;
            let extents = &extents;
            if rest.is_empty() {
                hash_run(extents, sources, plan, start, run_hashes);
            } else {
                scope.spawn(move || hash_run(extents, sources, plan, start, run_hashes));
            }
        }
    });
    Ok(hashes)
}

/// Checks that `sources` match `plan`'s extents and are in host memory, and that the extents lie
/// in order, without overlaps, inside the stream (what `ExtentMap` and the hashing rely on).
fn check_inputs(plan: &Plan, sources: &[SourceRegion]) -> Result<()> {
    plan::check_chunk_bytes(plan.chunk_bytes)?;
    check_against_plan(plan, sources).map_err(|_| {
        Error::InvalidArgument(format!(
            "chunk_hashes needs one source per plan extent, each of its extent's length \
             ({} sources for {} extents)",
            sources.len(),
            plan.extent_bytes.len()
        ))
    })?;
    if let Some(i) = sources.iter().position(|s| s.device) {
        return Err(Error::InvalidArgument(format!(
            "source {i} is device-resident: chunk_hashes reads host memory"
        )));
    }
    if !extents_in_order(plan) {
        return Err(Error::InvalidArgument(
            "the plan's extents do not lie in order inside its stream".into(),
        ));
    }
    Ok(())
}

fn extents_in_order(plan: &Plan) -> bool {
    let mut end = 0u64;
    plan.extent_offsets.len() == plan.extent_bytes.len()
        && plan
            .extent_offsets
            .iter()
            .zip(&plan.extent_bytes)
            .all(|(&offset, &len)| {
                let in_order = offset >= end
                    && offset
                        .checked_add(len)
                        .is_some_and(|e| e <= plan.total_bytes);
                end = offset.saturating_add(len);
                in_order
            })
}

/// Hashes the chunks from stream byte `start` (chunk-aligned) into `hashes`, one per chunk.
fn hash_run(
    extents: &ExtentMap,
    sources: &[SourceRegion],
    plan: &Plan,
    start: u64,
    hashes: &mut [u128],
) {
    let mut hasher = Xxh3Default::new();
    for (i, hash) in hashes.iter_mut().enumerate() {
        let chunk_start = start + i as u64 * plan.chunk_bytes;
        let chunk_end = (chunk_start + plan.chunk_bytes).min(plan.total_bytes);
        hasher.reset();
        let mut cursor = chunk_start;
        for overlap in extents.overlapping(chunk_start, chunk_end) {
            feed_zeros(&mut hasher, overlap.from - cursor);
            hasher.update(overlap_bytes(sources, &overlap));
            cursor = overlap.to;
        }
        feed_zeros(&mut hasher, chunk_end - cursor);
        *hash = hasher.digest128();
    }
}

fn feed_zeros(hasher: &mut Xxh3Default, mut len_bytes: u64) {
    while len_bytes > 0 {
        let piece = len_bytes.min(ZEROS.len() as u64);
        hasher.update(&ZEROS[..piece as usize]);
        len_bytes -= piece;
    }
}

/// The source bytes of one overlap (never empty, as `ExtentMap::overlapping` gives them).
fn overlap_bytes<'a>(sources: &'a [SourceRegion], overlap: &Overlap) -> &'a [u8] {
    let region = &sources[overlap.index];
    let offset = (overlap.from - overlap.extent_start) as usize;
    let len = (overlap.to - overlap.from) as usize;
    // SAFETY: the region is host memory (device regions are refused in `check_inputs`) readable
    // until `chunk_hashes` returns (SourceRegion::new's contract), and `offset + len <=
    // region.len_bytes` since the overlap lies inside its extent, whose length is the region's
    // (checked in `check_inputs`). A concurrent write by the caller gives a torn hash, as it
    // would torn data in a save.
    unsafe { std::slice::from_raw_parts(region.ptr.add(offset), len) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use xxhash_rust::xxh3::xxh3_128;

    /// The stream materialised: each extent's bytes at its offset, zeros between.
    fn stream_of(plan: &Plan, extents: &[Vec<u8>]) -> Vec<u8> {
        let mut stream = vec![0u8; plan.total_bytes as usize];
        for (bytes, &offset) in extents.iter().zip(&plan.extent_offsets) {
            stream[offset as usize..offset as usize + bytes.len()].copy_from_slice(bytes);
        }
        stream
    }

    fn reference_hashes(plan: &Plan, extents: &[Vec<u8>]) -> Vec<u128> {
        stream_of(plan, extents)
            .chunks(plan.chunk_bytes as usize)
            .map(xxh3_128)
            .collect()
    }

    fn regions(extents: &[Vec<u8>]) -> Vec<SourceRegion> {
        // SAFETY: `extents` outlives every `chunk_hashes` call that gets these regions.
        extents
            .iter()
            .map(|e| unsafe { SourceRegion::from_slice(e) })
            .collect()
    }

    fn extents_of(lens: &[u64], seed: u8) -> Vec<Vec<u8>> {
        lens.iter()
            .enumerate()
            .map(|(i, &len)| {
                (0..len)
                    .map(|b| (b as u8).wrapping_mul(31) ^ (i as u8) ^ seed)
                    .collect()
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn matches_the_materialised_stream(
            lens in prop::collection::vec(
                prop_oneof![Just(0u64), 1u64..200, 1u64..20_000],
                0..8,
            ),
            chunk_pages in 1u64..=2,
            threads in 1usize..=4,
            seed in any::<u8>(),
        ) {
            let plan = Plan::new(&lens, 1, 1, chunk_pages * 4096).unwrap();
            let extents = extents_of(&lens, seed);
            let hashes = chunk_hashes(&plan, &regions(&extents), threads).unwrap();
            prop_assert_eq!(hashes, reference_hashes(&plan, &extents));
        }
    }

    #[test]
    fn one_changed_byte_changes_only_its_chunk() {
        let lens = [5, 3 * 4096, 0, 100, 9000];
        let plan = Plan::new(&lens, 1, 1, 4096).unwrap();
        let mut extents = extents_of(&lens, 7);
        let before = chunk_hashes(&plan, &regions(&extents), 2).unwrap();
        extents[1][5000] ^= 1;
        let after = chunk_hashes(&plan, &regions(&extents), 3).unwrap();
        let changed_chunk = ((plan.extent_offsets[1] + 5000) / 4096) as usize;
        for (j, (b, a)) in before.iter().zip(&after).enumerate() {
            assert_eq!(b != a, j == changed_chunk, "chunk {j}");
        }
    }

    #[test]
    fn empty_stream_has_no_chunks() {
        let plan = Plan::new(&[0, 0], 1, 1, 4096).unwrap();
        assert!(
            chunk_hashes(&plan, &regions(&[vec![], vec![]]), 4)
                .unwrap()
                .is_empty()
        );
        let plan = Plan::new(&[], 1, 1, 4096).unwrap();
        assert!(chunk_hashes(&plan, &[], 0).unwrap().is_empty());
    }

    #[test]
    fn refuses_mismatched_and_device_sources() {
        let plan = Plan::new(&[10, 20], 1, 1, 4096).unwrap();
        let extents = extents_of(&[10, 20], 0);
        let short = regions(&extents[..1]);
        assert!(matches!(
            chunk_hashes(&plan, &short, 1),
            Err(Error::InvalidArgument(_))
        ));
        let wrong_len = regions(&extents_of(&[10, 21], 0));
        assert!(matches!(
            chunk_hashes(&plan, &wrong_len, 1),
            Err(Error::InvalidArgument(_))
        ));
        let mut on_device = regions(&extents);
        on_device[1] = SourceRegion::device(20);
        let err = chunk_hashes(&plan, &on_device, 1).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)));
        assert!(err.to_string().contains("source 1 is device-resident"));
    }
}
