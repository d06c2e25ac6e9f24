"""Preflight of the GPU check (scripts/gpu_check.sh): what this machine offers fastpersist.

Prints glibc, the kernel, Python, torch and CUDA, where fastpersist was imported from and the
wheel tag it was installed from, the I/O backend a save chooses (and why), and whether the
target directory takes O_DIRECT. Then checks that a save and load work with the thread backend
(the one left where io_uring is absent, as under gVisor) and with the backend chosen, and, with a
GPU, that the staging slot a save copies a device tensor into reports pinned (a failed
``cudaHostRegister`` leaves it pageable: every device-to-host copy then runs at pageable speed).
Each check prints ``ok`` or ``FAIL``; the exit status is 1 if any failed.

Run: ``python benches/gpu_preflight.py --dir /data [--require-cuda]``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import shutil
import sys
from collections.abc import Sequence
from typing import Literal

import torch

import fastpersist as fp
from fastpersist import _core
from fastpersist.gpu.copiers import CudaCopier, use_copier

MiB = 1 << 20


def _wheel_tag() -> str:
    """The tag of the wheel the imported fastpersist was installed from."""
    try:
        dist = importlib.metadata.distribution("fastpersist")
    except importlib.metadata.PackageNotFoundError:
        return "none (not installed from a wheel)"
    installed = os.path.realpath(str(dist.locate_file("fastpersist/__init__.py")))
    if installed != os.path.realpath(fp.__file__):
        return f"none (the fastpersist imported is not the one installed at {os.path.dirname(installed)})"
    wheel = dist.read_text("WHEEL") or ""
    return ", ".join(line.split(":", 1)[1].strip() for line in wheel.splitlines() if line.startswith("Tag:"))


def describe(root: str) -> None:
    with open("/proc/version") as f:
        kernel = f.read().strip()
    backend, reason = _core.select_backend("auto")
    print(f"glibc: {os.confstr('CS_GNU_LIBC_VERSION')}; kernel: {platform.release()} ({kernel})")
    print(f"python {platform.python_version()} at {sys.executable}")
    print(
        f"torch {torch.__version__}, built for CUDA {torch.version.cuda}; CUDA available: {torch.cuda.is_available()}"
    )
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(
            f"GPU: {props.name}, compute capability {props.major}.{props.minor}, "
            f"{props.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} device(s)"
        )
    print(f"fastpersist {fp.__version__} from {os.path.dirname(fp.__file__)}; wheel tag: {_wheel_tag()}")
    print(f"io_uring probe: {_core.probe_uring() or 'available'}")
    print(f"backend a save chooses: {backend}{f' ({reason})' if reason else ''}")
    direct, memory = _core.direct_io_supported(root), _core.is_memory_fs(root)
    print(f"direct I/O (O_DIRECT) in {root}: {direct}; memory filesystem: {memory}")


def check_backend(root: str, backend: Literal["auto", "threads"]) -> bool:
    """A save and load of 24 MiB (three 8 MiB chunks) with `backend`, compared bit for bit."""
    w = torch.randn(6 * MiB)
    path = os.path.join(root, f"backend-{backend}")
    try:
        result = fp.save({"w": w}, path, config=fp.Config(backend=backend))
        ok = torch.equal(fp.load(path)["w"], w)
    except Exception as e:
        print(f"FAIL: save and load with backend={backend}: {type(e).__name__}: {e}")
        return False
    print(f"{'ok' if ok else 'FAIL'}: save and load with backend={backend} (the save used {result.backend})")
    return ok


def check_pinned_slot(root: str) -> bool:
    """Saves a CUDA tensor through the real copier, watching the arena it copies into."""
    pinned: list[bool] = []

    class Watching(CudaCopier):
        def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, early: bool = False) -> None:
            super().copy(pairs, early=early)
            pinned.extend(dst.is_pinned() for _, dst in pairs)

    control = torch.frombuffer(_core.PagedBuffer(MiB), dtype=torch.uint8).is_pinned()
    w = torch.randn(8 * MiB, device="cuda")  # 32 MiB: above the early-copy bound, so the copier stages it
    path = os.path.join(root, "pinned")
    with use_copier(lambda t: t.is_cuda, Watching):
        fp.save({"w": w}, path)
    same = torch.equal(fp.load(path, map_location="cuda")["w"], w)
    ok = bool(pinned) and all(pinned) and not control and same
    print(
        f"{'ok' if ok else 'FAIL'}: {len(pinned)} copies into the staging arena, pinned: {sorted(set(pinned))} "
        f"(an unregistered buffer reports {control}); round trip of the CUDA tensor: {'ok' if same else 'MISMATCH'}"
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp", help="the checks save into DIR/preflight (removed at the end)")
    parser.add_argument("--require-cuda", action="store_true", help="fail if torch sees no CUDA device")
    args = parser.parse_args(argv)
    root = os.path.join(args.dir, "preflight")
    os.makedirs(root, exist_ok=True)
    describe(root)
    ok = check_backend(root, "threads")
    ok = check_backend(root, "auto") and ok
    if torch.cuda.is_available():
        ok = check_pinned_slot(root) and ok
    elif args.require_cuda:
        print("FAIL: torch sees no CUDA device (driver, CUDA_VISIBLE_DEVICES, or a CPU-only torch)")
        ok = False
    else:
        print("no CUDA device: the pinned staging slot check is skipped")
    shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
