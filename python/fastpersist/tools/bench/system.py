"""What ``fastpersist bench`` asks of the OS: page cache, peak RSS, heap, files, the machine.

Also the units and the progress line that every module of the benchmark shares.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np

import fastpersist._core as _core

from ...loading.reading import aligned_uint8
from ...saving.target import remove_checkpoint_tree

Backend = Literal["io_uring", "threads"]
GB = 1e9
MiB = 1 << 20


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def remove_path(path: str) -> None:
    if os.path.isdir(path):
        remove_checkpoint_tree(path)  # also removes the stripe directories its manifest names
    elif os.path.lexists(path):
        os.remove(path)


def drop_caches() -> bool:
    """Writes back dirty pages and drops the page cache; False where that is not permitted."""
    os.sync()
    return _write_proc("/proc/sys/vm/drop_caches", "3\n")


def evict_files(dirs: Sequence[str]) -> None:
    """Writes back dirty pages, then evicts every file under `dirs` from the page cache.

    ``posix_fadvise(DONTNEED)``: the unprivileged way to make the next read of these files cold
    where :func:`drop_caches` is refused (other files stay cached).
    """
    os.sync()
    for d in dirs:
        for parent, _dirs, files in os.walk(d):
            for name in files:
                with contextlib.suppress(OSError):
                    fd = os.open(os.path.join(parent, name), os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)


def _write_proc(path: str, value: str) -> bool:
    """Writes `value` to a /proc control file; False where the kernel refuses (no privilege)."""
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError:
        return False
    return True


def status_bytes(field_name: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM) in bytes; 0 if unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A prefilled (touched) page-aligned uint8 array of `nbytes` rounded up to 4096, +4096 slack."""
    buf = aligned_uint8(nbytes).numpy()  # the array keeps the tensor (and its memory) alive
    buf.fill(0x5A)
    return buf


def release_memory() -> None:
    """Collects garbage and hands freed heap memory back to the kernel (glibc ``malloc_trim``).

    Tensors below glibc's mmap threshold (up to 32 MiB) live on the heap; without the trim a
    freed multi-GiB state can stay resident and add to the next method's peak.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_peak_rss() -> bool:
    """Resets this process's VmHWM to its current RSS (``/proc/self/clear_refs``); False if refused."""
    return _write_proc("/proc/self/clear_refs", "5\n")


def _filesystem_of(directory: str) -> str:
    try:
        done = subprocess.run(
            ["findmnt", "-n", "-o", "SOURCE,FSTYPE", "--target", directory], capture_output=True, text=True, check=False
        )
    except OSError:
        return "unknown"
    return done.stdout.strip() or "unknown"


def machine_info(dirs: Sequence[str]) -> dict[str, Any]:
    import torch

    versions: dict[str, str] = {
        "fastpersist": _core.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }
    try:
        import safetensors

        versions["safetensors"] = safetensors.__version__
    except ImportError:
        pass
    if shutil.which("fio"):
        done = subprocess.run(["fio", "--version"], capture_output=True, text=True, check=False)
        versions["fio"] = done.stdout.strip()
    mem = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    return {
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "memory_bytes": mem,
        "filesystems": [f"{d}: {_filesystem_of(d)}" for d in dirs],
        "versions": versions,
    }


@contextlib.contextmanager
def run_dirs_for(dirs: Sequence[str], prefix: str = ".fastpersist-bench-") -> Iterator[list[str]]:
    """A fresh directory in each of `dirs`, removed with everything in it on exit."""
    made = []
    try:
        for d in dirs:
            os.makedirs(d, exist_ok=True)
            made.append(tempfile.mkdtemp(prefix=prefix, dir=d))
        yield made
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)
