"""Code each spawned rank of the torchtitan tests runs: torchtitan's own optimizer, scheduler and
checkpoint-manager classes on a small model, gloo process group, CPU."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gloo import report_rank

STEPS = 4  # saved at every step; the newest, step 4, is what a restart loads
MORE_STEPS = 3  # the steps after the restart, compared with an uninterrupted run's


class TrainState:
    """A ``Stateful`` the manager saves beside the model (torchtitan's ``train_state`` key)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def build(
    workdir: str, async_mode: str, manager_config: type | None = None
) -> tuple[Any, nn.Module, Any, Any, TrainState]:
    """A fresh model, optimizer, scheduler and manager (what a restarted job builds); the manager
    is ours unless `manager_config` names another ``Config`` (torchtitan's stock one)."""
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    from fastpersist.integrations.torchtitan import FastPersistCheckpointManager

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    group = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})
    optimizers = OptimizersContainer.Config(param_groups=[group], implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=20)
    train_state = TrainState()
    config = (manager_config or FastPersistCheckpointManager.Config)(
        enable=True,
        folder="ckpt",
        interval=1,
        keep_latest_k=0 if manager_config else 3,  # (purging asks for a process group)
        last_save_model_only=False,
        async_mode=async_mode,
    )
    manager = config.build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=workdir,
    )
    return manager, model, optimizers, schedulers, train_state


def train_step(model: nn.Module, optimizers: Any, schedulers: Any, step: int) -> float:
    """One step on data that depends only on the step (so a resumed run sees the same batches)."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    optimizers.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizers.step()
    schedulers.step()
    return float(loss.detach())


def snapshot(model: nn.Module, optimizers: Any) -> list[torch.Tensor]:
    """Every weight and every optimizer tensor, in a fixed order."""
    tensors = [p.detach().clone() for p in model.parameters()]
    for opt in optimizers.optimizers:
        for state in opt.state.values():
            tensors += [v.clone() for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
    return tensors


def save_then_resume(workdir: str, async_mode: str) -> dict[str, Any]:
    manager, model, optimizers, schedulers, train_state = build(workdir, async_mode)
    assert manager.load() is False  # nothing saved yet: a fresh start
    for step in range(1, STEPS + 1):
        train_step(model, optimizers, schedulers, step)
        train_state.step = step
        assert manager.save(curr_step=step)
    manager.maybe_wait_for_saving()
    saved = snapshot(model, optimizers)
    lr_saved = schedulers.schedulers[0].get_last_lr()
    uninterrupted = [train_step(model, optimizers, schedulers, STEPS + i) for i in range(1, MORE_STEPS + 1)]
    manager.close()
    dist.barrier()

    manager, model, optimizers, schedulers, train_state = build(workdir, async_mode)  # the restart
    assert manager.load() is True
    loaded = snapshot(model, optimizers)
    lr_loaded = schedulers.schedulers[0].get_last_lr()
    resumed = [train_step(model, optimizers, schedulers, STEPS + i) for i in range(1, MORE_STEPS + 1)]
    manager.close()
    folder = os.path.join(workdir, "ckpt")
    return {
        "same_tensors": len(saved) == len(loaded)
        and all(torch.equal(a, b) for a, b in zip(saved, loaded, strict=True)),
        "tensor_count": len(saved),
        "train_state_step": train_state.step,
        "same_lr": lr_saved == lr_loaded,
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "steps_on_disk": sorted(os.listdir(folder)),
        "step_files": sorted(os.listdir(os.path.join(folder, f"step-{STEPS}"))),
    }


def run(rank: int, world: int, init_file: str, workdir: str, async_mode: str) -> None:
    report_rank(rank, world, init_file, workdir, lambda: save_then_resume(workdir, async_mode))


def load_damaged(workdir: str) -> dict[str, Any]:
    """A restart whose newest checkpoint has a flipped byte: the load must fail, naming it."""
    from torch.distributed.checkpoint.api import CheckpointException

    manager, *_ = build(workdir, "disabled")
    try:
        manager.load()
    except (Exception, CheckpointException) as e:  # DCP's wrapper of every rank's error is a BaseException
        return {"raised": type(e).__name__, "message": repr(e) + repr(getattr(e, "failures", ""))}
    finally:
        manager.close()
    return {"raised": None}


def run_damaged(rank: int, world: int, init_file: str, workdir: str) -> None:
    report_rank(rank, world, init_file, workdir, lambda: load_damaged(workdir))
