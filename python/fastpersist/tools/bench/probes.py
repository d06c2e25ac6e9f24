"""The two measurements outside the timed methods: flatten+plan of a 10,000-tensor state, and the
peak RSS a bounded-pool save adds (measured in a fresh ``python -m fastpersist.tools.bench --rss-probe``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import fastpersist as fp
import fastpersist._core as _core

from ...format.flatten import flatten
from ...format.nativewalk import NATIVE_WALK
from ...gpu.early import choose_early_copies
from .state import build_small_state, build_state, state_summary
from .system import MiB, remove_path, reset_peak_rss, status_bytes

RSS_SLACK_BYTES = 64 * MiB  # the RSS budget of a bounded save is pool_bytes + this


def flatten_plan_seconds(
    tensor_count: int = 10_000, runs: int = 7, chunk_bytes: int = 8 << 20, compare: bool = True
) -> dict[str, Any]:
    """Times ``flatten`` + ``_core.Plan`` of a `tensor_count`-tensor state (median of `runs`, after a warm-up).

    ``walk`` says which walk `flatten` used: "native" (``_core.flatten_walk``), or "python" on a
    build of ``_core`` without it. With `compare`, the Python walk alone (``native=False``, the
    reference) is timed too, interleaved run by run: ``python_median_s``, ``python_min_s``.

    Example:
        >>> r = flatten_plan_seconds(1000, runs=3)
        >>> r["tensors"], r["walk"], r["python_median_s"] > 0
        (1000, 'native', True)
    """

    state = build_small_state(tensor_count)
    walks = [True, False] if compare and NATIVE_WALK is not None else [NATIVE_WALK is not None]
    samples: dict[bool, list[float]] = {native: [] for native in walks}
    cpu: list[float] = []
    reads: list[float] = []
    tensors = 0
    for i in range(runs + 1):
        leaves = flatten(state).leaves
        read_start = time.perf_counter()
        _read_walk_attributes(leaves)
        read_seconds = time.perf_counter() - read_start
        del leaves
        for native in walks:
            seconds, cpu_seconds, tensors = _flatten_plan_once(state, native, chunk_bytes)
            if i:
                samples[native].append(seconds)
                if native is walks[0]:
                    cpu.append(cpu_seconds)
        if i:
            reads.append(read_seconds)
    timed = samples[walks[0]]
    result: dict[str, Any] = {
        "tensors": tensors,
        "runs": runs,
        "walk": "native" if walks[0] else "python",
        "seconds": timed,
        "median_s": statistics.median(timed),
        "min_s": min(timed),
        "max_s": max(timed),
        "cpu_median_s": statistics.median(cpu),
        "attribute_reads_median_s": statistics.median(reads),
    }
    if len(walks) > 1:
        result["python_seconds"] = samples[False]
        result["python_median_s"] = statistics.median(samples[False])
        result["python_min_s"] = min(samples[False])
    return result


def _flatten_plan_once(state: object, native: bool, chunk_bytes: int) -> tuple[float, float, int]:
    """``(seconds, CPU seconds, tensor count)`` of one flatten + plan."""

    cpu_start = time.process_time()
    start = time.perf_counter()
    flat = flatten(state, native=native)
    plan = _core.Plan([b.nbytes for b in flat.blobs], 1, 1, chunk_bytes)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    assert plan.total_bytes > 0
    return seconds, cpu_seconds, len(flat.tensors)


def _read_walk_attributes(tensors: list[Any]) -> None:
    """Reads, in a bare loop, the 17 torch attributes the walk reads of each common tensor: the
    part of flatten's cost that is torch's own Python entry points, not the walk's logic."""
    for x in tensors:
        _ = (x.layout, x.dtype, x.is_cpu, x.is_nested, x.shape, x.requires_grad, x._version, x.__dict__)
        _ = (x.dim(), x.is_neg(), x.is_conj(), x.numel(), x.storage_offset(), x.data_ptr())
        _ = (x.is_contiguous(), x.stride(), x.element_size())


def rss_probe(
    total_bytes: int, dirs: Sequence[str], chunk_bytes: int, pool_bytes: int, queue_depth: int
) -> dict[str, Any]:
    """Builds the state, then reports how much a bounded-pool ``fastpersist.save`` raises the peak RSS.

    Runs in a fresh process (``python -m fastpersist.tools.bench --rss-probe ...``) so that nothing
    else has touched the pool or the heap. The peak (VmHWM) is reset just before the save where
    the kernel allows it (``/proc/self/clear_refs``), else the delta is against the earlier peak.
    """

    state = build_state(total_bytes)
    nbytes = state_summary(state)["bytes"]
    gc.collect()
    # Bounded mode needs a pool smaller than the state: shrink it for tiny states.
    while chunk_bytes > 64 << 10 and 4 * chunk_bytes > nbytes:
        chunk_bytes //= 2
    if pool_bytes >= nbytes:
        pool_bytes = max(2 * chunk_bytes, nbytes // 4 // chunk_bytes * chunk_bytes)
    config = fp.Config(
        chunk_bytes=chunk_bytes,
        pool_bytes=pool_bytes,
        queue_depth=queue_depth,
        stripes=list(dirs) if len(dirs) > 1 else None,
    )
    path = os.path.join(dirs[0], "rss-probe-ckpt")
    early_count, early_bytes = early_copy_bytes(state)
    gc.collect()
    rss_before = status_bytes("VmRSS")
    hwm_before = status_bytes("VmHWM")
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    reset = reset_peak_rss()
    start = time.perf_counter()
    result = fp.save(state, path, config=config)
    seconds = time.perf_counter() - start
    hwm_after = status_bytes("VmHWM")
    rss_after = status_bytes("VmRSS")  # mostly the pool's slots the save touched: kept for the next save
    maxrss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    remove_path(path)
    base = rss_before if reset else hwm_before
    delta = max(0, hwm_after - base)
    budget = pool_bytes + RSS_SLACK_BYTES
    return {
        "state_bytes": nbytes,
        "pool_bytes": pool_bytes,
        "chunk_bytes": chunk_bytes,
        "mode": "bounded" if pool_bytes < nbytes else "snapshot",
        "seconds": seconds,
        "backend": result.backend,
        "rss_before_bytes": rss_before,
        "hwm_before_bytes": hwm_before,
        "hwm_after_bytes": hwm_after,
        "rss_after_bytes": rss_after,
        # fp.save waits, so it makes no early copy (saving/start.py); save_async would hold this too.
        "async_early_copy_tensors": early_count,
        "async_early_copy_bytes": early_bytes,
        "ru_maxrss_before_bytes": maxrss_before,
        "ru_maxrss_after_bytes": maxrss_after,
        "hwm_reset": reset,
        "delta_bytes": delta,
        "budget_bytes": budget,
        "within_budget": delta <= budget,
    }


def early_copy_bytes(state: object) -> tuple[int, int]:
    """How many tensors, and bytes, of `state` the mutation guard of a ``save_async`` copies before
    it returns (the early copy: watched tensors of at most 1 MiB, smallest first, up to 64 MiB in
    all; docs/overlap.md): memory such a save holds on top of its pool until it ends.

    Example:
        >>> import torch
        >>> early_copy_bytes({"a": torch.zeros(4), "b": torch.zeros(1 << 20)})
        (1, 16)
    """

    blobs = flatten(state).blobs
    chosen = choose_early_copies(blobs)
    return len(chosen), sum(blobs[i].nbytes for i in chosen)


def run_rss_probe_subprocess(args: argparse.Namespace, dirs: Sequence[str]) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "fastpersist.tools.bench",
        "--rss-probe",
        "--size",
        str(args.size),
        "--chunk-bytes",
        str(args.chunk_bytes),
        "--pool-bytes",
        str(args.pool_bytes),
        "--queue-depth",
        str(args.queue_depth),
    ]
    for d in dirs:
        command += ["--dir", d]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": (done.stderr.strip() or done.stdout.strip())[-2000:]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
