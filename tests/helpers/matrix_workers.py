"""Inside each rank of the Checkpointer configuration matrix (tests/test_checkpointer_matrix.py).

For every configuration {replicated, sharded} x {no stripes, stripes shared by the ranks,
per-rank stripes} x {host tensors, tensors a (fake) device copier stages through the arena}, a
first run saves steps 1-3 with ``keep=2``; then a restart (a new
Checkpointer, as a new process would make) resumes from ``latest()``, checks the state bit for
bit, and saves steps 4-5. After each run every rank reports what it sees on its own drives.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist

import fastpersist as fp
from fastpersist.format.manifest import read_manifest
from fastpersist.gpu.copiers import use_copier

from fake_cuda import LaterCopier
from gloo import report_rank

MODES = ("replicated", "sharded")
STRIPES = ("none", "shared", "per-rank")
SOURCES = ("host", "device")
KEEP = 2


def step_state(step: int, rank: int, sharded: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step * 100 + (rank if sharded else 0))
    return {
        "w": torch.randn(70_000, generator=gen),  # spans several 64 KiB chunks and both stripes
        "b": torch.randn(300, generator=gen).to(torch.bfloat16),
        "step": step,
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _stripe_roots(workdir: str, kind: str, rank: int) -> list[str] | None:
    if kind == "none":
        return None
    owner = "all" if kind == "shared" else f"rank{rank}"
    roots = [os.path.join(workdir, f"{owner}-nvme{i}") for i in range(2)]
    for d in roots:
        os.makedirs(d, exist_ok=True)
    return roots


def _referenced(ck: fp.Checkpointer) -> list[str]:
    named = []
    for step in ck.steps():
        top = read_manifest(ck.path(step))
        named += top.stripes
        for shard in top.shards:
            named += read_manifest(os.path.join(ck.path(step), shard)).stripes
    return sorted(named)


def _report(ck: fp.Checkpointer, roots: list[str] | None, rank: int, sharded: bool) -> dict[str, Any]:
    steps = ck.steps()
    loads = {}
    for step in steps:
        got = ck.load(step)
        loads[step] = _same(got, step_state(step, rank, sharded))
    on_disk = sorted(os.path.join(r, n) for r in roots or [] for n in os.listdir(r) if n.endswith(".fpstripe"))
    return {
        "steps": steps,
        "latest": ck.latest(),
        "loads": loads,
        "roots": roots or [],
        "on_disk": on_disk,
        "referenced": _referenced(ck),
    }


def _one_config(rank: int, workdir: str, backend: str, mode: str, kind: str, source: str) -> dict[str, Any]:
    with use_copier(lambda t: True, LaterCopier) if source == "device" else contextlib.nullcontext():
        return _run_config(rank, workdir, backend, mode, kind, source)


def _run_config(rank: int, workdir: str, backend: str, mode: str, kind: str, source: str) -> dict[str, Any]:
    sharded = mode == "sharded"
    base = os.path.join(workdir, f"{mode}-{kind}-{source}")
    roots = _stripe_roots(base, kind, rank)
    cfg = fp.Config(backend=backend, chunk_bytes=64 << 10, pool_bytes=1 << 20, stripes=roots)
    root = os.path.join(base, "root")

    def checkpointer() -> fp.Checkpointer:
        return fp.Checkpointer(root, every=1, keep=KEEP, config=cfg, group=dist.group.WORLD, sharded=sharded)

    ck = checkpointer()
    committed = []
    for step in (1, 2, 3):
        ck.save(step, step_state(step, rank, sharded))
        ck.wait()
        committed.append(step)
    staged_from_device = ck._from_device  # the fake device's tensors went through the arena
    ck.close()  # and the background removal of what retention retired
    dist.barrier()
    first = _report(ck, roots, rank, sharded)
    dist.barrier()
    ck = checkpointer()  # the restart
    resumed = ck.latest()
    state = ck.load()
    resumed_same = _same(state, step_state(resumed or -1, rank, sharded))
    for step in (4, 5):
        ck.save(step, step_state(step, rank, sharded))
        ck.wait()
        committed.append(step)
    ck.close()
    dist.barrier()
    restart = _report(ck, roots, rank, sharded)
    dist.barrier()
    return {
        "committed": committed,
        "staged_from_device": staged_from_device,
        "first": first,
        "resumed": resumed,
        "resumed_same": resumed_same,
        "restart": restart,
    }


def run(rank: int, world: int, init_file: str, workdir: str, backend: str) -> None:
    report_rank(
        rank,
        world,
        init_file,
        workdir,
        lambda: {
            f"{m}/{k}/{src}": _one_config(rank, workdir, backend, m, k, src)
            for m in MODES
            for k in STRIPES
            for src in SOURCES
        },
    )
