"""Inside each rank of tests/tools/test_inspect_root.py: 4 ranks as 2 simulated nodes of 2
(``FASTPERSIST_NODE``), each node its own root, saving steps with ``replicas=1``."""

from __future__ import annotations

import os
from typing import Any

import torch

import fastpersist as fp

from gloo import report_rank


def save_steps(rank: int, world: int, init_file: str, workdir: str, sharded: bool, steps: list[int]) -> None:
    import torch.distributed as dist

    node = f"node{rank // 2}"
    os.environ["FASTPERSIST_NODE"] = node

    def compute() -> Any:
        config = fp.Config(chunk_bytes=64 << 10, timeout_s=60)
        root = os.path.join(workdir, node)
        with fp.Checkpointer(
            root, config=config, group=dist.group.WORLD, sharded=sharded, levels=[fp.Partner(replicas=1)]
        ) as ck:
            for step in steps:
                gen = torch.Generator().manual_seed(step * 100 + (rank if sharded else 0))
                ck.save(step, {"w": torch.randn(70_000, generator=gen), "step": step})
                ck.wait()
            dist.barrier()  # every node leader has retired its old steps
            return {"steps": ck.steps()}

    report_rank(rank, world, init_file, workdir, compute)
