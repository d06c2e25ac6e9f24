"""A process that makes the first save of each of a series of fresh paths, in step with another."""

from __future__ import annotations

import os
from typing import Any

import torch

import fastpersist as fp


def state_of(worker: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(worker)
    return {"w": torch.randn(64 << 10, generator=gen), "worker": worker}


def save_rounds(worker: int, root: str, rounds: int, barrier: Any, results: Any) -> None:
    """Saves `state_of(worker)` to root/ck-i for each round, after a barrier with the other process."""
    outcomes = []
    state = state_of(worker)
    config = fp.Config(backend=os.environ.get("RACE_BACKEND", "auto"), chunk_bytes=64 << 10)
    for i in range(rounds):
        barrier.wait(60)
        try:
            fp.save(state, os.path.join(root, f"ck-{i}"), config=config)
            outcomes.append("ok")
        except Exception as e:
            outcomes.append(f"{type(e).__name__}: {e}")
    results.put((worker, outcomes))
