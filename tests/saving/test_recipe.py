"""The documented per-iteration recipe (docs/overlap.md) on models whose forward pass changes
state in place: every due step commits, and resuming from any committed step is bit-exact."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import fastpersist as fp
from fastpersist.integrations import guard_optimizer

from training import TinyGPT


class ConvBN(nn.Module):
    """A small conv net with BatchNorm: its forward updates running stats in place."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _conv_loss(model: nn.Module) -> torch.Tensor:
    x = torch.randn(8, 3, 12, 12)
    y = torch.randint(0, 10, (8,))
    return nn.functional.cross_entropy(model(x), y)


def _gpt_loss(model: nn.Module) -> torch.Tensor:
    batch = torch.randint(0, 64, (4, 17))
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, 64), batch[:, 1:].reshape(-1))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module], torch.Tensor]]] = {
    "convbn": (ConvBN, _conv_loss),
    "transformer": (TinyGPT, _gpt_loss),
}


def _fresh(kind: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = MODELS[kind][0]()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        "step": step,
    }


def _train(kind: str, ck: fp.Checkpointer, model: nn.Module, opt: torch.optim.Optimizer, start: int, stop: int) -> None:
    """The recipe of docs/overlap.md, unchanged."""
    loss_of = MODELS[kind][1]
    handle = guard_optimizer(opt, ck)
    try:
        for step in range(start, stop):
            loss = loss_of(model)  # the save of step-1 is written meanwhile
            loss.backward()
            opt.step()  # waits for that save's staging, via the guard
            opt.zero_grad()
            ck.save(step, _state(model, opt, step))
        ck.wait()
    finally:
        handle.remove()


def _flat(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        out.update({f"opt.{pid}.{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("mode", ["snapshot", "bounded"])
def test_every_step_commits_and_resume_is_bit_exact(workdir: str, kind: str, mode: str) -> None:
    config = None if mode == "snapshot" else fp.Config(chunk_bytes=64 << 10, pool_bytes=128 << 10, queue_depth=2)
    steps = 6
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    ck = fp.Checkpointer(workdir, every=1, keep=steps, config=config)
    model, opt = _fresh(kind, 0)
    model.train()
    _train(kind, ck, model, opt, 0, steps)
    assert ck.steps() == list(range(steps))
    reference = _flat(model, opt)

    for resume_from in (2, 4):
        state = ck.load(resume_from)
        model2, opt2 = _fresh(kind, 123)
        model2.train()
        model2.load_state_dict(state["model"])
        opt2.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        ck2 = fp.Checkpointer(f"{workdir}/resume{resume_from}", every=1, keep=2, config=config)
        _train(kind, ck2, model2, opt2, state["step"] + 1, steps)
        resumed = _flat(model2, opt2)
        assert resumed.keys() == reference.keys()
        for key, value in reference.items():
            assert torch.equal(resumed[key], value), f"{kind} resumed from {resume_from}: {key} differs"
