"""Device staging on the CPU: a training state staged through the arena by a fake device copier
whose copy engine is a thread of its own, against that engine's one memcpy of the same bytes.

Every tensor of the state is treated as a device tensor (``fastpersist.gpu.use_copier``); the
fake copier's ``copy`` queues the pairs to a copy-engine thread that copies them with
``torch._foreach_copy_``. On a GPU the copy engine is hardware beside the host's cores, so the
fake engine copies on one core (``--engine-threads 1``: torch's intra-op threads set to 1 for the
process) and the save's own work runs on the other, as it does beside a GPU.

Timed, interleaved in one process: ``save_async`` until ``wait_staged()`` returns (checksums off
and on; the arena is warm, made by a first round); the engine copying the same bytes as one flat
tensor into a warm buffer (its own limit, as the copy engine's 55 GB/s is a GPU's); the engine
making the save's own copies, one per tensor, with nothing around them; and a ``Tensor.copy_``
with torch's default threads (every core). Also counted: the Python calls the engine makes per
save (``copy`` + ``wait``) at two chunk sizes, which must not grow with the number of chunks.

Target (issue: GPU saves at the speed of the copy engine): staging >= 0.8x the engine's memcpy
with checksums off. On a GPU scripts/gpu_check.sh measures the same against the copy engine.

``--paths`` also times whole saves of the state through the other front doors, interleaved:
``fp.save``, ``fp.torch_save`` and ``dcp.save(storage_writer=FastPersistWriter)`` (the GPU target:
each >= 0.8x ``fp.save``'s GB/s from the same device state).

Run: ``python benches/device_staging.py --size 1GiB --reps 5 --dir /data [--paths]``.
"""

from __future__ import annotations

import argparse
import os
import queue
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
from fastpersist.gpu.copiers import DeviceCopier, device_bytes, use_copier
from fastpersist.gpu.device_side import arena_views
from fastpersist.tools.bench.state import build_state
from fastpersist.tools.units import parse_size

TARGET_VS_MEMCPY = 0.8


class _CopyEngine:
    """One host thread that copies the batches queued to it one after the other, in order, with
    torch's intra-op threads, which the bench sets for the whole process (torch keeps one
    setting for every thread that has not used it yet, so it cannot be the engine's alone)."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[tuple[list[torch.Tensor], list[torch.Tensor], threading.Event]] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._run, name="fake-copy-engine", daemon=True).start()

    def copy(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> threading.Event:
        """Queues one batch; the event is set once it is copied."""
        done = threading.Event()
        self.queue.put((dsts, srcs, done))
        return done

    def _run(self) -> None:
        while True:
            dsts, srcs, done = self.queue.get()
            torch._foreach_copy_(dsts, srcs)
            done.set()


class ThreadCopier:
    """A copier whose copy engine is one host thread shared by every save of the process, as a
    GPU's copy engine is: ``copy`` queues a batch, the engine copies the batches in the order
    they were queued, ``wait`` returns once every batch this copier queued is done. The early
    copies (``early=True``) are queued too, as a GPU copies them asynchronously on the caller's
    stream (nothing here writes the state after the call, so nothing can race them; the tests'
    fakes copy them before returning instead)."""

    needs_pinned_memory: ClassVar[bool] = False
    calls: ClassVar[int] = 0
    engine: ClassVar[_CopyEngine | None] = None  # set by main()

    def __init__(self, device: torch.device) -> None:
        assert ThreadCopier.engine is not None, "start the copy engine first"
        self.engine = ThreadCopier.engine
        self.pending: list[threading.Event] = []

    def begin(self) -> None:
        pass

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, early: bool = False) -> None:
        ThreadCopier.calls += 1
        self.pending.append(self.engine.copy([dst for _, dst in pairs], [src for src, _ in pairs]))

    def wait(self) -> None:
        ThreadCopier.calls += 1
        for done in self.pending:
            done.wait()
        self.pending = []


def _factory(device: torch.device) -> DeviceCopier:
    return ThreadCopier(device)


def staged_seconds(state: object, path: str, config: fp.Config) -> tuple[float, float]:
    """``save_async`` until it returns (the caller's time in the call) and until ``wait_staged()``
    returns; the write, and the background removal of the checkpoint it replaced, are then
    waited for, untimed."""
    start = time.perf_counter()
    fut = fp.save_async(state, path, config=config)
    returned = time.perf_counter() - start
    fut.wait_staged()
    seconds = time.perf_counter() - start
    fut.wait()
    fp.wait_removed()
    return returned, seconds


TARGET_PATHS_VS_SAVE = 0.8


def compare_paths(state: dict[str, torch.Tensor] | object, root: str, reps: int) -> None:
    """``--paths``: whole saves of `state` (every tensor staged by the fake engine) through
    ``fp.save``, ``fp.torch_save`` and the DCP writer, interleaved; a first round is untimed."""
    import torch.distributed.checkpoint as dcp

    from fastpersist.integrations.dcp import FastPersistWriter

    doors = {
        "fp.save": lambda p: fp.save(state, p),
        "fp.torch_save": lambda p: fp.torch_save(state, p),
        "dcp.save(FastPersistWriter)": lambda p: dcp.save(state, storage_writer=FastPersistWriter(p)),
    }
    seconds: dict[str, list[float]] = {name: [] for name in doors}
    for rep in range(reps + 1):
        for i, (name, save) in enumerate(doors.items()):
            path = os.path.join(root, f"door{i}")
            start = time.perf_counter()
            save(path)
            if rep:
                seconds[name].append(time.perf_counter() - start)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            fp.wait_removed()
    total = sum(b.nbytes for b in flatten(state).blobs)
    base = statistics.median(seconds["fp.save"])
    print(f"  whole saves from the device state, {reps} reps interleaved (medians):")
    for name, samples in seconds.items():
        median = statistics.median(samples)
        line = f"    {name:<28} {median:.3f} s  {total / median / 1e9:5.2f} GB/s  {base / median:.2f}x fp.save"
        if name != "fp.save":
            line += f" (target {TARGET_PATHS_VS_SAVE}x: {'met' if base / median >= TARGET_PATHS_VS_SAVE else 'MISSED'})"
        print(line)


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
    parser.add_argument(
        "--engine-threads",
        type=int,
        default=1,
        help="intra-op threads of the fake copy engine (1: one core is the engine, the others the host's)",
    )
    parser.add_argument("--paths", action="store_true", help="also time fp.save, fp.torch_save and the DCP writer")
    args = parser.parse_args()
    all_threads = torch.get_num_threads()
    torch.set_num_threads(args.engine_threads)
    engine = ThreadCopier.engine = _CopyEngine()
    if args.layout == "adam":
        state: object = build_state(args.size)
    else:
        state = {f"w{k}": torch.randn(4 << 20) for k in range(max(1, args.size // (16 << 20)))}
    blobs = flatten(state).blobs
    total = sum(b.nbytes for b in blobs)
    src = torch.ones(total, dtype=torch.uint8)
    dst = torch.zeros(total, dtype=torch.uint8)
    # The same copies the save asks for, one per tensor, into a warm buffer: the engine's own time
    # for them, with none of the save's work around it.
    tensor_srcs = [device_bytes(b.source_tensor) for b in blobs]
    starts = [0]
    for t in tensor_srcs[:-1]:
        starts.append(starts[-1] + t.numel())
    tensor_dsts = arena_views(dst, starts, [t.numel() for t in tensor_srcs])
    root = tempfile.mkdtemp(dir=args.dir, prefix="fp-device-staging-")
    variants = {
        "checksums off": fp.Config(checksum="off"),
        "crc32c": fp.Config(checksum="crc32c"),
    }
    staged: dict[str, list[float]] = {name: [] for name in variants}
    returned: list[float] = []
    copies: list[float] = []
    engine_copies: list[float] = []
    engine_tensor_copies: list[float] = []
    calls: dict[int, int] = {}
    try:
        with use_copier(lambda t: True, _factory):
            for rep in range(args.reps + 1):  # the first round makes the arena and warms the pages
                for name, config in variants.items():
                    call_s, seconds = staged_seconds(state, os.path.join(root, "ckpt"), config)
                    if rep:
                        staged[name].append(seconds)
                        returned.append(call_s)
                torch.set_num_threads(all_threads)
                start = time.perf_counter()
                dst.copy_(src)
                if rep:
                    copies.append(time.perf_counter() - start)
                torch.set_num_threads(args.engine_threads)
                start = time.perf_counter()
                engine.copy([dst], [src]).wait()
                if rep:
                    engine_copies.append(time.perf_counter() - start)
                start = time.perf_counter()
                engine.copy(tensor_dsts, tensor_srcs).wait()
                if rep:
                    engine_tensor_copies.append(time.perf_counter() - start)
            for chunk in (1 << 20, 32 << 20):
                ThreadCopier.calls = 0
                fp.save_async(state, os.path.join(root, "calls"), config=fp.Config(chunk_bytes=chunk)).wait()
                calls[chunk] = ThreadCopier.calls
            if args.paths:
                compare_paths(state, root, args.reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    memcpy_s = statistics.median(engine_copies)
    caller_s = statistics.median(copies)
    print(f"state {total / 2**30:.2f} GiB in {len(blobs)} tensors, {args.reps} reps interleaved (medians, min-max)")
    print(
        f"  one memcpy by the engine ({args.engine_threads} thread{'s' if args.engine_threads > 1 else ''})"
        f"       {memcpy_s:.3f} s  {total / memcpy_s / 1e9:5.2f} GB/s"
    )
    per_tensor_s = statistics.median(engine_tensor_copies)
    print(
        f"  the engine's {len(tensor_srcs)} copies, one per tensor  {per_tensor_s:.3f} s  "
        f"{total / per_tensor_s / 1e9:5.2f} GB/s"
    )
    print(
        f"  one memcpy on every core ({all_threads} threads)       {caller_s:.3f} s  {total / caller_s / 1e9:5.2f} GB/s"
    )
    for name, samples in staged.items():
        median = statistics.median(samples)
        line = (
            f"  save_async -> wait_staged, {name:<14} {median:.3f} s  {total / median / 1e9:5.2f} GB/s  "
            f"({min(samples):.3f}-{max(samples):.3f})  {memcpy_s / median:.2f}x memcpy, "
            f"{per_tensor_s / median:.2f}x the per-tensor copies"
        )
        if name == "checksums off":
            verdict = "met" if memcpy_s / median >= TARGET_VS_MEMCPY else "MISSED"
            line += f" (target {TARGET_VS_MEMCPY}x: {verdict})"
        print(line)
    print(
        f"  save_async returns in {statistics.median(returned) * 1e3:.1f} ms (median of both variants; "
        "the copies queued, not landed)"
    )
    chunks = {chunk: -(-total // chunk) for chunk in calls}
    print(
        "  Python calls per save (copy + wait): "
        + ", ".join(f"{calls[c]} at {chunks[c]} chunks of {c >> 20} MiB" for c in calls)
        + ("" if len(set(calls.values())) == 1 else "  GROWS WITH THE CHUNKS")
    )


if __name__ == "__main__":
    main()
