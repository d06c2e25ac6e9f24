"""Reads shared across ranks: 1, 2 and 4 local gloo ranks load one replicated checkpoint.

The checkpoint is saved once by one process. Each rank then loads it with ``group=`` in turns:
``shared_read=True`` (each rank reads ~1/N of the stream from disk, the ranks broadcast their
runs over gloo) and ``shared_read=False`` (every rank reads the whole stream), interleaved rep
by rep. The table shows the bytes each rank read from disk, the median wall time (slowest rank,
between barriers) and the aggregate rate: bytes of state delivered to all ranks per second
(``ranks x stream bytes / wall``). Reads use O_DIRECT, so the page cache does not help.

Run: ``python benches/group_load.py --size 1GiB --ranks 1 2 4 --reps 3``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from fastpersist.tools.units import parse_size

MODES = {"shared": True, "whole": False}


def _state(size_bytes: int) -> dict[str, Any]:
    from fastpersist.tools.bench.state import build_state

    return build_state(size_bytes)  # seeded: the same state on every rank


def _count_reads() -> dict[str, int]:
    """Counts stream bytes this process reads from disk (shared runs and whole-stream reads)."""
    import fastpersist.loading.pipeline
    import fastpersist.loading.shared_read

    counts = {"bytes": 0}
    read_window, read_stream = fastpersist.loading.shared_read.read_window, fastpersist.loading.pipeline.read_stream

    def counted_window(root: str, m: Any, lo: int, hi: int, *args: Any) -> None:
        counts["bytes"] += hi - lo
        read_window(root, m, lo, hi, *args)

    def counted_stream(root: str, m: Any, *args: Any) -> Any:
        counts["bytes"] += m.total_bytes
        return read_stream(root, m, *args)

    fastpersist.loading.shared_read.read_window = counted_window  # type: ignore[assignment]
    fastpersist.loading.pipeline.read_stream = counted_stream  # type: ignore[assignment]
    return counts


def _rank(rank: int, world: int, root: str, reps: int, out: str) -> None:
    import torch.distributed as dist

    import fastpersist as fp

    dist.init_process_group("gloo", init_method=f"file://{root}/pg-{world}", rank=rank, world_size=world)
    path = os.path.join(root, "ckpt")
    counts = _count_reads()
    # Warm-up, not timed: builds the control group.
    fp.load(path, group=dist.group.WORLD)
    rows = []
    for rep in range(reps):
        for mode, shared in MODES.items():
            counts["bytes"] = 0
            dist.barrier()
            t = time.perf_counter()
            state = fp.load(path, group=dist.group.WORLD, shared_read=shared)
            dist.barrier()
            rows.append({"rep": rep, "mode": mode, "bytes_read": counts["bytes"], "wall": time.perf_counter() - t})
            del state
    with open(out, "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def _run(ctx: Any, world: int, root: str, reps: int) -> list[list[dict[str, Any]]] | None:
    outs = [os.path.join(root, f"out-{world}-{r}.json") for r in range(world)]
    procs = [ctx.Process(target=_rank, args=(r, world, root, reps, outs[r])) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        print(f"{world} ranks failed: exit codes {[p.exitcode for p in procs]}", file=sys.stderr)
        return None
    return [json.load(open(o)) for o in outs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=parse_size("1GiB"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import fastpersist as fp

    root = tempfile.mkdtemp(prefix="fp-gload-", dir=args.dir or os.getcwd())
    total = fp.save(_state(args.size), os.path.join(root, "ckpt")).nbytes
    ctx = multiprocessing.get_context("spawn")
    table: dict[str, dict[str, Any]] = {}
    for world in args.ranks:
        print(f"{world} rank(s) ...", file=sys.stderr, flush=True)
        per_rank = _run(ctx, world, root, args.reps)
        if per_rank is None:
            return 1
        for mode in MODES:
            mine = [[row for row in rows if row["mode"] == mode] for rows in per_rank]
            walls = [max(r[i]["wall"] for r in mine) for i in range(args.reps)]
            table[f"{world}/{mode}"] = {
                "ranks": world,
                "mode": mode,
                "per_rank_bytes_read": [r[0]["bytes_read"] for r in mine],
                "wall_median_s": statistics.median(walls),
                "wall_min_s": min(walls),
                "wall_max_s": max(walls),
                "aggregate_gb_s": world * total / statistics.median(walls) / 1e9,
            }
    print(f"\nreplicated checkpoint of {total / 2**30:.2f} GiB, {args.reps} interleaved reps (median wall)")
    print(f"{'ranks':>5} {'mode':>7} {'MiB read per rank':>26} {'wall s':>8} {'min':>7} {'max':>7} {'aggr GB/s':>10}")
    for row in table.values():
        per = ", ".join(f"{b / 2**20:.0f}" for b in row["per_rank_bytes_read"])
        print(
            f"{row['ranks']:>5} {row['mode']:>7} {per:>26} {row['wall_median_s']:8.3f} {row['wall_min_s']:7.3f} "
            f"{row['wall_max_s']:7.3f} {row['aggregate_gb_s']:10.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=2)
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
