"""Code each spawned rank of the NVRx local-checkpoint tests runs (gloo, CPU tensors): a run
that saves and restarts, a load after damage, and job runs that die with ranks at different
iterations and the runs that resume after them (each state records which run wrote it)."""

from __future__ import annotations

import os
from typing import Any

import torch
from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict

from gloo import report_rank

SESSION = "job7"
ITERATIONS = (10, 20, 30)


class CpuTensorAwareStateDict(BasicTensorAwareStateDict):
    """NVRx's ``BasicTensorAwareStateDict`` for CPU tensors (the stock one asserts ``is_cuda``
    and restores to ``"cuda"``; everything else is its own code)."""

    def __init__(self, state_dict: dict[str, Any]) -> None:
        self.state_dict = state_dict
        self._is_hollow = False

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """The tensors were on the CPU all along."""


def rank_state(rank: int, iteration: int) -> dict[str, Any]:
    """What rank `rank` holds at `iteration`: weights, optimizer-like state, plain values."""
    g = torch.Generator().manual_seed(rank * 1000 + iteration)
    return {
        "model": {"w": torch.randn(64, 33, generator=g), "b": torch.randn(33, generator=g).to(torch.bfloat16)},
        "optimizer": {"step": iteration, "exp_avg": [torch.randn(7, generator=g), torch.arange(5, dtype=torch.int16)]},
        "rng": torch.randint(0, 255, (16,), dtype=torch.uint8, generator=g),
        "meta": {"name": f"rank{rank}", "lr": 0.5 / iteration, "empty": torch.zeros(0, 4)},
    }


def same(a: Any, b: Any) -> bool:
    """Exact equality of nested states: tensors by dtype, shape and bits."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def save_and_restart(rank: int, root: str) -> dict[str, Any]:
    import fastpersist as fp
    from fastpersist.integrations.nvrx import FastPersistLocalCheckpointManager

    manager = FastPersistLocalCheckpointManager(root, session_id=SESSION)
    assert manager.find_latest() == -1
    listings = []
    for iteration in ITERATIONS:
        held = CpuTensorAwareStateDict(rank_state(rank, iteration))
        manager.save(held, iteration)
        assert not held.is_hollow and same(held.state_dict, rank_state(rank, iteration))  # given back whole
        fp.wait_removed()
        listings.append(sorted(os.listdir(manager.local_ckpt_dir)))

    restarted = FastPersistLocalCheckpointManager(root, session_id=SESSION)  # a new job, same node
    latest = restarted.find_latest()
    loaded, ckpt_id = restarted.load()
    return {
        "listings": listings,
        "latest": latest,
        "ckpt_id": list(ckpt_id),
        "exact": same(loaded.state_dict, rank_state(rank, ITERATIONS[-1])),
        "type": type(loaded).__name__,
    }


def run(rank: int, world: int, init_file: str, workdir: str, root: str) -> None:
    report_rank(rank, world, init_file, workdir, lambda: save_and_restart(rank, root))


def load_after_damage(rank: int, root: str) -> dict[str, Any]:
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager import CheckpointingException

    from fastpersist.integrations.nvrx import FastPersistLocalCheckpointManager

    manager = FastPersistLocalCheckpointManager(root, session_id=SESSION)
    latest = manager.find_latest()
    try:
        loaded, _ = manager.load()
    except CheckpointingException as e:
        return {"latest": latest, "raised": str(e), "cause": type(e.__cause__).__name__}
    return {"latest": latest, "raised": None, "exact": same(loaded.state_dict, rank_state(rank, ITERATIONS[-1]))}


def run_damaged(rank: int, world: int, init_file: str, workdir: str, root: str) -> None:
    report_rank(rank, world, init_file, workdir, lambda: load_after_damage(rank, root))


# ------------------------------------------------- runs that die with ranks at different iterations

#: A leftover of a save killed in an earlier run (its hidden temporary directory).
LEFTOVER = ".iter_0000002_{rank}_local.fp.fptmp-0123456789ab"


def written(rank: int, iteration: int, run: str) -> dict[str, Any]:
    """What `rank` saves at `iteration` in the job run `run`."""
    return {**rank_state(rank, iteration), "written_by": run}


def _resume(manager: Any) -> dict[str, Any]:
    latest = manager.find_latest()
    loaded, _ = manager.load()
    return {"latest": latest, "loaded_by": loaded.state_dict["written_by"]}


def _phase(rank: int, root: str, run: str) -> dict[str, Any]:
    import fastpersist as fp
    from fastpersist.integrations.nvrx import FastPersistLocalCheckpointManager

    manager = FastPersistLocalCheckpointManager(root, session_id=SESSION)
    out: dict[str, Any] = {}
    if run == "died-ahead":  # rank 1 wrote iteration 2, the job died before rank 0 did
        manager.save(CpuTensorAwareStateDict(written(rank, 1, run)), 1)
        if rank == 1:
            manager._save(CpuTensorAwareStateDict(written(rank, 2, run)), (2, 1, SESSION))
    elif run == "died-replacing":  # rank 0 wrote iteration 2, rank 1 died before replacing its stale one
        out = _resume(manager)
        manager._agree_on_run()  # what save() does first, on every rank
        if rank == 0:
            manager._save(CpuTensorAwareStateDict(written(rank, 2, run)), (2, 0, SESSION))
    else:  # "resumes", and then a job that restarts after it on the same nodes
        out = _resume(manager)
        os.makedirs(os.path.join(manager.local_ckpt_dir, LEFTOVER.format(rank=rank)))
        manager.save(CpuTensorAwareStateDict(written(rank, out["latest"] + 1, run)), out["latest"] + 1)
        fp.wait_removed()
        out["listing"] = sorted(os.listdir(manager.local_ckpt_dir))
        restarted = FastPersistLocalCheckpointManager(root, session_id=SESSION)
        out["restarted"] = _resume(restarted)
        loaded, _ = restarted.load()
        out["restarted"]["exact"] = same(loaded.state_dict, written(rank, out["latest"] + 1, run))
    return out


def run_phase(rank: int, world: int, init_file: str, workdir: str, root: str, run: str) -> None:
    report_rank(rank, world, init_file, workdir, lambda: _phase(rank, root, run))
