"""The in-memory level: does a Checkpointer under /dev/shm save at memory speed?

A ~1 GiB Adam-like state (fp32 parameters + two moments), saved every step by
``fastpersist.Checkpointer(root, every=1, keep=2)`` with `root` on a tmpfs (default: under
/dev/shm). For every save after the first it measures the time from ``ck.save()`` until the
save is committed there and retention is done (``ck.wait()`` returned; the median of all of
them, and of the last half alone: the steady state once the root's files rotate), and compares it with a
warm single-thread memcpy of the same bytes measured in the same run (each tensor's bytes copied
with ``ctypes.memmove`` into one buffer that was faulted in before timing). The target is a
save at >= 0.5x memcpy speed: save time <= 2x memcpy time.

It also prints the save's own phases (flatten/plan, staging, write + fsync, commit) as medians,
and with ``--variants`` repeats the measurement with each suspect turned off in turn
(O_DIRECT, checksums, durability, retention), which is how the time breakdown in
docs/performance.md was found.

With ``--device`` every tensor of the state is a fake device tensor, copied by the fake copy
engine of ``benches/device_staging.py`` (one engine thread): the save stages it straight into
its data file's pages (``Arenas.lease_file``), and is compared, in the same run, with the same
code staging through an anonymous arena and then writing the file from it (the in-place choice
turned off): the step is committed after one copy instead of two.

Run: ``python benches/memory_level.py --gib 1 --saves 16`` (``--device`` for a device state).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

import fastpersist as fp
from fastpersist.format.flatten import flatten


def build(size_bytes: int) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """Parameters and an AdamW whose state_dicts together hold ~size_bytes (3 x 4 bytes/param)."""
    width = 4096
    count = max(1, size_bytes // 12 // (width * 512))
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(512, width, generator=gen) * 0.02) for _ in range(count)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    opt.step()  # materialise exp_avg / exp_avg_sq
    return params, opt


def state_of(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": {f"p{i}": p.detach() for i, p in enumerate(params)}, "optimizer": opt.state_dict(), "step": step}


def memcpy_seconds(state: object, reps: int) -> float:
    """Median seconds of one warm single-thread memcpy of every tensor's bytes into one buffer."""
    blobs = [b for b in flatten(state).blobs if b.nbytes]
    total = sum(b.nbytes for b in blobs)
    dst = torch.empty(total, dtype=torch.uint8)
    dst.fill_(1)  # fault the destination in before timing: the memcpy is warm
    base = dst.data_ptr()
    sources = [(t.data_ptr(), t.numel() * t.element_size()) for t in (b.source_tensor for b in blobs)]
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        offset = 0
        for ptr, n in sources:
            ctypes.memmove(base + offset, ptr, n)
            offset += n
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def run_saves(
    root: str, params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, saves: int, config: fp.Config
) -> dict[str, Any]:
    """Saves `saves` steps into a fresh Checkpointer at `root`; timings of every save but the first."""
    shutil.rmtree(root, ignore_errors=True)
    ck = fp.Checkpointer(root, every=1, keep=2, config=config)
    totals: list[float] = []
    phases: dict[str, list[float]] = {}
    for step in range(saves):
        state = state_of(params, opt, step)
        t = time.perf_counter()
        future = ck.save(step, state)
        assert future is not None
        future.wait_staged()
        staged_s = time.perf_counter() - t
        result = future.wait()
        elapsed = time.perf_counter() - t
        if step == 0:
            continue
        totals.append(elapsed)
        phases.setdefault("until staged", []).append(staged_s)
        for name, seconds in (result.phases or {}).items():
            phases.setdefault(name, []).append(seconds)
        phases.setdefault("until commit", []).append(result.seconds)
    ck.wait()
    shutil.rmtree(root, ignore_errors=True)
    return {
        "median_s": statistics.median(totals),
        "steady_median_s": statistics.median(totals[len(totals) // 2 :]),
        "min_s": min(totals),
        "max_s": max(totals),
        "phases": {k: statistics.median(v) for k, v in phases.items()},
    }


def finish(args: argparse.Namespace, parent: str, results: dict[str, Any]) -> None:
    """Writes `results` to ``--json`` if asked, and removes the root made for the run."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if args.root is None:
        shutil.rmtree(parent, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB")
    parser.add_argument("--saves", type=int, default=16, help="saves per measurement (the first is not counted)")
    parser.add_argument("--root", default=None, help="a directory on a tmpfs (default: a fresh one under /dev/shm)")
    parser.add_argument("--memcpy-reps", type=int, default=5)
    parser.add_argument("--variants", action="store_true", help="also time with each suspect turned off")
    parser.add_argument("--device", action="store_true", help="a fake device state: in place vs through an arena")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.device:
        return device_main(args)

    parent = args.root or tempfile.mkdtemp(prefix="fp-memlevel-", dir="/dev/shm")
    params, opt = build(int(args.gib * 2**30))
    state = state_of(params, opt, 0)
    state_bytes = sum(b.nbytes for b in flatten(state).blobs)
    print(f"state: {state_bytes / 2**30:.2f} GiB in {len(params) * 3} tensors, root under {parent}", file=sys.stderr)
    pool = -(-state_bytes // (8 << 20)) * (8 << 20)

    variants = {"Checkpointer (default config)": fp.Config(pool_bytes=pool)}
    if args.variants:
        variants["  direct_io=off"] = fp.Config(pool_bytes=pool, direct_io="off")
        variants["  checksum=off"] = fp.Config(pool_bytes=pool, checksum="off")
        variants["  durable=False"] = fp.Config(pool_bytes=pool, durable=False)
        variants["  all three off"] = fp.Config(pool_bytes=pool, direct_io="off", checksum="off", durable=False)

    rows: dict[str, Any] = {}
    memcpys = [memcpy_seconds(state, args.memcpy_reps)]
    for name, config in variants.items():
        print(f"{name.strip()} ...", file=sys.stderr, flush=True)
        gc.collect()
        rows[name] = run_saves(os.path.join(parent, "ck"), params, opt, args.saves, config)
        memcpys.append(memcpy_seconds(state, args.memcpy_reps))
    memcpy = statistics.median(memcpys)

    print(f"\nstate {state_bytes / 2**30:.2f} GiB, {args.saves - 1} timed saves each (median), root {parent}")
    print(f"warm single-thread memcpy: {memcpy:.3f} s ({state_bytes / memcpy / 1e9:.2f} GB/s)")
    print(
        f"{'save until committed':32} {'median s':>9} {'min':>7} {'max':>7} {'x memcpy speed':>15}"
        f" {'last half s':>12} {'x memcpy':>9}"
    )
    for name, row in rows.items():
        row["speed_vs_memcpy"] = memcpy / row["median_s"]
        row["steady_speed_vs_memcpy"] = memcpy / row["steady_median_s"]
        print(
            f"{name:32} {row['median_s']:9.3f} {row['min_s']:7.3f} {row['max_s']:7.3f} {row['speed_vs_memcpy']:14.2f}x"
            f" {row['steady_median_s']:12.3f} {row['steady_speed_vs_memcpy']:8.2f}x"
        )
    print("\nphases of the default save (median s):")
    for name, seconds in rows["Checkpointer (default config)"]["phases"].items():
        print(f"  {name:14} {seconds:7.3f}")
    finish(args, parent, {"state_bytes": state_bytes, "memcpy_s": memcpy, "rows": rows})
    return 0


def device_main(args: argparse.Namespace) -> int:
    """``--device``: the state staged by a fake copy engine, into the file vs through an arena."""
    import contextlib
    from unittest import mock

    import device_staging  # benches/, beside this script

    from fastpersist.gpu.arenas import ARENAS
    from fastpersist.gpu.copiers import use_copier

    parent = args.root or tempfile.mkdtemp(prefix="fp-memlevel-", dir="/dev/shm")
    params, opt = build(int(args.gib * 2**30))
    state = state_of(params, opt, 0)
    state_bytes = sum(b.nbytes for b in flatten(state).blobs)
    torch.set_num_threads(1)  # the fake engine copies on one thread, as device_staging.py's does
    device_staging.ThreadCopier.engine = device_staging._CopyEngine()
    variants = {
        "staged into the file (default)": contextlib.nullcontext(),
        "through an arena, then written": mock.patch("fastpersist.saving.job.file_to_stage_in", lambda *a, **k: None),
    }
    rows: dict[str, Any] = {}
    memcpys = [memcpy_seconds(state, args.memcpy_reps)]
    for _ in range(2):  # interleaved, twice
        for name, switch in variants.items():
            print(f"{name} ...", file=sys.stderr, flush=True)
            ARENAS.clear()
            gc.collect()
            with switch, use_copier(lambda t: True, device_staging._factory):
                row = run_saves(os.path.join(parent, "ck"), params, opt, args.saves, fp.Config())
            rows.setdefault(name, []).append(row)
            memcpys.append(memcpy_seconds(state, args.memcpy_reps))
    memcpy = statistics.median(memcpys)
    print(f"\nfake device state {state_bytes / 2**30:.2f} GiB, {args.saves - 1} timed saves per run (median)")
    print(f"warm single-thread memcpy: {memcpy:.3f} s ({state_bytes / memcpy / 1e9:.2f} GB/s)")
    print(f"{'device save':32} {'run':>4} {'staged s':>9} {'committed s':>12} {'x memcpy':>9} {'last half s':>12}")
    for name, runs in rows.items():
        for i, row in enumerate(runs):
            print(
                f"{name:32} {i + 1:4} {row['phases']['until staged']:9.3f} {row['median_s']:12.3f}"
                f" {memcpy / row['median_s']:8.2f}x {row['steady_median_s']:12.3f}"
            )
    finish(args, parent, {"state_bytes": state_bytes, "memcpy_s": memcpy, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
