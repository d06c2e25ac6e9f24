"""Inside each rank of the partner-level tests (tests/test_levels.py): 4 ranks as 2 simulated
nodes of 2 (``FASTPERSIST_NODE``), each node its own root."""

from __future__ import annotations

import os
from typing import Any

import torch

import fastpersist as fp

from gloo import report_rank

CONFIG = fp.Config(chunk_bytes=64 << 10, timeout_s=60)


def node_of(rank: int) -> str:
    return f"node{rank // 2}"


def node_root(workdir: str, rank: int) -> str:
    return os.path.join(workdir, node_of(rank))


def step_state(step: int, rank: int, sharded: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step * 100 + (rank if sharded else 0))
    return {
        "w": torch.randn(70_000, generator=gen),
        "b": torch.randn(300, generator=gen).to(torch.bfloat16),
        "step": step,
        "rank": rank if sharded else -1,
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def checkpointer(workdir: str, rank: int, sharded: bool, replicas: int = 1, keep: int = 2) -> fp.Checkpointer:
    import torch.distributed as dist

    return fp.Checkpointer(
        node_root(workdir, rank),
        every=1,
        keep=keep,
        config=CONFIG,
        group=dist.group.WORLD,
        sharded=sharded,
        replicas=replicas,
    )


def save_steps(rank: int, world: int, init_file: str, workdir: str, sharded: bool, steps: list[int]) -> None:
    import torch.distributed as dist

    os.environ["FASTPERSIST_NODE"] = node_of(rank)

    def compute() -> Any:
        with checkpointer(workdir, rank, sharded) as ck:
            for step in steps:
                ck.save(step, step_state(step, rank, sharded))
                ck.wait_staged()
            ck.wait()
            dist.barrier()  # every node leader has retired its old steps
            return {"steps": ck.steps(), "levels": ck.levels()}

    report_rank(rank, world, init_file, workdir, compute)


def restore(rank: int, world: int, init_file: str, workdir: str, sharded: bool) -> None:
    os.environ["FASTPERSIST_NODE"] = node_of(rank)

    def compute() -> Any:
        ck = checkpointer(workdir, rank, sharded)
        latest = ck.latest()
        state = ck.load()
        step = int(state["step"])
        return {"latest": latest, "step": step, "same": same(state, step_state(step, rank, sharded))}

    report_rank(rank, world, init_file, workdir, compute)
