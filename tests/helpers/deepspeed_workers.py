"""Code each spawned rank of the DeepSpeed tests runs (tests/integrations/test_deepspeed.py):
a small model trained by DeepSpeed on the CPU accelerator over gloo, with fastpersist's
checkpoint engine installed.

Every rank gets its own batches from (rank, step), so a resumed run must reproduce the
uninterrupted run's losses exactly if, and only if, the weights, the optimizer state and the
step counters all came back as they were.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported anywhere

import torch
import torch.nn.functional as F

from gloo import report_rank

#: Steps before the first save, and in all.
SAVE_AFTER, STEPS = 3, 6
TAG_A, TAG_B = f"global_step{SAVE_AFTER}", f"global_step{SAVE_AFTER + 1}"


def ds_config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        # torch's Adam: DeepSpeed's CPU Adam is an op it would compile first.
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1 << 30,
    }


def make_engine(stage: int, seed: int, **config: Any) -> Any:
    """A fresh engine over a few Linear layers and a BatchNorm (whose statistics the forward
    pass updates in place: what a decoupled save must have copied before it returns);
    `config`: sections added to :func:`ds_config`'s."""
    import deepspeed

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 4),
    )  # fmt: skip
    config = {**ds_config(stage), **config}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train_step(engine: Any, step: int) -> float:
    """One optimizer step on this rank's batch of `step`; the loss as a Python float."""
    g = torch.Generator().manual_seed(1000 * torch.distributed.get_rank() + step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = F.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    return float(loss.item())


def install(engine: Any, decoupled: bool) -> Any:
    import fastpersist as fp
    from fastpersist.integrations.deepspeed import install as install_fastpersist

    # Small chunks and pool: a state of a few hundred KiB still spans many chunks, and a
    # decoupled save is still writing when save_checkpoint returns.
    config = fp.Config(chunk_bytes=64 << 10, pool_bytes=256 << 10, queue_depth=2, timeout_s=60)
    return install_fastpersist(engine, decoupled=decoupled, config=config)


def full_weights(engine: Any, stage: int) -> dict[str, list[float]]:
    """The module's full fp32 parameters, gathered under ZeRO-3 (a collective)."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=stage == 3):
        return {name: p.detach().flatten().tolist() for name, p in params.items()}


def latest(save_dir: str) -> str | None:
    path = os.path.join(save_dir, "latest")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


def _setup(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # read, never dialled: gloo joins by file
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)


# -------------------------------------------------------------------- save, load, resume


def save_load_resume(stage: int, decoupled: bool, save_dir: str) -> dict[str, Any]:
    """Trains STEPS steps, saving after SAVE_AFTER; then a fresh engine (other initial weights)
    loads the checkpoint and trains the remaining steps. Returns both runs' losses and what the
    checkpoint holds."""
    rank = torch.distributed.get_rank()
    engine = make_engine(stage, seed=0)
    install(engine, decoupled)
    losses, saved_weights, latest_before_commit = [], None, None
    for step in range(STEPS):
        losses.append(train_step(engine, step))
        if step == SAVE_AFTER - 1:
            saved_weights = full_weights(engine, stage)
            engine.save_checkpoint(save_dir)
            latest_before_commit = latest(save_dir)  # decoupled: not before engine.step()'s commit
    checkpoint_engine = type(engine.checkpoint_engine).__name__
    engine.destroy()
    result: dict[str, Any] = {
        "checkpoint_engine": checkpoint_engine,
        "losses": losses,
        "latest": latest(save_dir),
        "latest_before_commit": latest_before_commit,
    }
    if rank == 0 and stage > 0:  # DeepSpeed's own offline reader of the files, as a user runs it
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        offline = get_fp32_state_dict_from_zero_checkpoint(save_dir)
        assert saved_weights is not None
        result["zero_to_fp32_exact"] = set(saved_weights) <= set(offline) and all(  # (and the BatchNorm's buffers)
            offline[name].flatten().tolist() == saved_weights[name] for name in saved_weights
        )
    resumed = make_engine(stage, seed=1)
    install(resumed, decoupled)
    load_path, _ = resumed.load_checkpoint(save_dir)
    result["load_path"] = load_path
    result["resumed"] = [train_step(resumed, step) for step in range(SAVE_AFTER, STEPS)]
    resumed.destroy()
    return result


def run_save_load_resume(rank: int, world: int, init_file: str, workdir: str, stage: int) -> None:
    def cases() -> dict[str, Any]:
        _setup(rank, world)
        return {
            mode: save_load_resume(stage, mode == "decoupled", os.path.join(workdir, f"ckpt-{mode}"))
            for mode in ("sync", "decoupled")
        }

    report_rank(rank, world, init_file, workdir, cases)


# -------------------------------------------------------------------- killed during a save


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def killed_during_save(rank: int, world: int, init_file: str, workdir: str, stage: int, mode: str, where: str) -> None:
    """Saves tag A (committed), trains one step, then dies during the save of tag B.

    `where`: ``"writing"``, every rank is killed right after its first file of B started
    (decoupled: while it is being written) or was written (sync); ``"agreeing"``, rank 1 is
    killed once its files of B are durable, as the commit begins, and rank 0 must notice and
    leave ``latest`` alone. The losses up to tag B go to ``losses-{rank}.json`` first.
    """

    def scenario() -> dict[str, Any]:
        _setup(rank, world)
        save_dir = os.path.join(workdir, "ckpt")
        engine = make_engine(stage, seed=0)
        ours = install(engine, mode == "decoupled")
        losses = [train_step(engine, step) for step in range(SAVE_AFTER)]
        engine.save_checkpoint(save_dir)
        losses.append(train_step(engine, SAVE_AFTER))  # decoupled: tag A's commit
        assert latest(save_dir) == TAG_A
        with open(os.path.join(workdir, f"losses-{rank}.json"), "w") as f:
            json.dump(losses, f)
        if where == "writing":
            save = ours.save

            def save_then_die(state_dict: object, path: str) -> None:
                save(state_dict, path)
                _die()

            ours.save = save_then_die  # type: ignore[method-assign]
        elif rank == 1:

            def die_before_agreeing() -> None:
                ours.wait_outstanding()  # this rank's files of B are durable
                _die()

            ours._commit_open = die_before_agreeing  # type: ignore[method-assign]
        try:
            engine.save_checkpoint(save_dir)
            if mode == "decoupled":
                train_step(engine, SAVE_AFTER + 1)  # B's commit
        except Exception as e:  # rank 0 of "agreeing": the group save error, with `latest` left alone
            return {"error": f"{type(e).__name__}: {e}", "latest": latest(save_dir)}
        return {"latest": latest(save_dir)}  # not expected: the test fails on it

    report_rank(rank, world, init_file, workdir, scenario, destroy=False)


def resume_from_latest(rank: int, world: int, init_file: str, workdir: str, stage: int, mode: str) -> None:
    """A fresh group after the kill: loads what ``latest`` names and trains on from there."""

    def resume() -> dict[str, Any]:
        _setup(rank, world)
        save_dir = os.path.join(workdir, "ckpt")
        engine = make_engine(stage, seed=1)
        install(engine, mode == "decoupled")
        load_path, _ = engine.load_checkpoint(save_dir)
        result = {"load_path": load_path, "loss": train_step(engine, SAVE_AFTER)}
        engine.destroy()
        return result

    report_rank(rank, world, init_file, workdir, resume)


# -------------------------------------------------------------------- a tag of its own on each rank


def different_tags(rank: int, world: int, init_file: str, workdir: str) -> None:
    """Each rank saves a tag of its own (``tag-{rank}``) under DeepSpeed's ``tag_validation``
    "FAIL" and "WARN", blocking and decoupled: DeepSpeed's setting decides, as with its own engines."""

    def cases() -> dict[str, Any]:
        _setup(rank, world)
        result = {}
        for validation in ("FAIL", "WARN"):
            for decoupled in (False, True):
                save_dir = os.path.join(workdir, f"ckpt-{validation}-{decoupled}")
                engine = make_engine(1, seed=0, checkpoint={"tag_validation": validation})
                install(engine, decoupled)
                train_step(engine, 0)
                try:
                    engine.save_checkpoint(save_dir, tag=f"tag-{rank}")
                    error = None
                except Exception as e:
                    error = type(e).__name__
                engine.destroy()  # decoupled: the commit (every rank)
                tag_dir = os.path.join(save_dir, f"tag-{rank}")
                files = sorted(os.listdir(tag_dir)) if os.path.isdir(tag_dir) else []
                result[f"{validation}-{decoupled}"] = {"error": error, "latest": latest(save_dir), "files": files}
        return result

    report_rank(rank, world, init_file, workdir, cases)
