"""Device staging on the CPU: a training state staged through the arena by a fake device copier
that copies on a thread of its own (as a copy engine does), against one memcpy of the same bytes.

Every tensor of the state is treated as a device tensor (``fastpersist.gpu.use_copier``); the
fake copier's ``copy`` hands the pairs to a thread that copies them with ``Tensor.copy_`` and
``wait`` joins it. Timed: ``save_async`` until ``wait_staged()`` returns (checksums off and on;
the arena is warm, made by a first round), against ``Tensor.copy_`` of the same bytes into a warm
buffer, interleaved in one process. Also counted: the Python calls the engine makes per save
(``copy`` + ``wait``) at two chunk sizes, which must not grow with the number of chunks.

Target (issue: GPU saves at the speed of the copy engine): staging >= 0.8x one memcpy with
checksums off. On a GPU the copy engine replaces the memcpy; scripts/gpu_check.sh measures that.

Run: ``python benches/device_staging.py --size 1GiB --reps 5 --dir /data``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import ClassVar

import torch

import fastpersist as fp
from fastpersist.format.flatten import flatten
from fastpersist.gpu.copiers import DeviceCopier, use_copier
from fastpersist.tools.bench.state import build_state
from fastpersist.tools.units import parse_size

TARGET_VS_MEMCPY = 0.8


class ThreadCopier:
    """A copy engine made of one host thread: ``copy`` queues, ``wait`` joins. The early copies
    (``early=True``) are queued too, ahead of the others, as a GPU copies them asynchronously
    on the caller's stream (nothing here writes the state after the call, so nothing can race
    them; the tests' fakes copy them before returning instead)."""

    needs_pinned_memory: ClassVar[bool] = False
    calls: ClassVar[int] = 0

    def __init__(self, device: torch.device) -> None:
        self.threads: list[threading.Thread] = []

    def begin(self) -> None:
        pass

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, early: bool = False) -> None:
        ThreadCopier.calls += 1
        srcs, dsts = [src for src, _ in pairs], [dst for _, dst in pairs]

        def run() -> None:
            torch._foreach_copy_(dsts, srcs)

        thread = threading.Thread(target=run)
        thread.start()
        self.threads.append(thread)

    def wait(self) -> None:
        ThreadCopier.calls += 1
        for thread in self.threads:
            thread.join()
        self.threads = []


def _factory(device: torch.device) -> DeviceCopier:
    return ThreadCopier(device)


def staged_seconds(state: object, path: str, config: fp.Config) -> float:
    """``save_async`` until ``wait_staged()``; the write, and the background removal of the
    checkpoint it replaced, are then waited for, untimed."""
    start = time.perf_counter()
    fut = fp.save_async(state, path, config=config)
    fut.wait_staged()
    seconds = time.perf_counter() - start
    fut.wait()
    fp.wait_removed()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=1 << 30)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints go (removed)")
    parser.add_argument(
        "--layout",
        choices=["adam", "large"],
        default="adam",
        help="adam: the bench's mixed-precision Adam state (about a thousand tensors, 61 MiB of them "
        "under 1 MiB); large: 16 MiB fp32 tensors only",
    )
    args = parser.parse_args()
    if args.layout == "adam":
        state: object = build_state(args.size)
    else:
        state = {f"w{k}": torch.randn(4 << 20) for k in range(max(1, args.size // (16 << 20)))}
    blobs = flatten(state).blobs
    total = sum(b.nbytes for b in blobs)
    src = torch.ones(total, dtype=torch.uint8)
    dst = torch.zeros(total, dtype=torch.uint8)
    root = tempfile.mkdtemp(dir=args.dir, prefix="fp-device-staging-")
    variants = {
        "checksums off": fp.Config(checksum="off"),
        "crc32c": fp.Config(checksum="crc32c"),
    }
    staged: dict[str, list[float]] = {name: [] for name in variants}
    copies: list[float] = []
    calls: dict[int, int] = {}
    try:
        with use_copier(lambda t: True, _factory):
            for rep in range(args.reps + 1):  # the first round makes the arena and warms the pages
                for name, config in variants.items():
                    seconds = staged_seconds(state, os.path.join(root, "ckpt"), config)
                    if rep:
                        staged[name].append(seconds)
                start = time.perf_counter()
                dst.copy_(src)
                if rep:
                    copies.append(time.perf_counter() - start)
            for chunk in (1 << 20, 32 << 20):
                ThreadCopier.calls = 0
                fp.save_async(state, os.path.join(root, "calls"), config=fp.Config(chunk_bytes=chunk)).wait()
                calls[chunk] = ThreadCopier.calls
    finally:
        shutil.rmtree(root, ignore_errors=True)
    memcpy_s = statistics.median(copies)
    print(f"state {total / 2**30:.2f} GiB in {len(blobs)} tensors, {args.reps} reps interleaved (medians, min-max)")
    print(f"  one memcpy (Tensor.copy_)        {memcpy_s:.3f} s  {total / memcpy_s / 1e9:5.2f} GB/s")
    for name, samples in staged.items():
        median = statistics.median(samples)
        line = (
            f"  save_async -> wait_staged, {name:<14} {median:.3f} s  {total / median / 1e9:5.2f} GB/s  "
            f"({min(samples):.3f}-{max(samples):.3f})  {memcpy_s / median:.2f}x memcpy"
        )
        if name == "checksums off":
            verdict = "met" if memcpy_s / median >= TARGET_VS_MEMCPY else "MISSED"
            line += f" (target {TARGET_VS_MEMCPY}x: {verdict})"
        print(line)
    chunks = {chunk: -(-total // chunk) for chunk in calls}
    print(
        "  Python calls per save (copy + wait): "
        + ", ".join(f"{calls[c]} at {chunks[c]} chunks of {c >> 20} MiB" for c in calls)
        + ("" if len(set(calls.values())) == 1 else "  GROWS WITH THE CHUNKS")
    )


if __name__ == "__main__":
    main()
