"""fio, the reference for the drive's write limit: one way to run it for every benchmark.

Example:
    >>> fio_engine() in ("io_uring", "libaio")
    True
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

import fastpersist._core as _core

__all__ = ["FioRun", "fio_engine", "run_fio_write"]


@dataclass(frozen=True)
class FioRun:
    """What one fio write did: bytes and fio's own clock (writes and the end_fsync, no start-up)."""

    io_bytes: int
    runtime_s: float


def fio_engine() -> str:
    """io_uring where it works here (as for our engine), else libaio."""
    return "io_uring" if _core.probe_uring() is None else "libaio"


def run_fio_write(paths: Sequence[str], bytes_per_file: int, *, block_bytes: int, iodepth: int) -> FioRun:
    """Writes `bytes_per_file` to each of `paths` at once with O_DIRECT, then fsyncs.

    fio's default fallocate preallocates each file before timing, as the engine does: on ext4,
    O_DIRECT writes past the end of a file are serialised, inside it they run in parallel.
    """
    size = max(-(-bytes_per_file // block_bytes) * block_bytes, block_bytes)  # fio rounds down to bs
    command = [
        "fio",
        "--rw=write",
        f"--bs={block_bytes}",
        f"--iodepth={iodepth}",
        "--direct=1",
        "--end_fsync=1",
        f"--ioengine={fio_engine()}",
        "--output-format=json",
    ]
    for i, path in enumerate(paths):
        command += [f"--name=w{i}", f"--filename={path}", f"--size={size}"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"fio failed: {(done.stderr or done.stdout).strip()[-1000:]}")
    jobs = json.loads(done.stdout[done.stdout.index("{") :])["jobs"]
    io_bytes = sum(int(j["write"]["io_bytes"]) for j in jobs)
    runtime_s = max(float(j["write"]["runtime"]) for j in jobs) / 1000
    return FioRun(io_bytes=io_bytes, runtime_s=max(runtime_s, 0.001))
