"""The remote level: drain throughput against a plain copy, and per-iteration overhead.

Drain throughput (``--mib`` MiB committed locally by a Checkpointer, then one step drained by
``fastpersist.levels.remote_drain.Drainer.drain``: every chunk's crc32c checked, markers, manifest
last, index, retention), interleaved round by round with a plain copy of the same files by the
same means:

* to a directory (``--remote-dir``, default under ``--dir``): the drain vs ``shutil.copyfile``
  + ``os.fsync`` of each file (and of the directory),
* to a local S3 server (moto's standalone server, ``tests/helpers/s3server.py``, reached directly on
  127.0.0.1, not through the tests' proxy): the drain vs ``obstore.put`` of each file as a
  ``Path`` with the same obstore client (``S3Store.store``) and obstore's defaults (no checksum
  work, as ``aws s3 cp``).

Per-iteration overhead: a training loop whose device work is a GIL-free wait of T seconds (as
a GPU kernel frees the CPU) followed by a real AdamW step on CPU tensors, with
``Checkpointer(every=1)`` and with ``Checkpointer(every=1, levels=[Remote(DIR, every=10)])``
against no checkpoint; every iteration is timed, the median per method is reported, and the
overhead in percentage points.

Run: ``python benches/remote.py --mib 512 --repeats 3`` (``--skip s3``, ``--skip loop``, ...).
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
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import fastpersist as fp
from fastpersist import _core
from fastpersist.format.layout import MANIFEST_NAME
from fastpersist.format.manifest import read_manifest
from fastpersist.levels.remote_drain import Drainer
from fastpersist.levels.remote_steps import RemoteSteps, owned_files

MiB = 1 << 20


def committed_step(root: str, mib: int, chunk_bytes: int) -> tuple[str, int]:
    """A step of `mib` MiB committed under `root` by a Checkpointer: (its directory, its step)."""
    gen = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(mib * MiB // 4, generator=gen), "step": 1}
    config = fp.Config(chunk_bytes=chunk_bytes, pool_bytes=mib * MiB + MiB)
    with fp.Checkpointer(root, every=1, keep=1, config=config) as ck:
        ck.save(1, state)
    return ck.path(1), 1


def files_of(step_dir: str) -> list[str]:
    """The names (relative to the step) that a drain of rank 0 moves: data files, then the manifest."""
    return [f.name for f in owned_files(step_dir, read_manifest(step_dir), 0)] + [MANIFEST_NAME]


def source_cache(step_dir: str, names: list[str], *, cold: bool) -> None:
    """Before each measurement, the same start for every method: the step's files read into the
    page cache (the save wrote them with O_DIRECT), or with `cold` dropped from it."""
    for name in names:
        with open(os.path.join(step_dir, name), "rb", buffering=0) as f:
            if cold:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                while f.read(64 * MiB):
                    pass


def drain_seconds(target: str, step_dir: str, step: int) -> float:
    """Seconds for one Drainer.drain of `step` to `target` (a fresh remote)."""
    drainer = Drainer(RemoteSteps(target), lambda s: step_dir, rank=0, size=1, keep=2, timeout_s=120)
    t = time.perf_counter()
    drainer.drain(step)
    return time.perf_counter() - t


def copy_dir_seconds(dest: str, step_dir: str, names: list[str]) -> float:
    """Seconds for shutil.copyfile + fsync of every file of the step into `dest`."""
    t = time.perf_counter()
    for name in names:
        dst = os.path.join(dest, "step", name)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(os.path.join(step_dir, name), dst)
        with open(dst, "rb") as f:
            os.fsync(f.fileno())
        _core.fsync_dir(os.path.dirname(dst))
    return time.perf_counter() - t


def put_s3_seconds(target: str, step_dir: str, names: list[str]) -> float:
    """Seconds for obstore.put (defaults, a Path) of every file of the step, with the drain's client."""
    import obstore

    store = RemoteSteps(target).store.store  # type: ignore[attr-defined]
    t = time.perf_counter()
    for name in names:
        obstore.put(store, f"step/{name}", Path(step_dir) / name)
    return time.perf_counter() - t


class S3:
    """moto's server (tests/helpers/s3server.py) and one bucket; the AWS_* variables point at the server itself."""

    def __init__(self) -> None:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "helpers"))
        from s3server import S3Server

        self.server = S3Server()
        self.server.proxy.stop()  # measured without the tests' Python TCP proxy in the way
        env = self.server.env()
        env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{self.server.server_port}"
        os.environ.update(env)
        self.bucket = f"fp-bench-{uuid.uuid4().hex[:8]}"
        self.server.client().create_bucket(Bucket=self.bucket)

    def fresh(self) -> str:
        return f"s3://{self.bucket}/{uuid.uuid4().hex[:8]}"

    def empty(self) -> None:
        """Deletes every object (moto keeps them in memory or spooled files)."""
        client = self.server.client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})

    def close(self) -> None:
        self.server.proc.terminate()
        self.server.proc.wait(10)


def bench_drain(args: argparse.Namespace, root: str) -> dict[str, Any]:
    """Drain vs plain copy to a directory and to S3, interleaved, medians of `repeats`."""
    step_dir, step = committed_step(os.path.join(root, "local"), args.mib, args.chunk_mib * MiB)
    names = files_of(step_dir)
    nbytes = sum(os.path.getsize(os.path.join(step_dir, n)) for n in names)
    remote_dir = tempfile.mkdtemp(prefix="fp-remote-", dir=args.remote_dir or root)
    s3 = S3() if "s3" not in args.skip else None
    methods: dict[str, Callable[[], float]] = {}
    if "dir" not in args.skip:

        def fresh_dir() -> str:
            shutil.rmtree(remote_dir)
            os.makedirs(remote_dir)
            return remote_dir

        methods["dir: drain"] = lambda: drain_seconds(fresh_dir(), step_dir, step)
        methods["dir: copyfile+fsync"] = lambda: copy_dir_seconds(fresh_dir(), step_dir, names)
    if s3 is not None:
        methods["s3: drain"] = lambda: drain_seconds(s3.fresh(), step_dir, step)
        methods["s3: obstore.put"] = lambda: put_s3_seconds(s3.fresh(), step_dir, names)
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    try:
        for rnd in range(args.repeats):
            for name, fn in sorted(methods.items(), key=lambda kv: ("drain" in kv[0]) == (rnd % 2 == 0)):
                print(f"round {rnd + 1}/{args.repeats}: {name} ...", file=sys.stderr, flush=True)
                gc.collect()
                source_cache(step_dir, names, cold=args.cold)
                seconds[name].append(fn())
                if s3 is not None and name.startswith("s3"):
                    s3.empty()
    finally:
        if s3 is not None:
            s3.close()
        shutil.rmtree(remote_dir, ignore_errors=True)
    rows = {}
    for name, values in seconds.items():
        med = statistics.median(values)
        rows[name] = {"median_s": med, "mb_s": nbytes / med / 1e6, "all_s": values}
    for name in list(rows):
        kind, what = name.split(": ")
        if what == "drain":
            plain = next(r for n, r in rows.items() if n.startswith(kind) and n != name)
            rows[name]["ratio"] = rows[name]["mb_s"] / plain["mb_s"]
    print(
        f"\ndrain of one step: {nbytes / MiB:.0f} MiB in {len(names)} files, chunk {args.chunk_mib} MiB, "
        f"{args.repeats} repeats (median), local copy {'cold' if args.cold else 'in the page cache'}"
    )
    print(f"{'method':24} {'s':>8} {'MB/s':>8} {'min s':>8} {'max s':>8} {'ratio':>7}")
    for name, r in rows.items():
        ratio = f"{r['ratio']:6.2f}x" if "ratio" in r else ""
        print(
            f"{name:24} {r['median_s']:8.3f} {r['mb_s']:8.0f} {min(r['all_s']):8.3f} {max(r['all_s']):8.3f} {ratio:>7}"
        )
    return {"bytes": nbytes, "files": len(names), "rows": rows}


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


def timed_loop(
    iters: int,
    t_dev: float,
    params: list[torch.nn.Parameter],
    opt: torch.optim.Optimizer,
    ck: Any,
    adamw: bool = True,
) -> tuple[list[float], float]:
    """(seconds of each iteration, seconds of the final close()) of the training loop."""
    times = []
    for step in range(iters):
        t = time.perf_counter()
        time.sleep(t_dev)  # the device work: releases the GIL, like waiting on a GPU
        if ck is not None:
            ck.wait_staged()
        if adamw:
            opt.step()
        else:  # --opt-step touch: the state still changes every step, at almost no CPU cost
            params[step % len(params)].data[0, 0] += 1
        if ck is not None:
            ck.save(step, state_of(params, opt, step))
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    if ck is not None:
        ck.close()
    return times, time.perf_counter() - t


def loop_rows(per_iter: dict[str, list[float]], closes: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Median and mean seconds per iteration, their overhead in points over no checkpoint, and
    the remote's points beyond the plain Checkpointer's."""
    base, base_mean = statistics.median(per_iter["no checkpoint"]), statistics.fmean(per_iter["no checkpoint"])
    rows = {}
    for name, values in per_iter.items():
        med, mean = statistics.median(values), statistics.fmean(values)
        rows[name] = {
            "median_s": med,
            "overhead_pts": 100 * (med / base - 1),
            "mean_s": mean,
            "mean_overhead_pts": 100 * (mean / base_mean - 1),
            "close_s": statistics.median(closes[name]),
        }
    names = list(rows)
    for key in ("overhead_pts", "mean_overhead_pts"):
        rows[names[2]]["more_" + key] = rows[names[2]][key] - rows[names[1]][key]
    return rows


def bench_loop(args: argparse.Namespace, root: str) -> dict[str, Any]:
    """Per-iteration medians: no checkpoint, Checkpointer(every=1), and with remote_every=10."""
    params, opt = build(args.loop_mib * MiB)
    state_bytes = sum(p.numel() * 12 for p in params)
    config = fp.Config(pool_bytes=state_bytes + MiB)
    probe = fp.save(state_of(params, opt, 0), os.path.join(root, "probe"), config=config)
    shutil.rmtree(os.path.join(root, "probe"))
    t_dev = args.device_seconds or round(1.1 * probe.seconds, 3)
    adamw = args.opt_step == "adamw"
    print(
        f"state {state_bytes / MiB:.0f} MiB; a save takes {probe.seconds:.2f} s -> T = {t_dev:.2f} s", file=sys.stderr
    )

    def run(remote: bool) -> Callable[[], tuple[list[float], float]]:
        def go() -> tuple[list[float], float]:
            local = tempfile.mkdtemp(prefix="fp-loop-", dir=root)
            levels = []
            if remote:
                target = tempfile.mkdtemp(prefix="fp-loop-remote-", dir=args.remote_dir or root)
                levels = [fp.Remote(target, every=args.remote_every, bytes_per_s=args.remote_bytes_per_s)]
            ck = fp.Checkpointer(local, every=1, keep=2, config=config, levels=levels)
            try:
                return timed_loop(args.iters, t_dev, params, opt, ck, adamw)
            finally:
                shutil.rmtree(local, ignore_errors=True)
                if target is not None:
                    shutil.rmtree(target, ignore_errors=True)

        return go

    methods = {
        "no checkpoint": lambda: timed_loop(args.iters, t_dev, params, opt, None, adamw),
        "Checkpointer(every=1)": run(False),
        f"+ remote_every={args.remote_every}": run(True),
    }
    per_iter: dict[str, list[float]] = {name: [] for name in methods}
    closes: dict[str, list[float]] = {name: [] for name in methods}
    for rnd in range(args.repeats):
        for name, fn in methods.items():
            print(f"round {rnd + 1}/{args.repeats}: {name} ...", file=sys.stderr, flush=True)
            gc.collect()
            times, close = fn()
            per_iter[name] += times[1:]  # the first iteration allocates the pool
            closes[name].append(close)
    rows = loop_rows(per_iter, closes)
    print(
        f"\nper iteration: state {state_bytes / MiB:.0f} MiB, T = {t_dev:.2f} s, {args.iters} iterations x "
        f"{args.repeats} rounds (median and mean of the iterations after the first)"
    )
    head = ("method", "median s", "overhead", "vs ck", "mean s", "overhead", "vs ck", "close() s")
    print("{:26} {:>9} {:>9} {:>7} {:>8} {:>9} {:>7} {:>10}".format(*head))
    for name, r in rows.items():
        more = f"{r['more_overhead_pts']:+5.1f}p" if "more_overhead_pts" in r else ""
        more_mean = f"{r['more_mean_overhead_pts']:+5.1f}p" if "more_mean_overhead_pts" in r else ""
        print(
            f"{name:26} {r['median_s']:9.3f} {r['overhead_pts']:8.1f}p {more:>7} {r['mean_s']:8.3f} "
            f"{r['mean_overhead_pts']:8.1f}p {more_mean:>7} {r['close_s']:10.3f}"
        )
    return {"state_bytes": state_bytes, "T": t_dev, "iters": args.iters, "rows": rows, "per_iteration_s": per_iter}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="the drained step's size")
    parser.add_argument("--chunk-mib", type=int, default=8, help="Config.chunk_bytes of the drained step, in MiB")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median reported)")
    parser.add_argument("--cold", action="store_true", help="drop the local step from the page cache before each copy")
    parser.add_argument("--loop-mib", type=int, default=256, help="the training state's size in the loop")
    parser.add_argument("--iters", type=int, default=30, help="iterations per loop measurement")
    parser.add_argument("--remote-every", type=int, default=10)
    parser.add_argument("--remote-bytes-per-s", type=float, default=None, help="the drain's throttle in the loop")
    parser.add_argument(
        "--opt-step",
        choices=["adamw", "touch"],
        default="adamw",
        help="after the device work: a real AdamW step on CPU, or one element changed (no CPU noise)",
    )
    parser.add_argument("--device-seconds", type=float, default=0.0, help="T; default 1.1 x the measured save time")
    parser.add_argument("--dir", default=None, help="where the local steps go (default: the current directory)")
    parser.add_argument("--remote-dir", default=None, help="where the directory remote goes (default: --dir)")
    parser.add_argument("--skip", action="append", default=[], choices=["dir", "s3", "drain", "loop"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="fp-remote-bench-", dir=args.dir or os.getcwd())
    out: dict[str, Any] = {"args": vars(args)}
    try:
        if "drain" not in args.skip:
            out["drain"] = bench_drain(args, root)
        if "loop" not in args.skip:
            out["loop"] = bench_loop(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
