"""The ``inspect``, ``convert`` and ``export`` commands of the ``fastpersist`` CLI, and its progress bars.

Each command is a function taking the parsed arguments plus an ``add_*_parser`` function that
registers it on the CLI's subparsers (``fastpersist.tools.cli.build_parser`` calls them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from types import TracebackType
from typing import Any

import fastpersist as fp

from ..errors import FastPersistError
from ..format.layout import atomic_file
from ..hfapi import export_hf
from ..interop.convert import convert
from ..interop.hfshards import DEFAULT_MAX_SHARD_BYTES
from .rootinfo import describe_root, is_checkpointer_root, print_root
from .units import parse_size

__all__ = [
    "STRIPES_HELP",
    "Progress",
    "add_convert_parser",
    "add_export_parser",
    "add_inspect_parser",
    "cmd_convert",
    "cmd_export",
    "cmd_inspect",
    "group_tensors",
]


class Progress:
    """A tqdm progress bar when stdout is a terminal and tqdm is installed; silent otherwise.

    Example:
        >>> with Progress(total=3, desc="steps") as bar:
        ...     bar.update(1)
    """

    def __init__(self, total: float | None, desc: str, unit: str = "it", unit_scale: bool = False) -> None:
        self._bar: Any = None
        if sys.stdout.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, leave=False)

    def update(self, n: float = 1) -> None:
        """Advances the bar by `n`."""
        if self._bar is not None:
            self._bar.update(n)

    def describe(self, text: str) -> None:
        """Replaces the bar's description."""
        if self._bar is not None:
            self._bar.set_description_str(text)

    def close(self) -> None:
        """Removes the bar from the terminal."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


_TOP_KEY = re.compile(r"^[^.\[]*(?:\.([^.\[]+)|\[((?:'[^']*'|\"[^\"]*\"|[^\]])*)\])")


def top_key(key_path: str) -> str:
    """The first key below the root of a key path: ``state.model['a.b']`` -> ``model``."""
    match = _TOP_KEY.match(key_path)
    if not match:
        return "(root)"
    name = match.group(1) if match.group(1) is not None else match.group(2)
    return name[1:-1] if len(name) >= 2 and name[0] == name[-1] and name[0] in "'\"" else name


def group_tensors(tensor_list: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tensors grouped by top-level key: ``[{"key", "tensors", "bytes"}]`` in first-seen order."""
    groups: dict[str, dict[str, Any]] = {}
    for t in tensor_list:
        g = groups.setdefault(top_key(t["key"]), {"key": top_key(t["key"]), "tensors": 0, "bytes": 0})
        g["tensors"] += 1
        g["bytes"] += t["bytes"]
    return list(groups.values())


def _human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024  # type: ignore[assignment]
    raise AssertionError


def cmd_inspect(args: argparse.Namespace) -> int:
    """``fastpersist inspect PATH [--all] [--json] [--limit N]``; PATH a checkpoint, or a
    Checkpointer root (its steps and levels: :mod:`fastpersist.tools.rootinfo`)."""

    if is_checkpointer_root(args.path):
        info = describe_root(args.path, node=args.node)
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            print_root(info)
        return 0
    try:
        info = fp.inspect(args.path, config=fp.Config(stripes=args.stripes) if args.stripes else None)
    except (fp.CorruptCheckpointError, FileNotFoundError) as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    info["groups"] = group_tensors(info["tensor_list"])
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['path']}: fastpersist format {info['format_version']}, created {info['created']}")
    print(
        f"  {info['tensors']} tensors, {info['bytes']:,} bytes of tensor data ({_human(info['bytes'])}), "
        f"checksum {info['checksum']}, chunk {info['chunk_bytes']:,} bytes"
    )
    for f in info["files"]:
        print(f"  file {f['path']}: {f['bytes']:,} bytes, {f['chunks']} chunk(s)")
    if "incremental" in info:
        inc = info["incremental"]
        refers = ", ".join(f"{n:,} bytes written by save {who}" for who, n in inc["refers_to"].items()) or "nothing"
        print(f"  incremental (depth {inc['depth']}): wrote {inc['wrote_bytes']:,} bytes of its stream; links {refers}")
    width = max([len(g["key"]) for g in info["groups"]] + [9])
    print(f"\n  {'top-level':{width}} {'tensors':>8} {'bytes':>16}")
    for g in info["groups"]:
        print(f"  {g['key']:{width}} {g['tensors']:8} {g['bytes']:16,} ({_human(g['bytes'])})")
    shown = info["tensor_list"] if args.all else info["tensor_list"][: args.limit]
    if shown:
        print()
    for t in shown:
        print(f"  {t['key']}: {t['dtype']}{t['shape']} on {t['device']}, {t['bytes']:,} bytes")
    hidden = len(info["tensor_list"]) - len(shown)
    if hidden and (args.limit or args.all):
        print(f"  ... and {hidden} more (use --all)")
    elif hidden:
        print(f"\n  (--all lists all {len(info['tensor_list'])} tensors)")
    return 0


#: Help of ``--stripes`` for the commands that read a checkpoint.
STRIPES_HELP = (
    "the roots that now hold the checkpoint's stripe directories, in the order the save had them "
    "(Config.stripes), when they were copied or moved to other drives"
)


def add_inspect_parser(sub: Any) -> None:
    """Registers ``inspect`` on the CLI's subparsers."""
    insp = sub.add_parser(
        "inspect",
        help="describe a checkpoint from its manifest (tensors grouped by top-level key), or a Checkpointer root",
        description="Describes a checkpoint from its manifest without reading tensor data: format, files, "
        "tensors and bytes per top-level key; every tensor with --all or --json. Given a Checkpointer root "
        "(step directories and/or its index), lists its steps and what it holds on each level: each "
        "step's id, whether it was saved with replicas, and which shares are present (this node's own, or "
        "copies of its partners'), with their bytes.",
    )
    insp.add_argument("path", help="checkpoint directory, or a Checkpointer root")
    insp.add_argument(
        "--node",
        help="the node a Checkpointer root belongs to (default: $FASTPERSIST_NODE or the host name when a "
        "step's placement names it, else inferred from the shares present)",
    )
    insp.add_argument("--json", action="store_true", help="print everything (every tensor, the groups) as JSON")
    insp.add_argument("--all", action="store_true", help="list every tensor")
    insp.add_argument("--limit", type=int, default=0, help="list the first N tensors (default 0)")
    insp.add_argument("--stripes", nargs="+", metavar="DIR", help=STRIPES_HELP)
    insp.set_defaults(func=cmd_inspect)


def cmd_convert(args: argparse.Namespace) -> int:
    """``fastpersist convert SRC --to torch|safetensors|fastpersist OUT``."""

    started = time.perf_counter()
    with Progress(total=2, desc="convert") as bar:

        def step(text: str) -> None:
            bar.describe(text)
            if text.startswith("writing"):
                bar.update(1)

        try:
            done = convert(args.src, args.to, args.out, progress=step, unsafe_pickle=args.unsafe_pickle)
        except (FastPersistError, FileNotFoundError, IsADirectoryError) as e:
            print(f"FAILED: {e}", file=sys.stderr)
            return 1
        bar.update(1)
    seconds = time.perf_counter() - started
    print(
        f"converted {done['src_format']} {args.src} -> {args.to} {args.out}: "
        f"{done['tensors']} tensors in {seconds:.2f} s"
    )
    return 0


def add_convert_parser(sub: Any) -> None:
    """Registers ``convert`` on the CLI's subparsers."""
    conv = sub.add_parser(
        "convert",
        help="convert between a checkpoint, a torch.save file and a safetensors file",
        description="Converts SRC (a fastpersist checkpoint directory, a torch.save .pt file or a .safetensors "
        "file; detected from its content) to OUT in the format given by --to. Tensors come back bit-identical; "
        "the non-tensor structure is kept (in safetensors, in __metadata__). torch files are read with "
        "weights_only=True: nothing is unpickled, unless --unsafe-pickle is given.",
    )
    conv.add_argument("src", help="checkpoint directory, .pt file or .safetensors file")
    conv.add_argument("--to", required=True, choices=["torch", "safetensors", "fastpersist"], help="output format")
    conv.add_argument("out", help="output path (a directory for fastpersist, a file otherwise)")
    conv.add_argument(
        "--unsafe-pickle",
        action="store_true",
        help="read a .pt file that needs torch.load(weights_only=False); this runs any code the file "
        "names, so only for files you trust",
    )
    conv.set_defaults(func=cmd_convert)


def cmd_export(args: argparse.Namespace) -> int:
    """``fastpersist export SRC --to hf OUTDIR [--key K] [--prefix P] [--max-shard-size 5GB] [--config C]``."""
    import shutil

    try:
        done = export_hf(args.src, args.outdir, prefix=args.prefix, key=args.key, max_shard_bytes=args.max_shard_size)
    except (FastPersistError, FileNotFoundError, NotADirectoryError, ValueError) as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    if args.config:
        config = os.path.join(args.config, "config.json") if os.path.isdir(args.config) else args.config
        with atomic_file(os.path.join(done.outdir, "config.json"), durable=True) as tmp:
            shutil.copyfile(config, tmp)
    tied = f", {len(done.tied)} tied name(s) written once" if done.tied else ""
    print(
        f"exported {done.source} -> {done.outdir}: {done.tensors} tensors, {_human(done.total_bytes)} in "
        f"{len(done.files)} file(s){tied}, {done.seconds:.2f} s"
    )
    return 0


def add_export_parser(sub: Any) -> None:
    """Registers ``export`` on the CLI's subparsers."""

    exp = sub.add_parser(
        "export",
        help="write a checkpoint's model as Hugging Face safetensors shards (from_pretrained loads them)",
        description="Writes the tensors of SRC (a replicated, sharded or DCP-written checkpoint, or a Checkpointer "
        "root: its latest step) to OUTDIR as model.safetensors, or model-0000K-of-0000N.safetensors shards and "
        "model.safetensors.index.json, as save_pretrained does. Names are the state's key paths joined by '.'; "
        "tied weights are written once; values that are not tensors are skipped. Reads one window at a time.",
    )
    exp.add_argument("src", help="checkpoint directory or Checkpointer root")
    exp.add_argument("--to", required=True, choices=["hf"], help="output format (hf: Hugging Face safetensors)")
    exp.add_argument("outdir", help="output directory (created if missing)")
    exp.add_argument("--key", help="the sub-tree to export, by its dotted name (e.g. model); default: everything")
    exp.add_argument("--prefix", default="", help="stripped from the names that start with it (e.g. module.)")
    exp.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=DEFAULT_MAX_SHARD_BYTES,
        help="tensor bytes per shard file (default 5GB, as save_pretrained)",
    )
    exp.add_argument("--config", help="a config.json (or a directory holding one) to copy into OUTDIR")
    exp.set_defaults(func=cmd_export)
