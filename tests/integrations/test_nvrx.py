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
from typing import Any

import pytest

pytest.importorskip(
    "nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager",
    reason="the NVIDIA Resiliency Extension is not installed (pip install nvidia-resiliency-ext 'pynvml<13')",
)

from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager import (
    SameMachineReplicationException,
)

import fastpersist as fp
from fastpersist.integrations.nvrx import FastPersistLocalCheckpointManager, checkpoint_name

from gloo import run_ranks
from nvrx_workers import ITERATIONS, SESSION, CpuTensorAwareStateDict, rank_state, run, run_damaged, same

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


def test_saving_an_existing_id_is_refused_as_nvrx_expects(tmp_path: Any) -> None:
    manager = FastPersistLocalCheckpointManager(tmp_path, session_id="s", config=fp.Config(durable=False))
    held = CpuTensorAwareStateDict(rank_state(0, 1))
    manager._save(held, (1, 0, "s"))
    with pytest.raises(SameMachineReplicationException, match=r"\(1, 0, 's'\)"):
        manager._save(held, (1, 0, "s"))
    assert same(held.state_dict, rank_state(0, 1))  # the tensors are back in place after both calls


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
