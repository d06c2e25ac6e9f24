//! A job whose arena is its one data file (`Arena::over_file`, the in-memory level's files):
//! the device copies land in the file's pages, host bytes are copied there, and the job only
//! checksums; an arena over any other file is refused before a byte is staged.

mod common;

use std::sync::Arc;

use common::device::{ThreadDevice, expected_file, patterned};
use common::{CHUNK, options, regions, setup};
use fastpersist_core::arena::Arena;
use fastpersist_core::checksum::crc32c;
use fastpersist_core::job::{JobHooks, JobProgress, SourceRegion, WriteGate, write_parts_with};
use fastpersist_core::pool::Pool;

/// An arena over the file at `path`, made whole at `len` bytes first (as a recycled file is).
fn file_arena(path: &std::path::Path, len: u64) -> Arena {
    std::fs::write(path, vec![0xEE; len as usize]).unwrap();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    Arena::over_file(file, len, path).unwrap()
}

fn device_save(
    s: &mut common::Setup,
    memory: &[Vec<u8>],
    arena: &Arena,
    gate: Option<Arc<WriteGate>>,
) -> fastpersist_core::error::Result<fastpersist_core::job::WriteReport> {
    let progress = Arc::new(JobProgress::default());
    let device = ThreadDevice::new(memory.to_vec(), arena, &progress);
    let mut sources = regions(&mut s.data);
    for (i, source) in sources.iter_mut().enumerate().skip(1) {
        *source = SourceRegion::device(memory[i].len());
    }
    let hooks = JobHooks {
        device: Some(Box::new(device)),
        arena: arena.try_lease(),
        write_gate: gate,
        ..JobHooks::default()
    };
    let pool = Pool::new(CHUNK as usize, 2 * CHUNK as usize);
    write_parts_with(
        &s.plan,
        &s.targets,
        sources,
        &pool,
        &options(),
        &progress,
        hooks,
    )
}

#[test]
fn the_file_is_staged_in_place_and_checksummed_again_on_every_save_that_recycles_it() {
    // Host extent 0, device extents 1 and 2; the part ends inside a chunk and inside a page.
    let sizes = [100, 3 * CHUNK as usize + 5, 2 * CHUNK as usize + 77];
    let mut s = setup(&sizes, 1, 0);
    let len = s.targets[0].part.len_bytes;
    let arena = file_arena(&s.targets[0].path, len);
    for round in 0..2u8 {
        let mut memory = patterned(&sizes);
        memory[2]
            .iter_mut()
            .for_each(|b| *b = b.wrapping_add(round));
        s.data[0] = memory[0].clone();
        let report = device_save(&mut s, &memory, &arena, None).unwrap();
        assert!(!arena.is_leased(), "the lease ends with the job");
        let written = std::fs::read(&s.targets[0].path).unwrap();
        assert_eq!(written.len() as u64, len);
        assert!(written == expected_file(&s, &memory, 0), "round {round}");
        let crcs: Vec<u32> = written.chunks(CHUNK as usize).map(crc32c).collect();
        assert_eq!(report.parts[0].chunk_crc32c, crcs);
        assert!(!report.parts[0].direct);
        assert_eq!(report.bytes_written, len);
    }
}

#[test]
fn a_snapshot_in_place_waits_for_its_gate_before_it_is_done() {
    let sizes = [4096, CHUNK as usize];
    let mut s = setup(&sizes, 1, 0);
    let memory = patterned(&sizes);
    s.data[0] = memory[0].clone();
    let arena = file_arena(&s.targets[0].path, s.targets[0].part.len_bytes);
    let gate = Arc::new(WriteGate::default());
    let opener = Arc::clone(&gate);
    let started = std::time::Instant::now();
    let opens = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(200));
        opener.open();
    });
    device_save(&mut s, &memory, &arena, Some(gate)).unwrap();
    assert!(started.elapsed() >= std::time::Duration::from_millis(200));
    opens.join().unwrap();
}

#[test]
fn an_arena_over_another_file_or_of_another_length_is_refused_and_the_file_left_alone() {
    let sizes = [100, CHUNK as usize];
    let mut s = setup(&sizes, 1, 0);
    let memory = patterned(&sizes);
    let len = s.targets[0].part.len_bytes;
    let committed = s.targets[0].path.with_file_name("committed.bin");
    let arena = file_arena(&committed, len);
    std::fs::write(&committed, vec![5u8; len as usize]).unwrap(); // a committed step's bytes
    std::fs::write(&s.targets[0].path, vec![0u8; len as usize]).unwrap();
    let err = device_save(&mut s, &memory, &arena, None).unwrap_err();
    assert!(err.to_string().contains("another file"), "{err}");
    assert_eq!(std::fs::read(&committed).unwrap(), vec![5u8; len as usize]);
    assert!(!arena.is_leased());
    let short = file_arena(&s.targets[0].path.with_file_name("short.bin"), len - 1);
    std::fs::rename(
        s.targets[0].path.with_file_name("short.bin"),
        &s.targets[0].path,
    )
    .unwrap();
    assert!(device_save(&mut s, &memory, &short, None).is_err()); // its file, at another length
}

#[test]
fn an_arena_over_a_file_never_stages_a_job_of_two_parts() {
    let sizes = [100, CHUNK as usize, CHUNK as usize];
    let mut s = setup(&sizes, 2, 0);
    let two = setup(&sizes, 2, 1);
    s.targets.extend(two.targets.iter().cloned());
    let memory = patterned(&sizes);
    let arena = file_arena(&s.targets[0].path, s.targets[0].part.len_bytes);
    let err = device_save(&mut s, &memory, &arena, None).unwrap_err();
    assert!(err.to_string().contains("one part"), "{err}");
}
