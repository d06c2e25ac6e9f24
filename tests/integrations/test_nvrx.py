"""NVRx local checkpointing with each rank's checkpoint stored by fastpersist, on 2 gloo ranks.

The ranks drive ``FastPersistLocalCheckpointManager`` through NVRx's own ``save`` /
``find_latest`` / ``load`` (its ``BaseCheckpointManager`` code: the all-gather of what each rank
holds, the barrier, the finalize that cleans up), restart, and must load exactly what they
saved; a flipped byte in one rank's file must fail that rank's load with NVRx's
``CheckpointingException`` (caused by fastpersist's ``ChecksumMismatchError``) while the other
rank's still loads.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

pytest.importorskip(
    "nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager",
    reason="the NVIDIA Resiliency Extension is not installed (pip install nvidia-resiliency-ext 'pynvml<13')",
)

from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager import (
    SameMachineReplicationException,
)

import fastpersist as fp
from fastpersist.integrations.nvrx import FastPersistLocalCheckpointManager, checkpoint_name

from gloo import HELPERS_DIR, run_ranks
from nvrx_workers import (
    ITERATIONS,
    SESSION,
    CpuTensorAwareStateDict,
    rank_state,
    run,
    run_damaged,
    run_phase,
    same,
)

pytestmark = pytest.mark.filterwarnings("ignore:Torch distributed backend has not been initialized")


def _ok(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for rank, res in enumerate(results):
        assert "traceback" not in res, (rank, res)
    return results


@pytest.fixture(scope="module")
def saved_by_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    workdir = str(tmp_path_factory.mktemp("nvrx"))
    root = os.path.join(workdir, "local")
    return root, _ok(run_ranks(run, 2, (workdir, root), workdir, timeout_s=240))


def test_two_ranks_save_find_latest_and_load_exactly(saved_by_two_ranks: tuple[str, list[dict[str, Any]]]) -> None:
    _, results = saved_by_two_ranks
    for rank, res in enumerate(results):
        assert res["latest"] == ITERATIONS[-1] and res["ckpt_id"] == [ITERATIONS[-1], rank, SESSION], (rank, res)
        assert res["exact"] and res["type"] == "CpuTensorAwareStateDict", (rank, res)
        # after each save, NVRx's finalize ran our _cleanup: only the newest iteration is left
        assert res["listings"] == [[checkpoint_name(it, rank)] for it in ITERATIONS], (rank, res)


def test_a_flipped_byte_fails_that_rank_s_load_only(saved_by_two_ranks: tuple[str, list[dict[str, Any]]]) -> None:
    root, _ = saved_by_two_ranks
    ckpt = os.path.join(root, SESSION, "0", checkpoint_name(ITERATIONS[-1], 0))
    data = sorted(n for n in os.listdir(ckpt) if n.startswith("data-"))[0]
    with open(os.path.join(ckpt, data), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x10]))
    workdir = os.path.join(os.path.dirname(root), "damaged")
    os.makedirs(workdir)
    damaged, intact = _ok(run_ranks(run_damaged, 2, (workdir, root), workdir, timeout_s=240))
    assert damaged["latest"] == intact["latest"] == ITERATIONS[-1]  # complete on both ranks: found
    assert damaged["cause"] == "ChecksumMismatchError", damaged
    assert ckpt in damaged["raised"] and "checksum mismatch" in damaged["raised"] and "bytes [" in damaged["raised"]
    assert intact["raised"] is None and intact["exact"], intact


def test_saving_an_existing_id_replaces_it_as_the_stock_manager_does(tmp_path: Any) -> None:
    manager = FastPersistLocalCheckpointManager(tmp_path, session_id="s", config=fp.Config(durable=False))
    stale = CpuTensorAwareStateDict(rank_state(0, 1))
    manager._save(stale, (1, 0, "s"))
    fresh = CpuTensorAwareStateDict(rank_state(0, 2))
    manager._save(fresh, (1, 0, "s"))  # a stale newer checkpoint is replaced, not refused
    assert same(manager._load((1, 0, "s")).state_dict, rank_state(0, 2))
    assert same(fresh.state_dict, rank_state(0, 2))  # the tensors are back in place
    foreign = manager.local_ckpt_dir / checkpoint_name(3, 0)
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a checkpoint: never replaced")
    with pytest.raises(SameMachineReplicationException, match=r"\(3, 0, 's'\)"):
        manager._save(fresh, (3, 0, "s"))
    assert same(fresh.state_dict, rank_state(0, 2))


def test_ranks_that_died_at_different_iterations_resume_and_never_mix_runs(tmp_path: Any) -> None:
    root = str(tmp_path / "local")
    runs = {}
    for phase in ("died-ahead", "died-replacing", "resumes"):
        workdir = tmp_path / phase
        workdir.mkdir()
        runs[phase] = _ok(run_ranks(run_phase, 2, (str(workdir), root, phase), str(workdir), timeout_s=240))
    for rank in range(2):
        # rank 1's stale iteration 2 is not complete: resume from 1
        assert runs["died-replacing"][rank] == {"latest": 1, "loaded_by": "died-ahead"}
        # iteration 2 is held by both ranks now, but written by two runs: still resume from 1
        resumed = runs["resumes"][rank]
        assert (resumed["latest"], resumed["loaded_by"]) == (1, "died-ahead")
        # its save of 2 replaced both stale ones; the cleanup took iteration 1 and a killed save's leftover
        assert resumed["listing"] == [checkpoint_name(2, rank)]
        assert resumed["restarted"] == {"latest": 2, "loaded_by": "resumes", "exact": True}


def test_a_kill_during_a_replacing_save_leaves_one_whole_checkpoint_and_cleanup_takes_the_rest(
    tmp_path: Any,
) -> None:
    manager = FastPersistLocalCheckpointManager(tmp_path, session_id="s")
    manager._save(CpuTensorAwareStateDict({"w": torch.full((4,), 1.0)}), (2, 0, "s"))  # the stale one
    path = manager.local_ckpt_dir / checkpoint_name(2, 0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HELPERS_DIR, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", _REPLACING_CHILD, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    assert child.stdout is not None and child.stdout.readline() == b"saving\n"
    while not [n for n in os.listdir(manager.local_ckpt_dir) if ".fptmp-" in n] and child.poll() is None:
        time.sleep(0.001)  # until the replacing save's temporary directory exists
    child.send_signal(signal.SIGKILL)
    child.wait()
    state = fp.load(path)  # the old checkpoint or the new one, whole and verified
    assert [float(state["tensors"][0][0])] in ([1.0], [2.0])
    manager._cleanup(2)  # what NVRx's finalize runs after the next save
    fp.wait_removed()
    assert os.listdir(manager.local_ckpt_dir) == [checkpoint_name(2, 0)]


_REPLACING_CHILD = """
import sys, torch
import fastpersist as fp
from nvrx_workers import CpuTensorAwareStateDict
from fastpersist.integrations.nvrx import FastPersistLocalCheckpointManager
manager = FastPersistLocalCheckpointManager(sys.argv[1], session_id="s",
                                            config=fp.Config(pool_bytes=4 << 20, chunk_bytes=1 << 20, queue_depth=2))
print("saving", flush=True)
manager._save(CpuTensorAwareStateDict({"w": torch.full((32 << 20,), 2.0)}), (2, 0, "s"))  # 128 MiB
"""


def test_ids_cleanup_and_failed_save_cleanup(tmp_path: Any) -> None:
    manager = FastPersistLocalCheckpointManager(tmp_path, session_id="s", config=fp.Config(durable=False))
    for iteration, rank in [(1, 0), (2, 0), (2, 1), (3, 0)]:  # (2, 1): a replica of rank 1's shard
        manager._save(CpuTensorAwareStateDict(rank_state(rank, iteration)), (iteration, rank, "s"))
    os.makedirs(manager.local_ckpt_dir / "iter_0000009_0_local.fp")  # no manifest: not a checkpoint
    (manager.local_ckpt_dir / "notes.txt").write_text("unrelated")
    assert sorted(manager._my_ckpt_ids()) == [(1, 0, "s"), (2, 0, "s"), (2, 1, "s"), (3, 0, "s")]
    manager._cleanup_failed_save(3)
    fp.wait_removed()
    assert sorted(manager._my_ckpt_ids()) == [(1, 0, "s"), (2, 0, "s"), (2, 1, "s")]
    manager._cleanup(2)
    fp.wait_removed()
    assert sorted(manager._my_ckpt_ids()) == [(2, 0, "s"), (2, 1, "s")]
    assert (manager.local_ckpt_dir / "notes.txt").exists()  # what is not ours is left alone
    loaded = manager._load((2, 1, "s"))
    assert same(loaded.state_dict, rank_state(1, 2))


def test_errors_name_the_argument_and_the_fix(tmp_path: Any) -> None:
    with pytest.raises(TypeError, match=r"config must be a fastpersist\.Config, got dict"):
        FastPersistLocalCheckpointManager(tmp_path, config={"durable": False})  # type: ignore[arg-type]
    manager = FastPersistLocalCheckpointManager(tmp_path, session_id="s")
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager import CheckpointingException

    with pytest.raises(CheckpointingException, match=r"session 'other'.*session_id='other'"):
        manager._load((1, 0, "other"))
    with pytest.raises(CheckpointingException, match=r"iter_0000004_0_local\.fp does not exist"):
        manager._load((4, 0, "s"))


def test_incremental_checkpoints_write_what_changed_and_outlive_the_cleanup(tmp_path: Any) -> None:
    config = fp.Config(durable=False)
    manager = FastPersistLocalCheckpointManager(
        tmp_path, session_id="s", config=config, incremental=fp.Incremental(block_bytes=4096)
    )
    frozen = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB that never changes
    states = {}
    for iteration in (1, 2, 3):
        state = {"frozen": frozen, **rank_state(0, iteration)}
        states[iteration] = state
        manager._save(CpuTensorAwareStateDict(state), (iteration, 0, "s"))
    info = fp.inspect(manager._path((3, 0, "s")))["incremental"]
    assert info["depth"] == 2 and sum(info["refers_to"].values()) >= frozen.nbytes
    manager._cleanup(3)  # iterations 1 and 2 go; 3 keeps the frozen bytes it links
    fp.wait_removed()
    assert sorted(os.listdir(manager.local_ckpt_dir)) == [checkpoint_name(3, 0)]
    assert same(manager._load((3, 0, "s")).state_dict, states[3])
    with pytest.raises(ValueError, match="no base"):
        FastPersistLocalCheckpointManager(tmp_path, session_id="s", incremental=fp.Incremental(base=str(tmp_path)))
