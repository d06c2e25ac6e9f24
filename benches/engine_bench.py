#!/usr/bin/env python3
"""Peer benchmark: the engine writing from memory vs what the device does for fio and dd.

One run writes the same amount (default 1 GiB) with O_DIRECT, durably, in 8 MiB writes at
queue depth 8, by each method in turn, repetition after repetition. Interleaving makes drift of
a shared or virtual disk hit every method alike; the starting method rotates (A B C D, B C D A,
...) so that no method always pays for what the one before it left behind (e.g. the freeing and
discard of the file just deleted):

* ``engine/io_uring`` and ``engine/threads``: ``fastpersist.engine.start_write`` from an
  in-memory buffer (crc32c on, fsync at the end), staging through a warm pool;
* ``fio``: ``--rw=write --bs=8M --iodepth=8 --ioengine=io_uring`` (libaio where io_uring is
  blocked) ``--direct=1 --end_fsync=1``, timed by fio itself (its runtime includes the fsync,
  not its start-up or the preallocation of the file);
* ``dd``: ``if=/dev/zero bs=8M oflag=direct conv=fsync``, timed by dd itself.

The file is deleted before every run. It prints median/min/max seconds and GB/s (10^9 bytes
per second) per method and each engine backend's throughput relative to the best device
reference (fio when installed, else dd), and writes everything as JSON with ``--json``::

    python benches/engine_bench.py --dir /mnt/nvme/bench --size 1G --reps 5 --json bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fastpersist import _core
from fastpersist.engine import WriteOptions, WriteRequest, start_write
from fastpersist.tools.bench.fio import fio_engine, run_fio_write

GB = 1e9
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(?:i?B)?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 1G, 512M, 1048576)")
    return int(match.group(1)) * UNITS[match.group(2)]


def human(nbytes: int) -> str:
    for unit in ("T", "G", "M", "K"):
        if nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]} {unit}iB"
    return f"{nbytes} B"


class Engine:
    """One engine backend writing `source` to a single part file."""

    def __init__(self, backend: Literal["io_uring", "threads"], source: np.ndarray, args: argparse.Namespace) -> None:
        self.backend = backend
        self.source = source
        self.args = args
        self.plan = _core.Plan([source.size], chunk_bytes=args.chunk_bytes)
        # One pool per backend, reused across runs as a trainer reuses it across saves.
        self.pool = _core.Pool(args.chunk_bytes, args.pool_bytes)

    def __call__(self, path: Path) -> float:
        start = time.perf_counter()
        request = WriteRequest(
            plan=self.plan,
            paths=[str(path)],
            sources=[self.source],
            pool=self.pool,
            options=WriteOptions(
                backend=self.backend,
                direct_io="require",
                queue_depth=self.args.queue_depth,
                checksum=not self.args.no_checksum,
                durable=True,
            ),
        )
        report = start_write(request).wait()
        seconds = time.perf_counter() - start
        assert report["bytes_written"] == self.source.size and report["parts"][0]["direct"]
        return seconds


def run_fio(path: Path, args: argparse.Namespace) -> float:
    run = run_fio_write([str(path)], args.size, block_bytes=args.chunk_bytes, iodepth=args.queue_depth)
    if run.io_bytes != args.size:
        raise RuntimeError(f"fio wrote {run.io_bytes} bytes, not {args.size}")
    return run.runtime_s


def run_dd(path: Path, args: argparse.Namespace) -> float:
    command = [
        "dd",
        "if=/dev/zero",
        f"of={path}",
        f"bs={args.chunk_bytes}",
        f"count={args.size // args.chunk_bytes}",
        "oflag=direct",
        "conv=fsync",
    ]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, LC_ALL="C"))
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"dd failed: {done.stderr.strip()}")
    # dd's own figure (it includes the fsync) leaves out process start-up.
    match = re.search(r"copied, ([0-9.]+) s", done.stderr)
    return float(match.group(1)) if match else wall


def extent_count(path: Path) -> int | None:
    """How many extents the file got (a fragmented file is slower to write and to read back)."""
    if shutil.which("filefrag") is None:
        return None
    done = subprocess.run(["filefrag", str(path)], capture_output=True, text=True)
    match = re.search(r"(\d+) extents? found", done.stdout)
    return int(match.group(1)) if match else None


def filesystem_of(directory: Path) -> str:
    done = subprocess.run(
        ["findmnt", "-n", "-o", "SOURCE,FSTYPE,OPTIONS", "--target", str(directory)],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_bytes, default=1 << 30, help="bytes per run (default 1G)")
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="directory on the disk to test (default: .)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per method (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    parser.add_argument("--chunk-bytes", type=parse_bytes, default=8 << 20, help="bytes per write (default 8M)")
    parser.add_argument("--queue-depth", type=int, default=8, help="writes in flight (default 8)")
    parser.add_argument("--pool-bytes", type=parse_bytes, default=256 << 20, help="engine staging pool (256M)")
    parser.add_argument("--no-checksum", action="store_true", help="engine: skip the per-chunk crc32c")
    parser.add_argument(
        "--pause-s",
        type=float,
        default=0.0,
        help="sync and sleep this long before each run, letting a virtual or shared disk settle",
    )
    parser.add_argument("--no-fio", action="store_true", help="skip fio even if installed")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    if args.chunk_bytes % _core.DIRECT_ALIGN_BYTES or args.size < args.chunk_bytes:
        parser.error("--chunk-bytes must be a multiple of 4096 and at most --size")
    if args.size % args.chunk_bytes:
        args.size -= args.size % args.chunk_bytes
        print(f"note: --size rounded down to {args.size} bytes (a multiple of --chunk-bytes)", file=sys.stderr)
    args.dir.mkdir(parents=True, exist_ok=True)
    if not _core.direct_io_supported(args.dir):
        parser.error(f"{args.dir} refuses O_DIRECT; point --dir at a disk-backed filesystem")
    if shutil.disk_usage(args.dir).free < 2 * args.size:
        parser.error(f"{args.dir} has less than twice --size free")

    source = np.empty(args.size, dtype=np.uint8)
    source.fill(0x5A)  # touched: no page faults inside a timed run

    methods: dict[str, Callable[[Path], float]] = {}
    skipped: dict[str, str] = {}
    backends: tuple[Literal["io_uring", "threads"], ...] = ("io_uring", "threads")
    for backend in backends:
        try:
            _core.select_backend(backend)
        except Exception as e:  # BackendUnavailableError: io_uring blocked here
            skipped[f"engine/{backend}"] = str(e)
            continue
        methods[f"engine/{backend}"] = Engine(backend, source, args)
    fio_name = f"fio/{fio_engine()}"
    if args.no_fio:
        skipped[fio_name] = "--no-fio"
    elif shutil.which("fio") is None:
        skipped[fio_name] = "fio is not installed"
    else:
        methods[fio_name] = lambda path: run_fio(path, args)
    methods["dd"] = lambda path: run_dd(path, args)

    path = args.dir / f".engine-bench-{os.getpid()}.bin"
    times: dict[str, list[float]] = {name: [] for name in methods}
    extents: dict[str, list[int]] = {name: [] for name in methods}
    print(
        f"writing {human(args.size)} x {args.reps} reps (+{args.warmup} warm-up) per method to {args.dir}, "
        f"O_DIRECT, fsync, {human(args.chunk_bytes)} writes, queue depth {args.queue_depth}",
        file=sys.stderr,
    )
    try:
        names = list(methods)
        for rep in range(-args.warmup, args.reps):
            # Every repetition runs each method once; the starting method rotates (A B C, B C A,
            # C A B, ...) so that no method always follows the same one (see the module doc).
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                method = methods[name]
                path.unlink(missing_ok=True)
                if args.pause_s:
                    os.sync()
                    time.sleep(args.pause_s)
                seconds = method(path)
                fragments = extent_count(path)
                path.unlink(missing_ok=True)
                if rep >= 0:
                    times[name].append(seconds)
                    if fragments is not None:
                        extents[name].append(fragments)
            if rep >= 0:
                line = "  ".join(f"{n} {times[n][-1]:.3f}s" for n in methods)
                print(f"rep {rep + 1}/{args.reps}: {line}", file=sys.stderr)
    finally:
        path.unlink(missing_ok=True)

    summary = {
        name: {
            "seconds": samples,
            "median_s": statistics.median(samples),
            "min_s": min(samples),
            "max_s": max(samples),
            "median_gb_per_s": args.size / statistics.median(samples) / GB,
            "median_extents": statistics.median(extents[name]) if extents[name] else None,
        }
        for name, samples in times.items()
    }
    references = [n for n in summary if n.startswith("fio")] or ["dd"]
    reference = max(references, key=lambda n: summary[n]["median_gb_per_s"])
    targets = {"engine/io_uring": 0.90, "engine/threads": 0.80}
    for entry in summary.values():
        entry["ratio_to_reference"] = entry["median_gb_per_s"] / summary[reference]["median_gb_per_s"]

    header = f"{'method':<18}{'median s':>10}{'min s':>9}{'max s':>9}{'GB/s':>8}{'extents':>9}  {'x ' + reference}"
    print(header)
    print("-" * len(header))
    for name, entry in summary.items():
        ratio = f"{entry['ratio_to_reference']:.2f}"
        if name in targets:
            verdict = "ok" if entry["ratio_to_reference"] >= targets[name] else "MISS"
            ratio += f" (>= {targets[name]:.2f} {verdict})"
        print(
            f"{name:<18}{entry['median_s']:>10.3f}{entry['min_s']:>9.3f}{entry['max_s']:>9.3f}"
            f"{entry['median_gb_per_s']:>8.2f}{entry['median_extents'] or '-':>9}  {ratio}"
        )
    for name, why in skipped.items():
        print(f"{name:<18}skipped: {why}")

    if args.json:
        document: dict[str, Any] = {
            "size_bytes": args.size,
            "reps": args.reps,
            "chunk_bytes": args.chunk_bytes,
            "queue_depth": args.queue_depth,
            "pool_bytes": args.pool_bytes,
            "checksum": not args.no_checksum,
            "directory": str(args.dir),
            "filesystem": filesystem_of(args.dir),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "fastpersist": _core.__version__,
            "reference": reference,
            "results": summary,
            "skipped": skipped,
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
