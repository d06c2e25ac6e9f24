"""Write parallelism across ranks: 1, 2 and 4 local gloo ranks save one replicated state.

Each rank writes its share into its own directory (a stand-in for one drive per rank). The
table shows per-rank bytes (which fall as 1/N), wall time and aggregate GB/s. On a machine with
one disk and two cores the aggregate is capped by that disk; the point is that per-rank bytes
fall as 1/N while the time does not grow.

Run: ``python benches/distributed.py --size 2GiB --ranks 1 2 4 --reps 3``.
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


def _state(size_bytes: int) -> dict[str, Any]:
    from fastpersist.tools.bench.state import build_state

    return build_state(size_bytes)  # seeded: the same state on every rank


def _rank(rank: int, world: int, root: str, size_bytes: int, reps: int, out: str) -> None:
    import torch.distributed as dist

    import fastpersist as fp

    dist.init_process_group("gloo", init_method=f"file://{root}/pg-{world}", rank=rank, world_size=world)
    state = _state(size_bytes)
    stripe = os.path.join(root, f"drive{rank}")
    os.makedirs(stripe, exist_ok=True)
    cfg = fp.Config(stripes=[stripe])
    # Warm-up, not timed: builds the control group and allocates the staging pool.
    fp.save(state, os.path.join(root, f"ckpt-{world}"), config=cfg, group=dist.group.WORLD)
    rows = []
    for rep in range(reps):
        dist.barrier()
        t = time.perf_counter()
        res = fp.save(state, os.path.join(root, f"ckpt-{world}"), config=cfg, group=dist.group.WORLD)
        dist.barrier()
        rows.append({"rep": rep, "nbytes": res.nbytes, "seconds": res.seconds, "wall": time.perf_counter() - t})
    with open(out, "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=parse_size("2GiB"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="fp-dist-", dir=args.dir or os.getcwd())
    ctx = multiprocessing.get_context("spawn")
    table = {}
    for world in args.ranks:
        print(f"{world} rank(s) ...", file=sys.stderr, flush=True)
        outs = [os.path.join(root, f"out-{world}-{r}.json") for r in range(world)]
        procs = [ctx.Process(target=_rank, args=(r, world, root, args.size, args.reps, outs[r])) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            print(f"{world} ranks failed: exit codes {[p.exitcode for p in procs]}", file=sys.stderr)
            return 1
        per_rank = [json.load(open(o)) for o in outs]
        walls = [max(r[i]["wall"] for r in per_rank) for i in range(args.reps)]
        total = sum(r[0]["nbytes"] for r in per_rank)
        table[world] = {
            "per_rank_bytes": [r[0]["nbytes"] for r in per_rank],
            "wall_median_s": statistics.median(walls),
            "wall_min_s": min(walls),
            "wall_max_s": max(walls),
            "aggregate_gb_s": total / statistics.median(walls) / 1e9,
        }
        shutil.rmtree(os.path.join(root, f"ckpt-{world}"), ignore_errors=True)
    print(f"\nreplicated state of {args.size / 2**30:.2f} GiB, one directory per rank, {args.reps} reps (median)")
    print(f"{'ranks':>5} {'bytes per rank (MiB)':>28} {'wall s':>8} {'min':>7} {'max':>7} {'aggregate GB/s':>15}")
    for world, row in table.items():
        per = ", ".join(f"{b / 2**20:.0f}" for b in row["per_rank_bytes"])
        print(
            f"{world:>5} {per:>28} {row['wall_median_s']:8.3f} {row['wall_min_s']:7.3f} {row['wall_max_s']:7.3f} "
            f"{row['aggregate_gb_s']:15.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=2)
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
