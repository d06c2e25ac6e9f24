"""The ``fastpersist`` command line: ``demo``, ``bench``, ``tune DIR...``, ``inspect PATH``, ``verify PATH``,
``convert``, ``export``, ``advise``, ``clean``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import fastpersist as fp

from . import advise as advise_cli
from . import bench, tune
from .clitools import STRIPES_HELP, Progress, add_convert_parser, add_export_parser, add_inspect_parser
from .demo import add_demo_parser
from .units import parse_size

__all__ = ["main", "parse_size"]


def cmd_verify(args: argparse.Namespace) -> int:
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
    return bench.run_cli(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastpersist", description="Fast, safe deep-learning checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_demo_parser(sub)

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

    advise_cli.register(sub)

    tune.register(sub)
    add_clean_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fastpersist`` console script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
