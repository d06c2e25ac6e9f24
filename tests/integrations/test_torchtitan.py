"""torchtitan's checkpoint manager saving through fastpersist, on 2 real gloo ranks.

The ranks build torchtitan's own ``OptimizersContainer``, ``LRSchedulersContainer`` and our
``FastPersistCheckpointManager`` from its ``Config`` (the seam torchtitan's trainer uses), save
at every step (synchronously, then overlapped with ``async_mode="async"``), restart from
scratch and load: every weight and optimizer tensor must come back bit-exact and the next
steps' losses must equal an uninterrupted run's. A flipped byte in the newest checkpoint must
fail the load on every rank, naming the damage.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytest.importorskip(
    "torchtitan.components.checkpoint",
    reason="torchtitan is not installed (pip install --no-deps torchtitan torch_checkpointing spmd_types "
    "torchdata tyro docstring_parser typeguard)",
)

from torchtitan.components.checkpoint import CheckpointManager

from fastpersist.integrations.torchtitan import FastPersistCheckpointManager

from gloo import run_ranks
from torchtitan_workers import MORE_STEPS, STEPS, build, run, run_damaged, snapshot, train_step

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")


def _ok(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for rank, res in enumerate(results):
        assert "traceback" not in res, (rank, res)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_two_ranks_save_restart_and_resume_exactly(tmp_path: Any, async_mode: str) -> None:
    workdir = str(tmp_path)
    results = _ok(run_ranks(run, 2, (workdir, async_mode), workdir, timeout_s=300))
    for rank, res in enumerate(results):
        # 4 weights, and AdamW's step, exp_avg and exp_avg_sq of each
        assert res["same_tensors"] and res["tensor_count"] == 4 + 4 * 3, (rank, res)
        assert res["train_state_step"] == STEPS and res["same_lr"], (rank, res)
        assert res["resumed"] == res["uninterrupted"] and len(res["resumed"]) == MORE_STEPS, (rank, res)
        # keep_latest_k=3 kept the newest three; each is a DCP folder of our files, .metadata last
        assert res["steps_on_disk"] == ["step-2", "step-3", "step-4"], (rank, res)
        files = res["step_files"]
        assert ".metadata" in files and files and all(n == ".metadata" or n.endswith(".fpdcp") for n in files)
    assert results[0]["resumed"] == results[1]["resumed"]


@pytest.mark.slow
def test_a_flipped_byte_in_the_newest_checkpoint_fails_the_load(tmp_path: Any) -> None:
    workdir = str(tmp_path)
    _ok(run_ranks(run, 2, (workdir, "disabled"), workdir, timeout_s=300))
    newest = os.path.join(workdir, "ckpt", f"step-{STEPS}")
    for name in os.listdir(newest):
        if name.endswith(".fpdcp") and os.path.getsize(os.path.join(newest, name)) > 0:
            with open(os.path.join(newest, name), "r+b") as f:  # the first data byte of each file
                byte = f.read(1)
                f.seek(0)
                f.write(bytes([byte[0] ^ 0x40]))
    for name in os.listdir(workdir):
        if name.startswith(("result-", "error-", "init-store")):
            os.remove(os.path.join(workdir, name))
    results = _ok(run_ranks(run_damaged, 2, (workdir,), workdir, timeout_s=300))
    for rank, res in enumerate(results):
        assert res["raised"] is not None, (rank, res)  # never a silent resume from damaged weights
        assert "ChecksumMismatchError" in res["message"] and ".fpdcp bytes [" in res["message"], (rank, res)


def test_the_config_refuses_dcp_s_pinned_process_stager() -> None:
    with pytest.raises(ValueError, match=r"async_mode='async_with_pinned_mem'.*use async_mode='async'"):
        FastPersistCheckpointManager.Config(async_mode="async_with_pinned_mem")


def test_the_config_builds_our_manager_and_a_disabled_one_does_nothing() -> None:
    config = FastPersistCheckpointManager.Config(enable=False)
    manager = config.build(
        dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={}, sd_adapter=None
    )
    assert type(manager) is FastPersistCheckpointManager
    assert manager.save(curr_step=1) is False and manager.load() is False


def test_a_checkpoint_written_by_torchtitan_s_stock_manager_still_loads(tmp_path: Any) -> None:
    workdir = str(tmp_path)
    stock, model, optimizers, schedulers, _ = build(workdir, "disabled", CheckpointManager.Config)
    train_step(model, optimizers, schedulers, 1)
    assert stock.save(curr_step=1)
    saved = snapshot(model, optimizers)
    stock.close()
    assert any(n.endswith(".distcp") for n in os.listdir(os.path.join(workdir, "ckpt", "step-1")))
    ours, model, optimizers, _, _ = build(workdir, "disabled")
    assert ours.load() is True  # DCP's own reader for DCP's own files
    assert all(torch.equal(a, b) for a, b in zip(saved, snapshot(model, optimizers), strict=True))
    ours.close()


def test_an_overlapped_save_s_folder_exists_when_the_call_returns(tmp_path: Any, monkeypatch: Any) -> None:
    # torchtitan purges by listing the folder right after save() returns: a folder made later,
    # on DCP's thread, would not count, and keep_latest_k would keep one checkpoint too many.
    from concurrent.futures import Future

    from torchtitan.components.checkpoint import AsyncMode

    import fastpersist.integrations.torchtitan as ours

    manager, model, *_ = build(str(tmp_path), "disabled", FastPersistCheckpointManager.Config)
    checkpoint_id = os.path.join(str(tmp_path), "ckpt", "step-1")
    seen: list[bool] = []

    def async_save(state_dict: Any, **kwargs: Any) -> Future:
        seen.append(os.path.isdir(checkpoint_id))
        done: Future = Future()
        done.set_result(None)
        return done

    monkeypatch.setattr(ours.state_dict_saver, "async_save", async_save)
    manager.dcp_save({"model": model.state_dict()}, checkpoint_id, AsyncMode.ASYNC)
    assert seen == [True]
    manager.close()
