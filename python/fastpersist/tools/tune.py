"""``fastpersist tune DIR...``: measure each directory's device and cache its best settings.

Each distinct device among the directories is swept once (:mod:`fastpersist.tools.sweep`),
its figures printed as a table, and the best write and read settings stored in the tuning
cache (:mod:`fastpersist.tuning.cache`), where ``Config(chunk_bytes="auto", queue_depth="auto")``
finds them for every later save and load on that device.

Example:
    >>> main(["--seconds", "0.5", "/tmp"])   # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import sys
from collections.abc import Sequence

from ..config import Config
from ..tuning.cache import Best, TuneEntry, cache_path, check_writable, store
from ..tuning.identity import device_identity
from .sweep import SweepLimits, SweepResult, sweep
from .units import parse_size

__all__ = ["add_arguments", "main", "register", "result_table", "run_cli"]

DESCRIPTION = """\
Measures each directory's device with short writes and reads through fastpersist's engine
(O_DIRECT, crc32c, fsync, as a save and a load do): every chunk size at depth 8, then every
queue depth at the best chunk size, then (where several of the directories share a drive, as
stripes would) 2, 4 ... concurrent writers at that setting, then read depths at that chunk size,
within --seconds per device. The best settings are cached per device (block device number, model, serial and
filesystem) in $FASTPERSIST_TUNE_CACHE, else $XDG_CACHE_HOME/fastpersist/tune.json, else
~/.cache/fastpersist/tune.json; Config(chunk_bytes="auto", queue_depth="auto") (the default)
uses them. The scratch files are removed. Figures measured while other work loads the
machine are noisy: tune on a quiet machine.
"""


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(parse_size(part) for part in text.split(",") if part.strip())


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r} (try 1,4,16)") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``tune`` options to `parser`."""
    limits = SweepLimits()
    parser.add_argument(
        "dirs", nargs="+", metavar="DIR", help="directories whose devices to tune (one sweep per device)"
    )
    parser.add_argument(
        "--seconds", type=float, default=limits.seconds, help=f"time box per device (default {limits.seconds:g})"
    )
    parser.add_argument(
        "--chunk-sizes", type=_sizes, default=limits.chunk_sizes, help="chunk sizes to try (default 1MiB,...,64MiB)"
    )
    parser.add_argument(
        "--depths", type=_ints, default=limits.depths, help="queue depths to try (default 1,2,4,8,16,32)"
    )
    parser.add_argument(
        "--pool-bytes",
        type=parse_size,
        default=Config().pool_bytes,
        help="the staging pool the settings must fit (Config.pool_bytes; default 256MiB)",
    )
    parser.add_argument(
        "--max-trial-bytes",
        type=parse_size,
        default=limits.max_trial_bytes,
        help="most bytes per trial (default 512MiB)",
    )


def result_table(result: SweepResult) -> str:
    """The figures of one device, best settings marked with ``*``."""
    title = f"{result.identity.describe()}: {len(result.figures)} trials in {result.seconds:.1f} s"
    lines = [title + ("" if result.direct else " (O_DIRECT refused: buffered I/O)")]
    head = f"  {'op':<6}{'chunk MiB':>10}{'depth':>7}{'writers':>8}{'GB/s':>8}{'MiB moved':>11}"
    lines += [head, "  " + "-" * (len(head) - 2)]
    chosen: list[tuple[str, Best | None]] = [("write", result.write), ("read", result.read)]
    for f in sorted(result.figures, key=lambda f: (f.op != "write", f.writers, f.chunk_bytes, f.queue_depth)):
        mark = f.writers == 1 and any(
            op == f.op and b and (b.chunk_bytes, b.queue_depth) == (f.chunk_bytes, f.queue_depth) for op, b in chosen
        )
        lines.append(
            f"  {f.op:<6}{f.chunk_bytes / 2**20:>10g}{f.queue_depth:>7}{f.writers:>8}{f.gb_per_s:>8.2f}"
            f"{f.bytes / 2**20:>11.0f}{' *' if mark else ''}"
        )
    if result.finals:
        finals = ", ".join(f"{f.chunk_bytes / 2**20:g} MiB x {f.queue_depth} {f.gb_per_s:.2f}" for f in result.finals)
        lines.append(f"  write finalists, GB/s median of their trials: {finals}")
    best = f"  best: write {result.write.chunk_bytes / 2**20:g} MiB x depth {result.write.queue_depth}"
    if result.read is not None:
        best += f", read depth {result.read.queue_depth}"
    if result.writers_per_drive is not None:
        best += f", {result.writers_per_drive} writer(s) per drive"
    return "\n".join([*lines, best])


def run_cli(args: argparse.Namespace) -> int:
    """Runs ``fastpersist tune`` as parsed; returns the exit status."""
    try:
        limits = SweepLimits(
            seconds=args.seconds,
            chunk_sizes=args.chunk_sizes,
            depths=args.depths,
            pool_bytes=args.pool_bytes,
            max_trial_bytes=args.max_trial_bytes,
        )
        check_writable()  # before measuring: a sweep whose result cannot be kept is wasted
    except (ValueError, OSError) as e:
        print(f"fastpersist tune: {e}", file=sys.stderr)
        return 2
    for directory in args.dirs:
        if not os.path.isdir(directory):
            print(f"fastpersist tune: {directory}: not a directory", file=sys.stderr)
            return 2
    # Several directories on one drive are stripes that will share it: measure writers per drive.
    per_device = collections.Counter(device_identity(d).key for d in args.dirs)
    seen: set[str] = set()
    for directory in args.dirs:
        identity = device_identity(directory)
        if identity.key in seen:
            print(f"{directory}: same device as an earlier directory ({identity.describe()}), skipped")
            continue
        seen.add(identity.key)
        print(
            f"tuning {identity.describe()} in {os.path.abspath(directory)} (about {limits.seconds:g} s) ...", flush=True
        )
        result = sweep(directory, limits, writers=per_device[identity.key])
        entry = TuneEntry(
            device=result.identity.to_json(),
            tuned_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            write=result.write,
            read=result.read,
            figures=result.figures,
            pool_bytes=limits.pool_bytes,
            seconds=round(result.seconds, 3),
            writers_per_drive=result.writers_per_drive,
        )
        try:
            where = store(entry)
        except OSError as e:
            print(f"fastpersist tune: {e}", file=sys.stderr)
            return 1
        print(result_table(result), flush=True)
        print(f"  cached in {where}", flush=True)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds the ``tune`` subcommand to the ``fastpersist`` command's subparsers."""
    parser = sub.add_parser(
        "tune",
        help="measure each directory's drive and cache the best chunk size and queue depth",
        description=DESCRIPTION + f"\nThis process's cache: {cache_path()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run_cli)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fastpersist.tools.tune``: the same as ``fastpersist tune``."""
    parser = argparse.ArgumentParser(prog="fastpersist tune", description=DESCRIPTION)
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))
