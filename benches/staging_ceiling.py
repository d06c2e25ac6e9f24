"""The engine's ceiling on host staging: saves with 1, 2, ... staging threads against a memcpy on
as many threads, and a fresh process's first save against its second (docs/performance.md,
"Host staging on every core").

``--part threads``: for each thread count t up to the cores this process may use, interleaved
round by round (medians of ``--reps``, after one warm-up of each):

* ``null sink``: ``fp.save``'s job into the engine's null sink (no byte written: the copy into
  the pool and its crc32c are the whole cost) with ``Config(staging_threads=t)``;
* ``memory level``: a ``Checkpointer(every=1, keep=2)`` whose root is on ``--shm`` (the in-memory
  level: the bytes are copied straight into the step's mapped data files), from ``ck.save()``
  until ``ck.wait()`` returned, in the steady state;
* ``memcpy``: the same bytes copied by t threads (each ``np.copyto`` of an equal share, the GIL
  released) into memory faulted in before timing.

``--part first``: ``--procs`` fresh processes each save the same state twice with ``fp.save``,
to ``--dir`` and to ``--shm``, and report both times; the ratio first/second is the one-time
cost a process pays (the pool's first touch). Each place is measured plain and with
``fp.prepare(dir)`` called before the state is built (as a script would before its model).

Run: ``python benches/staging_ceiling.py --size 1GiB --reps 5`` (``--part threads`` or
``--part first`` for one part; ``--json`` for the raw numbers).
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
import threading
import time
from typing import Any

import numpy as np

import fastpersist as fp
from fastpersist.format.flatten import flatten
from fastpersist.tools.bench.nullsink import null_sink_save
from fastpersist.tools.bench.state import build_state
from fastpersist.tools.units import parse_size

#: The steady-state saves of the memory level measured per thread count and round.
MEMORY_SAVES = 3


def memcpy_threads_seconds(sources: list[np.ndarray], dest: np.ndarray, threads: int) -> float:
    """Seconds for `threads` threads to copy every source (1-D uint8 views, back to back) into
    `dest` (faulted in), each thread an equal contiguous share of the bytes."""
    total = dest.nbytes
    share = -(-total // threads)
    pieces: list[list[tuple[np.ndarray, int]]] = [[] for _ in range(threads)]
    offset = 0
    for data in sources:
        done = 0
        while done < data.nbytes:
            at = offset + done
            worker = at // share
            n = min(data.nbytes - done, (worker + 1) * share - at)
            pieces[worker].append((data[done : done + n], at))
            done += n
        offset += data.nbytes

    def copy(mine: list[tuple[np.ndarray, int]]) -> None:
        for data, at in mine:
            np.copyto(dest[at : at + data.nbytes], data)

    workers = [threading.Thread(target=copy, args=(mine,)) for mine in pieces[1:]]
    start = time.perf_counter()
    for w in workers:
        w.start()
    copy(pieces[0])
    for w in workers:
        w.join()
    return time.perf_counter() - start


def memory_level_seconds(ck: fp.Checkpointer, state: object, step: int) -> float:
    """One steady-state save of the memory level: from ``ck.save`` until it committed and retired."""
    start = time.perf_counter()
    ck.save(step, state)
    ck.wait()
    return time.perf_counter() - start


def part_threads(args: argparse.Namespace) -> dict[str, Any]:
    state = build_state(args.size)
    sources = [b.data for b in flatten(state).blobs]
    total = sum(s.nbytes for s in sources)
    dest = np.ones(total, dtype=np.uint8)
    cores = len(os.sched_getaffinity(0))
    counts = list(range(1, cores + 1))
    shm = tempfile.mkdtemp(prefix="fp-ceiling-", dir=args.shm)
    checkpointers = {
        t: fp.Checkpointer(os.path.join(shm, f"t{t}"), every=1, keep=2, config=fp.Config(staging_threads=t))
        for t in counts
    }
    steps = dict.fromkeys(counts, 0)
    times: dict[str, dict[int, list[float]]] = {k: {t: [] for t in counts} for k in ("null", "memory", "memcpy")}
    try:
        for rnd in range(args.reps + 1):
            for t in counts:
                null = null_sink_save(state, args.dir, staging_threads=t)["seconds"]
                memory = []
                for _ in range(MEMORY_SAVES if rnd else 4):  # the first round fills the root's rotation
                    steps[t] += 1
                    memory.append(memory_level_seconds(checkpointers[t], state, steps[t]))
                copy = memcpy_threads_seconds(sources, dest, t)
                if rnd:
                    times["null"][t].append(null)
                    times["memory"][t] += memory
                    times["memcpy"][t].append(copy)
    finally:
        for ck in checkpointers.values():
            ck.close()
        shutil.rmtree(shm, ignore_errors=True)
    rows = []
    for t in counts:
        med = {k: statistics.median(times[k][t]) for k in times}
        rows.append(
            {
                "threads": t,
                **{f"{k}_s": v for k, v in med.items()},
                **{f"{k}_gb_per_s": total / v / 1e9 for k, v in med.items()},
            }
        )
    best_copy = min(r["memcpy_s"] for r in rows)
    top = rows[-1]
    return {
        "bytes": total,
        "reps": args.reps,
        "cores": cores,
        "rows": rows,
        "null_scaling_1_to_2": rows[0]["null_s"] / rows[1]["null_s"] if len(rows) > 1 else None,
        "memory_vs_memcpy_all_cores": best_copy / top["memory_s"],
    }


FIRST_SAVE = r"""
import json, os, shutil, sys, time
import fastpersist as fp
from fastpersist.tools.bench.state import build_state
size, prepared, dirs = int(sys.argv[1]), sys.argv[2] == "prepare", sys.argv[3:]
if prepared:
    for d in dirs:
        fp.prepare(d)  # as a training script would, before it builds its model
state = build_state(size)
out = {}
for d in dirs:
    seconds = []
    for i in range(2):
        path = os.path.join(d, f"save{i}")
        start = time.perf_counter()
        fp.save(state, path)
        seconds.append(time.perf_counter() - start)
    for i in range(2):
        shutil.rmtree(os.path.join(d, f"save{i}"))
    out[d] = seconds
print(json.dumps(out))
"""


def part_first(args: argparse.Namespace) -> dict[str, Any]:
    places = {"disk": tempfile.mkdtemp(prefix="fp-first-", dir=args.dir)}
    if args.shm:
        places["memory"] = tempfile.mkdtemp(prefix="fp-first-", dir=args.shm)
    runs: dict[str, list[list[float]]] = {f"{k}{how}": [] for k in places for how in ("", ", fp.prepare ahead")}
    try:
        for _ in range(args.procs):
            # One fresh process per place and way, interleaved.
            for name, where in places.items():
                for how in ("", ", fp.prepare ahead"):
                    mode = "prepare" if how else "plain"
                    done = subprocess.run(
                        [sys.executable, "-c", FIRST_SAVE, str(args.size), mode, where],
                        check=True,
                        capture_output=True,
                        text=True,
                    )
                    runs[f"{name}{how}"].append(json.loads(done.stdout.strip().splitlines()[-1])[where])
    finally:
        for where in places.values():
            shutil.rmtree(where, ignore_errors=True)
    result: dict[str, Any] = {"procs": args.procs}
    for name, pairs in runs.items():
        first = statistics.median(p[0] for p in pairs)
        second = statistics.median(p[1] for p in pairs)
        result[name] = {"first_s": first, "second_s": second, "ratio": first / second, "runs": pairs}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=1 << 30)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--procs", type=int, default=5, help="fresh processes for --part first")
    parser.add_argument("--part", choices=["threads", "first", "all"], default="all")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="the disk directory")
    parser.add_argument("--shm", default="/dev/shm" if os.path.isdir("/dev/shm") else "", help="a tmpfs directory")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out: dict[str, Any] = {"size": args.size}
    if args.part in ("threads", "all"):
        out["threads"] = part_threads(args)
    if args.part in ("first", "all"):
        out["first"] = part_first(args)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    gib = args.size / (1 << 30)
    if "threads" in out:
        t = out["threads"]
        print(f"{gib:.2f} GiB host state, {t['cores']} cores, medians of {t['reps']} rounds")
        print(f"{'threads':>7} {'null sink s':>12} {'GB/s':>6} {'memory s':>9} {'GB/s':>6} {'memcpy s':>9} {'GB/s':>6}")
        for r in t["rows"]:
            print(
                f"{r['threads']:>7} {r['null_s']:>12.3f} {r['null_gb_per_s']:>6.2f} {r['memory_s']:>9.3f} "
                f"{r['memory_gb_per_s']:>6.2f} {r['memcpy_s']:>9.3f} {r['memcpy_gb_per_s']:>6.2f}"
            )
        if t["null_scaling_1_to_2"] is not None:
            print(f"null sink, 1 -> 2 threads: {t['null_scaling_1_to_2']:.2f}x (target >= 1.7x)")
        ratio = t["memory_vs_memcpy_all_cores"]
        print(f"memory level on every core vs the fastest memcpy: {ratio:.2f}x (target >= 0.8x)")
    if "first" in out:
        f = out["first"]
        for name, r in f.items():
            if name != "procs":
                print(
                    f"first save of a fresh process, {name}: {r['first_s']:.3f} s, second {r['second_s']:.3f} s, "
                    f"{r['ratio']:.2f}x (target <= 1.2x; medians of {f['procs']} processes)"
                )


if __name__ == "__main__":
    main()
