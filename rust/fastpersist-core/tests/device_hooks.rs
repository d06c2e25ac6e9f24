//! The job of a device save: its chunks staged into an arena window by window (every device
//! copy of a window asked for in one call, waited for once), written straight from the arena
//! after they are checksummed, the arena reused only once a window's writes have completed.

mod common;

use std::sync::Arc;

use common::device::{ThreadDevice, device_bytes_in, expected_file, patterned};
use common::{CHUNK, options, regions, setup};
use fastpersist_core::arena::Arena;
use fastpersist_core::checksum::crc32c;
use fastpersist_core::job::{Crc32Field, JobHooks, JobProgress, SourceRegion, write_parts_with};
use fastpersist_core::pool::Pool;

#[test]
fn a_state_that_fits_is_copied_in_one_call_one_piece_per_tensor_and_only_this_writers_share() {
    // Host extent 0, device extents 1 and 2; two writers: writer 1 writes the back half.
    let sizes = [100, 3 * CHUNK as usize + 5, 2 * CHUNK as usize];
    for writer in 0..2 {
        let mut s = setup(&sizes, 2, writer);
        let device_memory = patterned(&sizes);
        s.data[0] = device_memory[0].clone();
        let arena = Arena::new(16 * CHUNK as usize).unwrap();
        let progress = Arc::new(JobProgress::default());
        let device = ThreadDevice::new(device_memory.clone(), &arena, &progress);
        let seen = Arc::clone(&device.seen);
        let mut sources = regions(&mut s.data);
        sources[1] = SourceRegion::device(sizes[1]);
        sources[2] = SourceRegion::device(sizes[2]);
        let hooks = JobHooks {
            device: Some(Box::new(device)),
            arena: arena.try_lease(),
            ..JobHooks::default()
        };
        let pool = Pool::new(CHUNK as usize, 2 * CHUNK as usize);
        let report = write_parts_with(
            &s.plan,
            &s.targets,
            sources,
            &pool,
            &options(),
            &progress,
            hooks,
        )
        .unwrap();
        assert!(!arena.is_leased(), "the lease ends with the job");
        let seen = seen.lock().unwrap();
        assert_eq!(seen.calls.len(), 1, "one call for the whole share");
        assert_eq!(seen.waits, 1);
        let pieces = &seen.calls[0].0;
        let part = &s.targets[0].part;
        for piece in pieces {
            let extent_start = s.plan.extent_offsets[piece.extent] + piece.extent_offset_bytes;
            assert_eq!(
                piece.arena_offset_bytes,
                extent_start - part.stream_offset_bytes,
                "the arena mirrors the share's stream: {pieces:?}"
            );
        }
        let extents: Vec<usize> = pieces.iter().map(|p| p.extent).collect();
        let mut unique = extents.clone();
        unique.dedup();
        assert_eq!(extents, unique, "one piece per tensor: {pieces:?}");
        let copied: u64 = pieces.iter().map(|p| p.len_bytes).sum();
        assert_eq!(
            copied,
            device_bytes_in(&s, &[1, 2], 0),
            "writer {writer} copies only its share"
        );
        let expected = expected_file(&s, &device_memory, 0);
        let written = std::fs::read(&report.parts[0].path).unwrap();
        assert!(written == expected, "writer {writer}'s file");
        let crcs: Vec<u32> = written.chunks(CHUNK as usize).map(crc32c).collect();
        assert_eq!(report.parts[0].chunk_crc32c, crcs);
    }
}

#[test]
fn a_state_larger_than_the_arena_goes_in_windows_each_after_the_last_ones_writes() {
    // The smallest arena (2 MiB) holds 32 chunks of 64 KiB: 71 chunks go in 3 windows.
    let sizes = [40 * CHUNK as usize + 77, 100, 30 * CHUNK as usize];
    let mut s = setup(&sizes, 1, 0);
    let device_memory = patterned(&sizes);
    s.data[1] = device_memory[1].clone();
    let arena = Arena::new(1).unwrap();
    let cells = (arena.len_bytes() / CHUNK as usize) as u64;
    assert_eq!(cells, 32);
    let progress = Arc::new(JobProgress::default());
    let device = ThreadDevice::new(device_memory.clone(), &arena, &progress);
    let seen = Arc::clone(&device.seen);
    let mut sources = regions(&mut s.data);
    sources[0] = SourceRegion::device(sizes[0]);
    sources[2] = SourceRegion::device(sizes[2]);
    let hooks = JobHooks {
        device: Some(Box::new(device)),
        arena: arena.try_lease(),
        ..JobHooks::default()
    };
    let pool = Pool::new(CHUNK as usize, 2 * CHUNK as usize);
    let report = write_parts_with(
        &s.plan,
        &s.targets,
        sources,
        &pool,
        &options(),
        &progress,
        hooks,
    )
    .unwrap();
    let written = std::fs::read(&report.parts[0].path).unwrap();
    assert!(written == expected_file(&s, &device_memory, 0));
    let crcs: Vec<u32> = written.chunks(CHUNK as usize).map(crc32c).collect();
    assert_eq!(report.parts[0].chunk_crc32c, crcs);
    let seen = seen.lock().unwrap();
    assert_eq!(seen.calls.len(), 3, "one call per window");
    assert_eq!(seen.waits, 3);
    for (k, (pieces, written_before)) in seen.calls.iter().enumerate() {
        let k = k as u64;
        assert_eq!(
            *written_before,
            k * cells * CHUNK,
            "window {k}'s copies were asked for once every earlier write had completed"
        );
        assert!(
            pieces
                .iter()
                .all(|p| p.arena_offset_bytes + p.len_bytes <= cells * CHUNK)
        );
    }
}

#[test]
fn crc32_fields_are_filled_in_through_the_arena() {
    // Extent 0 is hashed; its CRC goes into the first 4 bytes of extent 1 (on the host).
    let sizes = [3 * CHUNK as usize + 10, 64];
    let mut s = setup(&sizes, 1, 0);
    let device_memory = patterned(&sizes);
    s.data[1] = vec![0; 64];
    let arena = Arena::new(1).unwrap();
    let progress = Arc::new(JobProgress::default());
    let mut sources = regions(&mut s.data);
    sources[0] = SourceRegion::device(sizes[0]);
    let at = s.plan.extent_offsets[1];
    let report = write_parts_with(
        &s.plan,
        &s.targets,
        sources,
        &Pool::new(CHUNK as usize, 2 * CHUNK as usize),
        &options(),
        &progress,
        JobHooks {
            device: Some(Box::new(ThreadDevice::new(
                device_memory.clone(),
                &arena,
                &progress,
            ))),
            arena: arena.try_lease(),
            crc32_fields: vec![Crc32Field {
                start_bytes: 0,
                len_bytes: sizes[0] as u64,
                write_at_bytes: vec![at],
            }],
            ..JobHooks::default()
        },
    )
    .unwrap();
    let written = std::fs::read(&report.parts[0].path).unwrap();
    let expected = crc32fast_ieee(&device_memory[0]);
    assert_eq!(
        &written[at as usize..at as usize + 4],
        &expected.to_le_bytes()
    );
}

/// CRC-32 (IEEE), bit by bit: the reference the zip records' fields are checked against.
fn crc32fast_ieee(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[test]
fn windows_are_written_from_the_arena_on_every_backend_direct_or_not() {
    // Two writers' parts in one job (a partner's copy), three windows, a short last chunk.
    use fastpersist_core::probe::{self, BackendKind, DirectMode};
    let sizes = [50 * CHUNK as usize + 123, 4000, 40 * CHUNK as usize];
    let mut ways = vec![
        (BackendKind::Threads, DirectMode::Off),
        (BackendKind::Threads, DirectMode::Auto),
    ];
    if probe::uring_status().is_ok() {
        ways.push((BackendKind::IoUring, DirectMode::Off));
        ways.push((BackendKind::IoUring, DirectMode::Require));
    }
    for (backend, direct) in ways {
        let mut s = setup(&sizes, 2, 0);
        s.targets.extend(
            s.plan
                .parts_of_writer(1)
                .map(|p| fastpersist_core::job::WriteTarget {
                    part: *p,
                    path: s._root.path().join("partner.bin"),
                }),
        );
        let device_memory = patterned(&sizes);
        s.data[1] = device_memory[1].clone();
        let arena = Arena::new(1).unwrap();
        let progress = Arc::new(JobProgress::default());
        let mut sources = regions(&mut s.data);
        sources[0] = SourceRegion::device(sizes[0]);
        sources[2] = SourceRegion::device(sizes[2]);
        let options = fastpersist_core::job::WriteOptions {
            backend,
            direct,
            ..options()
        };
        let report = write_parts_with(
            &s.plan,
            &s.targets,
            sources,
            &Pool::new(CHUNK as usize, 2 * CHUNK as usize),
            &options,
            &progress,
            JobHooks {
                device: Some(Box::new(ThreadDevice::new(
                    device_memory.clone(),
                    &arena,
                    &progress,
                ))),
                arena: arena.try_lease(),
                ..JobHooks::default()
            },
        )
        .unwrap();
        for (k, part) in report.parts.iter().enumerate() {
            let written = std::fs::read(&part.path).unwrap();
            assert!(
                written == expected_file(&s, &device_memory, k),
                "{backend:?} {direct:?} part {k}"
            );
            let crcs: Vec<u32> = written.chunks(CHUNK as usize).map(crc32c).collect();
            assert_eq!(part.chunk_crc32c, crcs, "{backend:?} {direct:?}");
            if direct == DirectMode::Require {
                assert!(part.direct);
            }
        }
        assert!(!arena.is_leased());
    }
}

#[test]
fn a_gated_job_stages_releases_its_sources_and_writes_only_once_opened() {
    use fastpersist_core::error::Error;
    use fastpersist_core::job::WriteGate;
    let sizes = [3 * CHUNK as usize + 9, 500];
    for cancel in [false, true] {
        let mut s = setup(&sizes, 1, 0);
        let device_memory = patterned(&sizes);
        s.data[1] = device_memory[1].clone();
        let arena = Arena::new(1).unwrap();
        let progress = Arc::new(JobProgress::default());
        let gate = Arc::new(WriteGate::default());
        let mut sources = regions(&mut s.data);
        sources[0] = SourceRegion::device(sizes[0]);
        let job = {
            let (plan, targets, progress, gate) = (
                s.plan.clone(),
                s.targets.clone(),
                Arc::clone(&progress),
                Arc::clone(&gate),
            );
            let device = ThreadDevice::new(device_memory.clone(), &arena, &progress);
            let lease = arena.try_lease();
            std::thread::spawn(move || {
                write_parts_with(
                    &plan,
                    &targets,
                    sources,
                    &Pool::new(CHUNK as usize, 2 * CHUNK as usize),
                    &options(),
                    &progress,
                    JobHooks {
                        device: Some(Box::new(device)),
                        arena: lease,
                        write_gate: Some(gate),
                        ..JobHooks::default()
                    },
                )
            })
        };
        assert!(progress.wait_sources_released(std::time::Duration::from_secs(10)));
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(
            progress.written_bytes(),
            0,
            "nothing is written before the gate opens"
        );
        assert!(arena.is_leased());
        if cancel {
            progress.cancel();
            let err = job.join().unwrap().unwrap_err();
            assert!(matches!(err, Error::Cancelled(_)), "{err:?}");
        } else {
            gate.open();
            let report = job.join().unwrap().unwrap();
            let written = std::fs::read(&report.parts[0].path).unwrap();
            assert!(written == expected_file(&s, &device_memory, 0));
        }
        assert!(!arena.is_leased());
    }
}
