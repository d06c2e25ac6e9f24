"""Per-iteration overhead of the remote level with 4 gloo ranks as 2 simulated nodes.

As ``benches/remote.py``'s loop (GIL-free device work of T seconds, a small in-place step), on 4
processes: ranks 0-1 are node0 and ranks 2-3 node1 (``FASTPERSIST_NODE``), each node its own root,
``Checkpointer(every=1, keep=2, group=WORLD, replicas=1)`` with and without
``remote=DIR, remote_every=10``, against no checkpoint; interleaved rounds, every rank's
iterations after the first pooled, median and mean, overhead in points.

Run: ``python benches/remote_ranks.py --mib 32 --iters 30 --repeats 3 --device-seconds 0.3``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastpersist as fp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from remote import MiB, build, loop_rows, timed_loop

METHODS = ("no checkpoint", "Checkpointer(every=1, replicas=1)", "+ remote_every=10")


def rank_main(rank: int, world: int, args: argparse.Namespace, root: str) -> None:
    node = f"node{rank // 2}"
    os.environ["FASTPERSIST_NODE"] = node
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=world)
    params, opt = build(args.mib * MiB)
    config = fp.Config(pool_bytes=sum(p.numel() * 12 for p in params) + MiB, timeout_s=120)
    per_iter: dict[str, list[float]] = {name: [] for name in METHODS}
    closes: dict[str, list[float]] = {name: [] for name in METHODS}
    for rnd in range(args.repeats):
        for i, name in enumerate(METHODS):
            run = os.path.join(root, f"round{rnd}-{i}")
            ck = None
            if i:
                levels: list[fp.Partner | fp.Remote] = [fp.Partner(replicas=1)]
                if i == 2:
                    levels.append(fp.Remote(os.path.join(run, "remote"), every=10))
                ck = fp.Checkpointer(
                    os.path.join(run, node), every=1, keep=2, config=config, group=dist.group.WORLD, levels=levels
                )
            dist.barrier()
            times, close = timed_loop(args.iters, args.device_seconds, params, opt, ck, adamw=False)
            per_iter[name] += times[1:]
            closes[name].append(close)
            dist.barrier()
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump({"per_iter": per_iter, "closes": closes}, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=32, help="each rank's training state")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device-seconds", type=float, default=0.3)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="fp-remote-ranks-", dir=args.dir or os.getcwd())
    try:
        mp.spawn(rank_main, args=(4, args, root), nprocs=4, join=True)
        per_iter: dict[str, list[float]] = {name: [] for name in METHODS}
        closes: dict[str, list[float]] = {name: [] for name in METHODS}
        for rank in range(4):
            with open(os.path.join(root, f"rank{rank}.json")) as f:
                found = json.load(f)
            for name in METHODS:
                per_iter[name] += found["per_iter"][name]
                closes[name] += found["closes"][name]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = loop_rows(per_iter, closes)
    state_mib = max(1, args.mib * MiB // 12 // (4096 * 512)) * 4096 * 512 * 12 // MiB  # as build() makes it
    print(
        f"\n4 ranks as 2 nodes, replicas=1: state {state_mib} MiB per rank, T = {args.device_seconds:.2f} s, "
        f"{args.iters} iterations x {args.repeats} rounds (every rank's iterations after the first)"
    )
    head = ("method", "median s", "overhead", "vs ck", "mean s", "overhead", "vs ck", "close() s")
    print("{:34} {:>9} {:>9} {:>7} {:>8} {:>9} {:>7} {:>10}".format(*head))
    for name, r in rows.items():
        more = f"{r['more_overhead_pts']:+5.1f}p" if "more_overhead_pts" in r else ""
        more_mean = f"{r['more_mean_overhead_pts']:+5.1f}p" if "more_mean_overhead_pts" in r else ""
        print(
            f"{name:34} {r['median_s']:9.3f} {r['overhead_pts']:8.1f}p {more:>7} {r['mean_s']:8.3f} "
            f"{r['mean_overhead_pts']:8.1f}p {more_mean:>7} {r['close_s']:10.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "per_iteration_s": per_iter}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
