"""Cold loads against their peers, and a fresh process's first saves against its later ones
(issue 59's bench).

``--part load``: one state of ``--total`` bytes in tensors of each ``--shapes`` size (float32),
saved once by each writer; then, ``--reps`` rounds, each writer's file read cold (the page cache
dropped, or the files evicted where that is refused), writers rotated from round to round:

* ``fp.load``: into fresh tensors; ``fp.load(out=)``: into tensors that exist already;
* ``torch.load`` of a ``torch.save`` file (``weights_only=True``, ``mmap=False``);
* ``safetensors.torch.load_file`` of the same state.

Each timed call ends with one float read from every 4 KiB page of the result (safetensors maps
its file and reads it lazily: the touch makes it read). Per writer and shape: the median
seconds, its ratio to the best peer's median (below 1 beats every peer), and the spread (the
slowest round / the median: a restart that is sometimes 2x slower is a slow restart).

    python benches/cold.py --part load --total 1GiB --shapes 1GiB,4MiB,512KiB,64KiB --reps 5

``--part first``: ``--procs`` fresh processes per way of saving, interleaved, each saving one
``--total`` Adam-like state ``--saves`` times with ``--step-s`` seconds of "training" (a sleep:
on a GPU node the host's cores are mostly idle during a step) before each save, as the README's
quickstart does it, no other call: ``fp.save``; ``fp.save_async(...).result()``; a
``Checkpointer`` on ``--dir`` and one on ``--shm`` (``keep=2``: its memory level), each
``ck.save(step, state).result()``. Each save is timed to durable; per way, the median over the
processes of each save's seconds, and each of the first three against the steady save (the
median of the saves after them): the targets are the first save at most 1.2x the steady one on
disk, and each of the first three memory-level saves at most 1.5x.

    python benches/cold.py --part first --total 1GiB --procs 5 --saves 6
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import fastpersist as fp
from fastpersist.tools.bench.system import drop_caches, evict_files
from fastpersist.tools.units import parse_size

WRITERS = ("fp.load", "fp.load(out=)", "torch.load", "safetensors")


def state_of(total: int, each: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    count = max(1, total // each)
    return {f"t{i:06d}": torch.randn(each // 4, generator=g) for i in range(count)}


def touch(state: dict[str, torch.Tensor]) -> float:
    """Reads one float of every 4 KiB page of every tensor: a loader that maps its file lazily
    (safetensors does) pays its reads here, inside the timed call, as a training step would."""
    return float(sum(float(t.view(-1)[::1024].sum()) for t in state.values()))


def loaders(root: str, state: dict[str, torch.Tensor]) -> dict[str, Callable[[], Any]]:
    from safetensors.torch import load_file, save_file

    ck, pt, st = (os.path.join(root, n) for n in ("ck", "state.pt", "state.safetensors"))
    fp.save(state, ck)
    torch.save(state, pt)
    save_file(state, st)
    out = {k: torch.empty_like(v) for k, v in state.items()}
    return {
        "fp.load": lambda: fp.load(ck),
        "fp.load(out=)": lambda: fp.load(ck, out=out) and out,
        "torch.load": lambda: torch.load(pt, weights_only=True),
        "safetensors": lambda: load_file(st),
    }


def part_load(args: argparse.Namespace, root: str) -> None:
    total = parse_size(args.total)
    print(f"{'tensors':>16} {'writer':<14} {'median s':>9} {'vs best':>8} {'slowest/median':>15}")
    for shape in args.shapes.split(","):
        each = parse_size(shape)
        where = tempfile.mkdtemp(dir=root)
        runs = loaders(where, state_of(total, each))
        times: dict[str, list[float]] = {w: [] for w in runs}
        order = list(runs)
        for rep in range(args.reps):
            for name in order[rep % len(order) :] + order[: rep % len(order)]:
                if not drop_caches():
                    evict_files([where])
                start = time.perf_counter()
                result = runs[name]()
                touch(result)
                times[name].append(time.perf_counter() - start)
                del result
        medians = {w: statistics.median(t) for w, t in times.items()}
        label = f"{total // each} x {shape}"
        for w, t in times.items():
            best_peer = min(m for o, m in medians.items() if o != w)
            print(f"{label:>16} {w:<14} {medians[w]:9.3f} {medians[w] / best_peer:7.2f}x {max(t) / medians[w]:14.2f}x")
        shutil.rmtree(where)


FIRST_SAVES = r"""
import json, os, shutil, sys, time
import fastpersist as fp
from fastpersist.tools.bench.state import build_state
how, size, where, saves, step_s = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
state = build_state(size)
ck = fp.Checkpointer(where, keep=2) if how.startswith("Checkpointer") else None
seconds = []
for i in range(saves):
    time.sleep(step_s)
    path = os.path.join(where, f"save{i}")
    start = time.perf_counter()
    if how == "fp.save":
        fp.save(state, path)
    elif how == "save_async":
        fp.save_async(state, path).result()
    else:
        ck.save(i, state).result()
    seconds.append(time.perf_counter() - start)
    if ck is None and i >= 2:
        shutil.rmtree(os.path.join(where, f"save{i - 2}"))  # keep=2, as the Checkpointer does
if ck is not None:
    ck.close()
print(json.dumps(seconds))
"""

FIRST_WAYS = ("fp.save", "save_async", "Checkpointer", "Checkpointer, memory")


def part_first(args: argparse.Namespace, root: str) -> None:
    total = parse_size(args.total)
    ways = [w for w in FIRST_WAYS if args.shm or not w.endswith("memory")]
    runs: dict[str, list[list[float]]] = {w: [] for w in ways}
    for _ in range(args.procs):
        for way in ways:
            where = tempfile.mkdtemp(prefix="fp-first-", dir=args.shm if way.endswith("memory") else root)
            try:
                done = subprocess.run(
                    [sys.executable, "-c", FIRST_SAVES, way, str(total), where, str(args.saves), str(args.step_s)],
                    check=True,
                    capture_output=True,
                    text=True,
                )
            finally:
                shutil.rmtree(where, ignore_errors=True)
            runs[way].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{total / (1 << 30):.2f} GiB state, medians of {args.procs} fresh processes, {args.step_s} s between saves")
    print(f"{'way':<22} {'save 1..n, s':<48} {'steady s':>9} {'1st':>6} {'2nd':>6} {'3rd':>6}")
    for way, per_proc in runs.items():
        each = [statistics.median(p[i] for p in per_proc) for i in range(args.saves)]
        steady = statistics.median(each[3:]) if len(each) > 3 else each[-1]
        ratios = " ".join(f"{t / steady:5.2f}x" for t in each[:3])
        print(f"{way:<22} {' '.join(f'{t:.3f}' for t in each):<48} {steady:9.3f} {ratios}")
    print(json.dumps({"total": total, "step_s": args.step_s, "runs": runs}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["load", "first"], default="load")
    parser.add_argument("--total", default="1GiB", help="bytes of each state (default 1GiB)")
    parser.add_argument("--shapes", default="1GiB,1MiB,512KiB,4KiB", help="tensor sizes, comma-separated")
    parser.add_argument("--reps", type=int, default=5, help="rounds, medians reported (default 5)")
    parser.add_argument("--dir", default="/var/tmp", help="where the files go (default /var/tmp)")
    parser.add_argument("--shm", default="/dev/shm" if os.path.isdir("/dev/shm") else "", help="a tmpfs directory")
    parser.add_argument("--procs", type=int, default=5, help="fresh processes per way (--part first)")
    parser.add_argument("--saves", type=int, default=6, help="saves per process (--part first)")
    parser.add_argument("--step-s", type=float, default=0.5, help="seconds of 'training' before each save")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="fp-cold-", dir=args.dir)
    print(f"load average (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    try:
        (part_first if args.part == "first" else part_load)(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
