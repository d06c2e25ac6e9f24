"""Code that runs inside each rank of the shared-read tests (spawned processes, gloo backend)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

import fastpersist as fp
import fastpersist.loading.pipeline
import fastpersist.loading.shared_read
from fastpersist.format.manifest import read_manifest

from dist_workers import SCENARIOS, make_state
from dist_workers import run as run_scenario

CHUNK_BYTES = 64 << 10


def bits(a: Any, b: Any) -> bool:
    """Bit-identical: same structure, dtypes, shapes and bytes (NaN payloads included)."""
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape):
            return False
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(bits(a[k], b[k]) for k in a)
    return type(a) is type(b) and bool(a == b)


def count_reads() -> dict[str, int]:
    """Counts the stream bytes this process reads, on the shared path and on the old one."""
    counts = {"shared": 0, "whole": 0}
    read_window, read_stream = fastpersist.loading.shared_read.read_window, fastpersist.loading.pipeline.read_stream

    def counted_window(root: str, m: Any, lo: int, hi: int, *args: Any) -> None:
        counts["shared"] += hi - lo
        read_window(root, m, lo, hi, *args)

    def counted_stream(root: str, m: Any, *args: Any) -> Any:
        counts["whole"] += m.total_bytes
        return read_stream(root, m, *args)

    fastpersist.loading.shared_read.read_window = counted_window  # type: ignore[assignment]
    fastpersist.loading.pipeline.read_stream = counted_stream  # type: ignore[assignment]
    return counts


def save_replicated(workdir: str, backend: str) -> tuple[str, dict[str, Any]]:
    state = make_state(11, tensors=24)
    state["odd"] = torch.tensor([float("nan"), -0.0, float("inf")])
    state["ints"] = torch.arange(1000, dtype=torch.int64)
    state["tokenizer"] = bytes(range(256)) * 40  # over 4 KiB: a bytes value in the shared stream
    path = os.path.join(workdir, "ckpt")
    fp.save(state, path, config=fp.Config(backend=backend, chunk_bytes=CHUNK_BYTES), group=dist.group.WORLD)
    return path, state


def shared_read(rank: int, world: int, workdir: str, backend: str) -> dict[str, Any]:
    path, state = save_replicated(workdir, backend)
    counts = count_reads()
    cfg = fp.Config(backend=backend)
    loaded = fp.load(path, group=dist.group.WORLD, config=cfg)
    share = dict(counts)
    old = fp.load(path, group=dist.group.WORLD, config=cfg, shared_read=False)
    old_counts = {k: counts[k] - share[k] for k in counts}
    single = fp.load(path, config=cfg)  # a single-process load, for reference
    return {
        "same": bits(state, loaded) and bits(single, loaded),
        "same_old": bits(state, old),
        "share": share,
        "old": old_counts,
        "total_bytes": read_manifest(path).total_bytes,
    }


def corrupt_share(rank: int, world: int, workdir: str, backend: str) -> dict[str, Any]:
    """Rank 0 damages one chunk in the share of the last rank; every rank then loads."""
    path, _state = save_replicated(workdir, backend)
    if rank == 0:
        m = read_manifest(path)
        lo, _hi = fastpersist.loading.shared_read.read_shares(m.total_bytes, m.chunk_bytes, world)[-1]
        f = next(f for f in m.files if f.stream_offset_bytes <= lo < f.stream_offset_bytes + f.len_bytes)
        with open(m.file_path(path, f), "r+b") as out:
            out.seek(lo - f.stream_offset_bytes + 100)
            byte = out.read(1)
            out.seek(-1, os.SEEK_CUR)
            out.write(bytes([byte[0] ^ 0xFF]))
            out.flush()
            os.fsync(out.fileno())
    dist.barrier()
    started = time.monotonic()
    try:
        fp.load(path, group=dist.group.WORLD, config=fp.Config(backend=backend, timeout_s=30.0))
    except fp.CorruptCheckpointError as e:
        error = f"{type(e).__name__}: {e}"
        checksum = isinstance(e, fp.ChecksumMismatchError) and e.filename is not None
    else:
        error, checksum = "", False
    return {"error": error, "checksum": checksum, "elapsed": time.monotonic() - started}


def hung_reader(rank: int, world: int, workdir: str, backend: str) -> dict[str, Any]:
    """Rank 1 stalls inside its read for longer than timeout_s; every rank must still raise."""
    path, _state = save_replicated(workdir, backend)
    if rank == 1:
        read_window = fastpersist.loading.shared_read.read_window

        def stalled(*args: Any) -> None:
            time.sleep(8)
            read_window(*args)

        fastpersist.loading.shared_read.read_window = stalled  # type: ignore[assignment]
    started = time.monotonic()
    group_error = False
    try:
        fp.load(path, group=dist.group.WORLD, config=fp.Config(backend=backend, timeout_s=3.0))
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        group_error = isinstance(e, fp.GroupLoadError) and isinstance(e, fp.FastPersistError)
    else:
        error = ""
    return {"error": error, "group_error": group_error, "elapsed": time.monotonic() - started}


def run(rank: int, world: int, init_file: str, scenario: str, workdir: str, backend: str) -> None:
    """Entry point of each spawned rank (see dist_workers.run)."""
    SCENARIOS.update({"shared_read": shared_read, "corrupt_share": corrupt_share, "hung_reader": hung_reader})
    run_scenario(rank, world, init_file, scenario, workdir, backend)
