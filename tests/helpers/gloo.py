"""Runs a worker function on real gloo process groups: `world` spawned local processes."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import pytest

#: tests/helpers/, where the worker modules live; spawned children must be able to import them.
HELPERS_DIR = os.path.dirname(os.path.abspath(__file__))
#: The repository (its docs/, README.md and benches/).
REPO_DIR = os.path.dirname(os.path.dirname(HELPERS_DIR))


def run_ranks(
    target: Callable[..., None], world: int, args: tuple[Any, ...], workdir: str, timeout_s: float = 120
) -> list[dict[str, Any]]:
    """Runs ``target(rank, world, init_file, *args)`` on `world` spawned ranks.

    Each rank writes ``result-{rank}.json`` (or ``error-{rank}.txt``) into `workdir`. Returns
    each rank's result, or ``{"exitcode", "traceback"}`` for a rank that wrote none. Fails the
    test if a rank is still running after `timeout_s`.
    """
    ctx = multiprocessing.get_context("spawn")
    if HELPERS_DIR not in sys.path:
        sys.path.insert(0, HELPERS_DIR)
    init_file = os.path.join(workdir, "init-store")
    procs = [ctx.Process(target=target, args=(r, world, init_file, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    for rank, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            pytest.fail(f"rank {rank} hung for {timeout_s} s")
    results = []
    for rank in range(world):
        result, error = os.path.join(workdir, f"result-{rank}.json"), os.path.join(workdir, f"error-{rank}.txt")
        if os.path.exists(result):
            with open(result) as f:
                results.append(json.load(f))
        else:
            traceback = open(error).read() if os.path.exists(error) else ""
            results.append({"exitcode": procs[rank].exitcode, "traceback": traceback})
    return results


def report_rank(
    rank: int, world: int, init_file: str, workdir: str, compute: Callable[[], Any], *, destroy: bool = True
) -> None:
    """The rank's side of :func:`run_ranks`: joins the gloo group, runs `compute`, and writes its
    result as ``result-{rank}.json`` or its traceback as ``error-{rank}.txt`` (then re-raises).
    `destroy=False` leaves the group as it is (a scenario whose rank is killed)."""
    import torch.distributed as dist

    from netguard import guard_sockets

    guard_sockets()  # a rank reaches nothing beyond this machine either (tests/helpers/netguard.py)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = compute()
        with open(os.path.join(workdir, f"result-{rank}.json"), "w") as f:
            json.dump(result, f)
    except BaseException:
        with open(os.path.join(workdir, f"error-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if destroy:
            dist.destroy_process_group()
