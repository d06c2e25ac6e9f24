"""The ``fastpersist`` command line: ``demo``, ``bench``, ``inspect PATH``, ``verify PATH``, ``convert``, ``export``."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, Literal

from .bench.state import build_state
from .clitools import STRIPES_HELP, Progress, add_convert_parser, add_export_parser, add_inspect_parser
from .units import parse_size

__all__ = ["main", "parse_size"]


def _state_bytes(state: Any) -> int:
    import torch

    total = 0
    stack = [state]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            total += node.numel() * node.element_size()
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return total


def cmd_demo(args: argparse.Namespace) -> int:
    import torch

    import fastpersist as fp

    from .. import _core

    root = args.dir or tempfile.mkdtemp(prefix="fastpersist-demo-", dir=os.getcwd())
    os.makedirs(root, exist_ok=True)
    print(f"building a {args.size / 2**20:.0f} MiB mixed-precision Adam state ...", flush=True)
    state = build_state(args.size)
    nbytes = _state_bytes(state)
    backends: list[Literal["io_uring", "threads"]] = ["threads"]
    try:
        _core.select_backend("io_uring")
        backends.insert(0, "io_uring")
    except fp.BackendUnavailableError as e:
        print(f"note: {e}")
    times: dict[str, list[float]] = {}
    ckpt = os.path.join(root, "demo-ckpt")
    torch_file = os.path.join(root, "demo.pt")
    bar = Progress(total=args.reps * (len(backends) + 1), desc="demo saves")
    for rep in range(args.reps):
        for backend in backends:
            t = time.perf_counter()
            fp.save(state, ckpt, config=fp.Config(backend=backend))
            times.setdefault(f"fastpersist.save ({backend})", []).append(time.perf_counter() - t)
            bar.update()
        t = time.perf_counter()
        torch.save(state, torch_file)
        _core.fsync_path(torch_file)
        times.setdefault("torch.save + fsync", []).append(time.perf_counter() - t)
        bar.update()
        os.remove(torch_file)
        print(f"  repetition {rep + 1}/{args.reps} done", flush=True)
    bar.close()
    loaded = fp.load(ckpt)
    same = all(
        torch.equal(loaded["model"][k].view(torch.int16), state["model"][k].view(torch.int16)) for k in state["model"]
    ) and all(
        torch.equal(loaded["optimizer"]["state"][i]["exp_avg"], v["exp_avg"])
        for i, v in state["optimizer"]["state"].items()
    )
    info = fp.inspect(ckpt)
    print(
        f"\ncheckpoint {ckpt}: {info['tensors']} tensors, {info['bytes'] / 2**20:.1f} MiB, "
        f"{len(info['files'])} file(s); reloaded bit-identical: {same}; verify: {fp.verify(ckpt)['chunks']} chunks ok"
    )
    print(f"\n{'method':32} {'median s':>9} {'GB/s':>7} {'vs torch.save':>14}")
    base = statistics.median(times["torch.save + fsync"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:32} {med:9.3f} {nbytes / med / 1e9:7.2f} {base / med:13.2f}x")
    if not args.keep:
        shutil.rmtree(ckpt, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    return 0 if same else 1


def cmd_verify(args: argparse.Namespace) -> int:
    import fastpersist as fp

    t = time.perf_counter()
    try:
        with Progress(total=None, desc="verify", unit="B", unit_scale=True) as bar:
            config = fp.Config(stripes=args.stripes) if args.stripes else None
            summary = fp.verify(args.path, progress=bar.update, config=config)
    except (fp.CorruptCheckpointError, FileNotFoundError) as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - t
    print(
        f"ok: {summary['files']} file(s), {summary['chunks']} chunk(s), {summary['bytes']:,} bytes "
        f"verified in {seconds:.2f} s"
    )
    return 0


def cmd_clean(args: argparse.Namespace) -> int:
    """``fastpersist clean ROOT [--stripes DIR ...] [--dry-run]``: remove leftovers of interrupted saves."""
    import fastpersist as fp

    removed = fp.clean(args.root, stripes=args.stripes, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for path in removed:
        print(f"{verb} {path}")
    print(f"{len(removed)} leftover(s) {'found (dry run: nothing removed)' if args.dry_run else 'removed'}")
    return 0


def add_clean_parser(sub: Any) -> None:
    """Registers ``clean`` on the CLI's sub-parsers."""
    p = sub.add_parser("clean", help="remove what interrupted saves left behind (temporary and stripe directories)")
    p.add_argument("root", help="the directory holding the checkpoints (a Checkpointer root, or a save's parent)")
    p.add_argument("--stripes", nargs="+", metavar="DIR", help="the stripe roots the saves used (Config.stripes)")
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.set_defaults(func=cmd_clean)


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    return bench.run_cli(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastpersist", description="Fast, safe deep-learning checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="save and reload a synthetic training state, timed against torch.save",
        description="Builds a synthetic mixed-precision Adam state, saves it with fastpersist (each backend) and "
        "with torch.save + fsync, reloads and verifies it, and prints the medians.",
    )
    demo.add_argument("--size", type=parse_size, default=parse_size("256MiB"), help="state size (default 256MiB)")
    demo.add_argument("--dir", help="where to write (default: a temporary directory under the current one)")
    demo.add_argument("--reps", type=int, default=3, help="repetitions per method (default 3)")
    demo.add_argument("--keep", action="store_true", help="keep the checkpoint")
    demo.set_defaults(func=cmd_demo)
    from . import bench

    bench_parser = sub.add_parser(
        "bench",
        help="time saves and cold loads against the drive's limit, torch.save, safetensors and DCP",
        description=bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(func=cmd_bench)
    add_inspect_parser(sub)
    ver = sub.add_parser(
        "verify",
        help="check every chunk's checksum",
        description="Checks a checkpoint end to end: manifest, file sizes and every chunk's crc32c.",
    )
    ver.add_argument("path", help="checkpoint directory")
    ver.add_argument("--stripes", nargs="+", metavar="DIR", help=STRIPES_HELP)
    ver.set_defaults(func=cmd_verify)
    add_convert_parser(sub)
    add_export_parser(sub)
    from . import advise as advise_cli

    advise_cli.register(sub)
    add_clean_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fastpersist`` console script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
