//! `StagingMode::choose`: the one place a job's way of staging is decided.

mod common;

use std::sync::Arc;

use common::{CHUNK, options, setup};
use fastpersist_core::arena::Arena;
use fastpersist_core::error::Error;
use fastpersist_core::job::{JobHooks, StagingMode, WriteGate, WriteTarget};
use fastpersist_core::plan::Plan;
use fastpersist_core::probe::DirectMode;

fn one_target_in(dir: &std::path::Path, len: u64) -> (Plan, Vec<WriteTarget>) {
    let plan = Plan::new(&[len], 1, 1, CHUNK).unwrap();
    let targets = plan
        .parts_of_writer(0)
        .map(|p| WriteTarget {
            part: *p,
            path: dir.join("w0.bin"),
        })
        .collect();
    (plan, targets)
}

#[test]
fn host_sources_on_a_disk_stage_through_the_pool() {
    let s = setup(&[3 * CHUNK as usize], 1, 0);
    let mode = StagingMode::choose(&s.targets, &options(), &JobHooks::default()).unwrap();
    assert_eq!(mode, StagingMode::Pool);
}

#[test]
fn host_sources_on_a_memory_filesystem_overwrite_whole_files_in_place_unless_o_direct_is_required()
{
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    let (_, targets) = one_target_in(shm.path(), 3 * CHUNK);
    let choose = |options| StagingMode::choose(&targets, &options, &JobHooks::default()).unwrap();
    // A new file, an empty one or one with holes has no pages to reuse: written through the
    // pool, which allocates tmpfs pages faster than a new mapping does.
    assert_eq!(choose(options()), StagingMode::Pool);
    std::fs::write(&targets[0].path, b"").unwrap();
    assert_eq!(choose(options()), StagingMode::Pool);
    std::fs::File::options()
        .write(true)
        .open(&targets[0].path)
        .unwrap()
        .set_len(2 * CHUNK)
        .unwrap();
    assert_eq!(choose(options()), StagingMode::Pool);
    // A recycled file (every page allocated) is overwritten through its mapping.
    std::fs::write(&targets[0].path, vec![1; 2 * CHUNK as usize]).unwrap();
    assert_eq!(choose(options()), StagingMode::MappedFiles);
    let mut required = options();
    required.direct = DirectMode::Require;
    assert_eq!(choose(required), StagingMode::Pool);
}

#[test]
fn an_arena_stages_the_job_and_an_arena_over_its_one_file_stages_it_in_place() {
    let s = setup(&[3 * CHUNK as usize], 1, 0);
    let arena = Arena::new(4 * CHUNK as usize).unwrap();
    let hooks = JobHooks {
        arena: arena.try_lease(),
        ..JobHooks::default()
    };
    assert_eq!(
        StagingMode::choose(&s.targets, &options(), &hooks).unwrap(),
        StagingMode::Arena
    );

    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    let (_, targets) = one_target_in(shm.path(), 3 * CHUNK);
    std::fs::write(&targets[0].path, vec![0; 3 * CHUNK as usize]).unwrap();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&targets[0].path)
        .unwrap();
    let arena = Arena::over_file(file, 3 * CHUNK, &targets[0].path).unwrap();
    let hooks = JobHooks {
        arena: arena.try_lease(),
        ..JobHooks::default()
    };
    assert_eq!(
        StagingMode::choose(&targets, &options(), &hooks).unwrap(),
        StagingMode::InPlace
    );
}

#[test]
fn a_write_gate_without_an_arena_is_refused() {
    let s = setup(&[CHUNK as usize], 1, 0);
    let hooks = JobHooks {
        write_gate: Some(Arc::new(WriteGate::default())),
        ..JobHooks::default()
    };
    let err = StagingMode::choose(&s.targets, &options(), &hooks).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}
