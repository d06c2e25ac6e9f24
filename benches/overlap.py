"""Per-iteration checkpointing overhead: does the save hide behind the next iteration?

A training loop whose device work is simulated by a GIL-free wait of T seconds (as a GPU kernel
frees the CPU), followed by a real AdamW step on CPU tensors, with a ~1 GiB state (fp32
parameters + Adam moments). In one run, interleaving the methods round by round, it compares
iterations/s of:

* no checkpoint,
* ``fastpersist.Checkpointer`` saving every iteration (``wait_staged()`` before each step),
* ``torch.save`` + fsync every iteration (blocking),
* ``torch.distributed.checkpoint.async_save`` every iteration (waiting for the previous one
  before starting the next, as its docs advise).

The rate is the steady-state iterations/s of the loop; waiting for the last checkpoint to be
durable after the loop happens once per run and is reported apart ("final drain").

``--compute cpu`` replaces the wait with real single-threaded forward/backward work of about
the same duration, which shows the CPU cost of staging honestly (the copy competes for the
machine's cores).

Run: ``python benches/overlap.py --size 1GiB --iters 8 --rounds 3``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import fastpersist as fp
from fastpersist.format.flatten import flatten
from fastpersist.tools.units import parse_size


def build(size_bytes: int) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """Parameters and an AdamW whose state_dicts together hold ~size_bytes (3 x 4 bytes/param)."""
    params_total = size_bytes // 12
    width = 4096
    count = max(1, params_total // (width * 512))
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(512, width, generator=gen) * 0.02) for _ in range(count)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    opt.step()  # materialise exp_avg / exp_avg_sq
    return params, opt


def state_of(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": {f"p{i}": p.detach() for i, p in enumerate(params)}, "optimizer": opt.state_dict(), "step": step}


class CpuWork:
    """Single-threaded forward/backward of an MLP, calibrated to take about `seconds`."""

    def __init__(self, seconds: float) -> None:
        self.model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
        self.x = torch.randn(256, 1024)
        t = time.perf_counter()
        self._once()
        one = time.perf_counter() - t
        self.reps = max(1, round(seconds / max(one, 1e-4)))

    def _once(self) -> None:
        self.model(self.x).square().mean().backward()

    def __call__(self) -> None:
        for _ in range(self.reps):
            self._once()


def run_loop(
    iters: int,
    device_work: Callable[[], None],
    params: list[torch.nn.Parameter],
    opt: torch.optim.Optimizer,
    before_step: Callable[[], None],
    after_step: Callable[[int], None],
    finish: Callable[[], None],
) -> tuple[float, float]:
    """(steady-state iterations/s, seconds to drain the last checkpoint after the loop).

    The drain (waiting for the final save to be durable) happens once per training run, not
    per iteration, so it is reported apart from the per-iteration rate.
    """
    t = time.perf_counter()
    for step in range(iters):
        device_work()
        before_step()
        opt.step()
        after_step(step)
    loop = time.perf_counter() - t
    t = time.perf_counter()
    finish()
    return iters / loop, time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=parse_size("1GiB"))
    parser.add_argument("--iters", type=int, default=8, help="iterations per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    parser.add_argument("--device-seconds", type=float, default=0.0, help="T; default 1.1 x the measured save time")
    parser.add_argument("--compute", choices=["wait", "cpu"], default="wait")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip", action="append", default=[], help="method to skip (dcp, torch)")
    args = parser.parse_args(argv)

    root = tempfile.mkdtemp(prefix="fp-overlap-", dir=args.dir or os.getcwd())
    params, opt = build(args.size)
    state_bytes = sum(b.nbytes for b in flatten(state_of(params, opt, 0)).blobs)
    print(f"state: {state_bytes / 2**30:.2f} GiB in {len(params) * 3} tensors", file=sys.stderr)

    probe = fp.save(state_of(params, opt, 0), os.path.join(root, "probe"), config=fp.Config(pool_bytes=state_bytes))
    shutil.rmtree(os.path.join(root, "probe"))
    t_dev = args.device_seconds or round(1.1 * probe.seconds, 3)
    print(f"fastpersist save takes {probe.seconds:.2f} s -> device time T = {t_dev:.2f} s/iter", file=sys.stderr)
    if args.compute == "cpu":
        torch.set_num_threads(1)
        device_work: Callable[[], None] = CpuWork(t_dev)
    else:

        def device_work() -> None:
            time.sleep(t_dev)  # releases the GIL, like waiting on a GPU

    def none() -> tuple[float, float]:
        return run_loop(args.iters, device_work, params, opt, lambda: None, lambda s: None, lambda: None)

    def fastpersist_ck() -> tuple[float, float]:
        ck_root = os.path.join(root, "ck")
        ck = fp.Checkpointer(ck_root, keep=2, config=fp.Config(pool_bytes=state_bytes))
        result = run_loop(
            args.iters,
            device_work,
            params,
            opt,
            ck.wait_staged,
            lambda s: ck.save(s, state_of(params, opt, s)),
            ck.wait,
        )
        shutil.rmtree(ck_root)
        return result

    def torch_save() -> tuple[float, float]:
        path = os.path.join(root, "t.pt")

        def save(step: int) -> None:
            torch.save(state_of(params, opt, step), path)
            fp._core.fsync_path(path)

        result = run_loop(args.iters, device_work, params, opt, lambda: None, save, lambda: None)
        os.remove(path)
        return result

    def dcp_async() -> tuple[float, float]:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=0, world_size=1)
        pending: list[Any] = []

        def wait_previous() -> None:
            while pending:
                pending.pop().result()

        def save(step: int) -> None:
            wait_previous()
            pending.append(
                dcp.async_save(state_of(params, opt, step), checkpoint_id=os.path.join(root, f"dcp{step % 2}"))
            )

        result = run_loop(args.iters, device_work, params, opt, lambda: None, save, wait_previous)
        for i in range(2):
            shutil.rmtree(os.path.join(root, f"dcp{i}"), ignore_errors=True)
        return result

    methods = {
        "no checkpoint": none,
        "fastpersist Checkpointer": fastpersist_ck,
        "torch.save + fsync": torch_save,
        "DCP async_save": dcp_async,
    }
    methods = {k: v for k, v in methods.items() if not any(s in k.lower() for s in args.skip)}
    rates: dict[str, list[float]] = {name: [] for name in methods}
    drains: dict[str, list[float]] = {name: [] for name in methods}
    for rnd in range(args.rounds):
        for name, fn in methods.items():
            print(f"round {rnd + 1}/{args.rounds}: {name} ...", file=sys.stderr, flush=True)
            gc.collect()
            rate, drain = fn()
            rates[name].append(rate)
            drains[name].append(drain)
    base = statistics.median(rates["no checkpoint"])
    print(
        f"\ncompute={args.compute}, T={t_dev:.2f} s, state {state_bytes / 2**30:.2f} GiB, {args.iters} iterations x "
        f"{args.rounds} rounds (median)"
    )
    print(f"{'method':28} {'it/s':>8} {'min':>8} {'max':>8} {'overhead':>9} {'final drain s':>14}")
    rows = {}
    for name, values in rates.items():
        med = statistics.median(values)
        overhead = base / med - 1
        drain = statistics.median(drains[name])
        rows[name] = {
            "median_it_s": med,
            "min": min(values),
            "max": max(values),
            "overhead": overhead,
            "final_drain_s": drain,
        }
        print(f"{name:28} {med:8.3f} {min(values):8.3f} {max(values):8.3f} {overhead:8.1%} {drain:14.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"compute": args.compute, "T": t_dev, "state_bytes": state_bytes, "rows": rows}, f, indent=2)
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
