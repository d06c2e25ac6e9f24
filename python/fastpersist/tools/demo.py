"""``fastpersist demo``: fastpersist against torch.save and safetensors on one training state.

Builds a synthetic GPT-style mixed-precision Adam state (bf16 weights, fp32 master copy and
moments: hundreds of tensors) and times, round after round with the methods interleaved so that
drift of a shared disk hits every method alike:

* durable saves (fsync included for every method): torch.save, safetensors.save_file,
  fastpersist.save, and fastpersist.save_async (when it returns, when wait_staged() returns:
  what a training loop waits for, and when the checkpoint is durable);
* cold loads: torch.load, safetensors.load_file, fastpersist.load.

The page cache is dropped before every timed save and load (where that is not permitted, this
run's files are evicted with posix_fadvise instead, and the output says so). It prints the
median, min and max of each and the ratio to torch.save (torch.load for loads), reloads the
checkpoint and compares it bit for bit, then removes every file it wrote.

Example:
    $ fastpersist demo                       # 1 GiB, 3 rounds, in the current directory
    $ fastpersist demo --size 256MiB --reps 5 --dir /mnt/nvme0
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from typing import Any

import fastpersist as fp

from ..config import Config
from .bench.harness import Bench
from .bench.loads import add_fastpersist_load, add_safetensors_loads, add_torch_load
from .bench.measure import Row
from .bench.saves import add_fastpersist_save, add_safetensors_save, add_save_async, add_torch_save
from .bench.settings import settle_settings
from .bench.system import GB, run_dirs_for
from .units import parse_size

__all__ = ["add_demo_parser", "cmd_demo"]

# The outputs of torch.save, safetensors and fastpersist.save are kept for the loads while
# save_async writes a fourth copy; a little more for the manifests and the file system.
DISK_FACTOR = 4.2


class StatusLine:
    """Progress on stderr: one line rewritten in place on a terminal, a line per message otherwise."""

    def __init__(self) -> None:
        self._tty = sys.stderr.isatty()
        self._start = time.perf_counter()

    def show(self, message: str) -> None:
        """Shows `message`, prefixed with the seconds since the demo started."""
        text = f"[demo {time.perf_counter() - self._start:4.0f} s] {message}"
        if self._tty:
            width = shutil.get_terminal_size().columns - 1
            sys.stderr.write("\r\033[K" + text[:width])
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def clear(self) -> None:
        """Removes the status line from the terminal."""
        if self._tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()

    def elapsed_s(self) -> float:
        return time.perf_counter() - self._start


def add_demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``demo`` on the CLI's sub-parsers."""
    p = sub.add_parser(
        "demo",
        help="time durable saves and cold loads of a 1 GiB training state against torch.save and safetensors",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--size", type=parse_size, default=parse_size("1GiB"), help="state size (default 1GiB)")
    p.add_argument("--dir", help="where to write (default: the current directory); everything is removed after")
    p.add_argument("--reps", type=int, default=3, help="rounds: each method runs once per round (default 3)")
    p.add_argument("--keep", action="store_true", help="keep the fastpersist checkpoint (as DIR/fastpersist-demo-ckpt)")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    """Runs the demo as `args` asks (see :func:`add_demo_parser`); 0 if the checkpoint reloaded bit-identical."""

    parent = os.path.abspath(args.dir or os.getcwd())
    kept = os.path.join(parent, "fastpersist-demo-ckpt")
    _check_arguments(args, parent, kept)
    defaults = Config()
    bench_args = argparse.Namespace(
        size=args.size,
        reps=args.reps,
        chunk_bytes=defaults.chunk_bytes,
        queue_depth=defaults.queue_depth,
        pool_bytes=defaults.pool_bytes,
    )
    status = StatusLine()
    notes: list[str] = [settle_settings(bench_args, parent)]
    with run_dirs_for([parent], prefix=".fastpersist-demo-") as run_dirs:
        bench = Bench(bench_args, run_dirs, notes, say=status.show)
        try:
            _add_methods(bench)
            bench.run_saves(cold=True)
            bench.run_loads()
            status.show("reloading the checkpoint and comparing it bit for bit ...")
            checkpoint = bench.path(f"fp-{bench.backends[0]}")
            same = _bit_identical(fp.load(checkpoint), bench.state)
            if args.keep:
                os.rename(checkpoint, kept)
        finally:
            status.show("removing the demo's files ...")
            bench.cleanup()
    status.clear()
    print(_report(bench, parent, notes), flush=True)
    where = f"kept at {kept}" if args.keep else "removed"
    print(
        f"\ncheckpoint: {bench.tensor_count} tensors, every chunk's crc32c checked by fastpersist.load; "
        f"reloaded bit-identical: {same}; {where}. The demo took {status.elapsed_s():.0f} s.",
        flush=True,
    )
    return 0 if same else 1


def _check_arguments(args: argparse.Namespace, parent: str, kept: str) -> None:
    if args.reps < 1:
        raise SystemExit("fastpersist demo: --reps must be at least 1")
    os.makedirs(parent, exist_ok=True)
    if args.keep and os.path.exists(kept):
        raise SystemExit(f"fastpersist demo: {kept} exists; remove it or leave out --keep")
    free = shutil.disk_usage(parent).free
    if free < DISK_FACTOR * args.size:
        raise SystemExit(
            f"fastpersist demo: {parent} has {free / 2**30:.1f} GiB free and the demo needs about "
            f"{DISK_FACTOR * args.size / 2**30:.1f} GiB; pass a smaller --size or another --dir"
        )


def _add_methods(bench: Bench) -> None:
    """The demo's methods, in the order each round runs them and the table lists them."""
    add_torch_save(bench)
    add_safetensors_save(bench)
    add_fastpersist_save(bench, bench.backends[0])
    add_save_async(bench)
    add_torch_load(bench)
    add_safetensors_loads(bench, pread=False)
    add_fastpersist_load(bench)


def _bit_identical(a: Any, b: Any) -> bool:
    """Whether `a` and `b` hold the same structure, values and tensor bytes (dtype and shape included)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_bit_identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_bit_identical, a, b))
    return bool(a == b)


def _report(bench: Bench, parent: str, notes: list[str]) -> str:
    """The demo's table: each row's median, min-max, GB/s and its ratio to torch.save or torch.load."""
    saves = [r for r in bench.rows.values() if r.kind == "save" and r.seconds]
    loads = [r for r in bench.rows.values() if r.kind == "load" and r.seconds]
    backend = bench.backends[0]
    lines = [
        f"fastpersist demo: a {_mib_or_gib(bench.nbytes)} mixed-precision Adam state ({bench.tensor_count} "
        f"tensors), {bench.args.reps} round(s) with the methods interleaved, written to {parent}",
        f"fastpersist: default Config (backend {backend}, {bench.args.pool_bytes >> 20} MiB staging pool, "
        f"{'O_DIRECT' if bench.direct == 'require' else 'buffered where O_DIRECT is refused'})",
    ]
    if bench.cold:
        lines.append("page cache: dropped (sync, /proc/sys/vm/drop_caches) before every timed save and load")
    lines += [f"note: {n}" for n in notes]
    header = f"{'median s':>9} {'min-max s':>13} {'GB/s':>6}"
    lines += ["", f"{'durable save (fsync included)':45} {header} {'vs torch.save':>14}"]
    lines += [_row_line(r, bench.nbytes, bench.rows.get("torch_save")) for r in saves]
    lines += ["", f"{'cold load':45} {header} {'vs torch.load':>14}"]
    lines += [_row_line(r, bench.nbytes, bench.rows.get("torch_load")) for r in loads]
    lines += [
        "",
        "vs torch.save, vs torch.load: torch's median time over this row's (2.00x: it takes half the time).",
        "save_async: 'return' is when the call gives training control back; 'staged' is when wait_staged()",
        "returns, after which the optimizer may change the tensors: training stalls for what of it the next",
        "forward/backward does not cover. With the default staging pool, smaller than this state (bounded),",
        "staging ends once all but the pool's bytes are written; Config(pool_bytes=...) of at least the",
        "state's size makes it a memory copy (snapshot). 'durable' is when the save is committed.",
        "min-max: the fastest and the slowest round; on a shared or virtual disk the spread can be wide.",
    ]
    return "\n".join(lines)


def _mib_or_gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def _row_line(row: Row, nbytes: int, base: Row | None) -> str:
    med = row.median()
    spread = f"{min(row.seconds):.3f}-{max(row.seconds):.3f}"
    rate = f"{nbytes / med / GB:6.2f}" if row.rate else f"{'-':>6}"
    ratio = f"{base.median() / med:13.2f}x" if base is not None and base.seconds else f"{'-':>14}"
    return f"  {row.label:43} {med:9.3f} {spread:>13} {rate} {ratio}"
