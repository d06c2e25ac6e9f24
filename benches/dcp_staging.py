"""``dcp.async_save`` staging: how long the call holds training, DCP's own stager against
``FastPersistWriter``'s arena staging, on a CPU state.

``dcp.async_save`` returns once the state is staged (copied to host memory); DCP then writes the
copy in the background. Timed per save, interleaved, on the bench's mixed-precision Adam state
(``fastpersist.tools.bench.state``): the call (the staging the training loop waits for) and the
call until the save is done. Writers: ``FileSystemWriter`` (DCP's ``BlockingAsyncStager``: fresh
CPU memory per save) and ``FastPersistWriter`` (a staging arena shared with fastpersist's saves,
made once), each without and with ``cache_staged_state_dict`` (DCP's cached stager pins its copy, so
it runs only where CUDA is there). One ``Tensor.copy_`` of the same
bytes into a warm buffer is the floor. The first save of each writer (the arena or the cache is
made then) is left out.

Run: ``python benches/dcp_staging.py --size 1GiB --reps 5 --dir /data``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from fastpersist.format.flatten import flatten
from fastpersist.integrations.dcp import FastPersistWriter
from fastpersist.tools.bench.state import build_state
from fastpersist.tools.units import parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=1 << 30)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints go (removed)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = build_state(args.size)
    total = sum(b.nbytes for b in flatten(state).blobs)
    src, dst = torch.ones(total, dtype=torch.uint8), torch.zeros(total, dtype=torch.uint8)
    root = tempfile.mkdtemp(dir=args.dir, prefix="fp-dcp-staging-")
    makers: dict[str, Callable[[str], object]] = {
        "DCP stager (FileSystemWriter)": lambda p: FileSystemWriter(p),
        "DCP stager, cached": lambda p: FileSystemWriter(p, cache_staged_state_dict=True),
        "arena (FastPersistWriter)": lambda p: FastPersistWriter(p),
        "arena, cached": lambda p: FastPersistWriter(p, cache_staged_state_dict=True),
    }
    if not torch.cuda.is_available():  # BlockingAsyncStager pins its cache, which needs a CUDA driver
        del makers["DCP stager, cached"]
    writers = {name: make(f"{root}/{k}") for k, (name, make) in enumerate(makers.items())}
    calls: dict[str, list[float]] = {name: [] for name in writers}
    saves: dict[str, list[float]] = {name: [] for name in writers}
    copies: list[float] = []
    try:
        for rep in range(args.reps + 1):
            for name, writer in writers.items():
                start = time.perf_counter()
                fut = dcp.async_save(state, storage_writer=writer)  # type: ignore[arg-type]
                staged = time.perf_counter()
                fut.result()
                done = time.perf_counter()
                if rep:
                    calls[name].append(staged - start)
                    saves[name].append(done - start)
            start = time.perf_counter()
            dst.copy_(src)
            if rep:
                copies.append(time.perf_counter() - start)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    floor = statistics.median(copies)
    print(f"state {total / 2**30:.2f} GiB, {args.reps} reps interleaved (medians, min-max)")
    print(f"  one memcpy (Tensor.copy_)          {floor:.3f} s")
    for name in writers:
        call = statistics.median(calls[name])
        print(
            f"  {name:<30} call {call:.3f} s ({min(calls[name]):.3f}-{max(calls[name]):.3f}) "
            f"= {call / floor:4.1f}x memcpy; save {statistics.median(saves[name]):.3f} s"
        )


if __name__ == "__main__":
    main()
