"""``fastpersist bench``: fastpersist against the drive's limit and its peers, on one training state.

One run builds a synthetic GPT-style mixed-precision Adam state (bf16 weights, fp32 master
copy, fp32 ``exp_avg`` and ``exp_avg_sq``: ~14 bytes per parameter, hundreds of tensors plus a
few small ones and plain values) and times, repetition after repetition with the methods
interleaved (A B C A B C ...) so that drift of a shared disk hits every method alike:

* saves (each one durable: fsync included): the drive's limit (a write-only O_DIRECT stream of
  the same bytes through the engine's raw path, and ``fio`` when installed), ``fastpersist.save``
  on each backend, ``fastpersist.save_async`` (time to return, to staged, to durable),
  ``fastpersist.torch_save`` (a file ``torch.load`` reads), ``fastpersist.export_hf`` (Hugging
  Face safetensors shards, read back from a checkpoint of the state),
  ``torch.save``, ``safetensors.torch.save_file`` and ``torch.distributed.checkpoint`` with a
  ``FileSystemWriter`` of 1 and 4 threads;
* cold loads (page cache dropped before each, when permitted): the O_DIRECT read limit,
  ``fastpersist.load``, ``torch.load`` and ``safetensors.torch.load_file``.

It also measures the peak RSS that a bounded-pool save adds (in a fresh subprocess) and the
time to flatten and plan a 10,000-tensor state, prints a table with ratios to the drive limit
and to each peer, and writes everything as JSON (and, with ``--plot``, a PNG chart).

Its modules: state (the synthetic states), harness (``Bench``: the methods and the interleaved
loop that times them), measure (``Method`` and ``Row``), saves and loads (the timed methods),
fio (the reference write limit), fixed (a small save's fixed costs), nullsink (a save into the
null sink against memcpy), probes (flatten+plan and peak RSS), settings (the chunk size and
depths, and where they came from), system (what the run asks of the OS), report (the statistics,
the table and the chart).

Example:
    $ fastpersist bench --size 1GiB --reps 3 --dir /mnt/nvme0 --plot bench.png
    $ python -m fastpersist.tools.bench --size 64MiB --reps 1 --json /tmp/bench.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from ...config import Config
from ..units import auto_or, parse_size
from .fixed import replacing_save_phases
from .harness import Bench
from .loads import add_load_methods
from .nullsink import null_sink_vs_memcpy
from .probes import flatten_plan_seconds, rss_probe, run_rss_probe_subprocess
from .report import plot, summarise, table
from .saves import add_save_methods
from .settings import settle_settings
from .state import GptShape, build_small_state, build_state, gpt_shape, state_summary
from .system import machine_info, progress, remove_path, run_dirs_for, status_bytes

__all__ = [
    "GptShape",
    "add_arguments",
    "build_small_state",
    "build_state",
    "flatten_plan_seconds",
    "gpt_shape",
    "main",
    "rss_probe",
    "run",
    "run_cli",
    "state_summary",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``bench`` options to `parser`.

    Shared by ``fastpersist bench`` and ``python -m fastpersist.tools.bench``.
    """

    defaults = Config()
    parser.add_argument("--size", type=parse_size, default=parse_size("1GiB"), help="state size (default 1GiB)")
    parser.add_argument(
        "--dir",
        action="append",
        dest="dirs",
        metavar="DIR",
        help="where to write (repeat for several drives: fastpersist stripes over them; "
        "peers write to the first); default: the current directory",
    )
    parser.add_argument("--reps", type=int, default=3, help="repetitions per method (default 3, at least 1)")
    parser.add_argument("--json", default="bench.json", help="write the results here (default bench.json)")
    parser.add_argument("--plot", help="draw a PNG chart here (needs matplotlib: pip install 'fastpersist[plot]')")
    parser.add_argument(
        "--chunk-bytes",
        type=auto_or(parse_size),
        default=defaults.chunk_bytes,
        help='fastpersist Config (default "auto": tuned for the first --dir by fastpersist tune, else 8MiB)',
    )
    parser.add_argument(
        "--queue-depth",
        type=auto_or(int),
        default=defaults.queue_depth,
        help='fastpersist Config (default "auto": tuned, for saves and loads apart, else 8)',
    )
    parser.add_argument("--pool-bytes", type=parse_size, default=defaults.pool_bytes, help="fastpersist Config")
    parser.add_argument("--no-fio", action="store_true", help="skip fio even where it is installed")
    parser.add_argument("--rss-probe", action="store_true", help=argparse.SUPPRESS)


def _checked_dirs(args: argparse.Namespace) -> list[str]:
    """The run directories, once the arguments and the free space allow the run."""
    if args.reps < 1:
        raise SystemExit("fastpersist bench: --reps must be at least 1")
    dirs = [os.path.abspath(d) for d in (args.dirs or [os.getcwd()])]
    if len(set(dirs)) != len(dirs):
        raise SystemExit("fastpersist bench: each --dir must be different")
    free = shutil.disk_usage(dirs[0] if os.path.exists(dirs[0]) else os.path.dirname(dirs[0])).free
    if free < 5.5 * args.size:
        raise SystemExit(
            f"fastpersist bench: {dirs[0]} has {free / 2**30:.1f} GiB free; this run needs about "
            f"{5.5 * args.size / 2**30:.1f} GiB (the outputs of 4 methods are kept for the loads)"
        )
    return dirs


def _report(
    args: argparse.Namespace,
    dirs: list[str],
    bench: Bench,
    summary: dict[str, Any],
    extras: dict[str, Any],
    notes: list[str],
) -> dict[str, Any]:
    """The JSON report of a run."""
    shape = bench.shape
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
        "config": {
            "size_requested_bytes": args.size,
            "reps": args.reps,
            "dirs": dirs,
            "chunk_bytes": args.chunk_bytes,
            "queue_depth": args.queue_depth,
            "read_queue_depth": args.read_queue_depth,
            "settings_source": {"write": args.write_source, "read": args.read_source},
            "pool_bytes": args.pool_bytes,
            "backends": bench.backends,
            "direct_io": bench.direct,
        },
        "machine": machine_info(dirs),
        "state": {
            "bytes": bench.nbytes,
            "tensors": bench.tensor_count,
            "params": shape.params,
            "bytes_per_param": bench.nbytes / shape.params,
            "hidden": shape.hidden,
            "layers": shape.layers,
            "vocab": shape.vocab,
            "context": shape.context,
        },
        "save_phases": _median_phases(bench.save_phases),
        "load_phases": _median_phases(bench.load_phases),
        "cold_reads": bench.cold,
        "loaded_tensors": bench.loaded_tensors,
        "fio_raw": getattr(bench, "fio_raw", []),
        **summary,
        **extras,
        # VmHWM is reset before each method, so the run's peak is the largest per-method peak.
        "peak_rss_bytes": max([r.peak_rss_bytes for r in bench.rows.values()] + [status_bytes("VmHWM")]),
        "notes": notes,
    }


def _median_phases(by_row: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per row, the median of each phase over its repetitions."""
    return {
        key: {phase: statistics.median(run[phase] for run in runs) for phase in runs[0]}
        for key, runs in by_row.items()
        if runs
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the whole benchmark as configured by `args` (see :func:`add_arguments`); returns the report.

    Prints the table to stdout, progress to stderr, writes ``args.json`` and (if set) ``args.plot``.
    """
    dirs = _checked_dirs(args)
    progress(settle_settings(args, dirs[0]))
    notes: list[str] = []
    extras: dict[str, Any] = {}
    with run_dirs_for(dirs) as run_dirs:
        progress("peak-RSS probe: a bounded-pool fastpersist.save in a fresh process ...")
        extras["rss"] = run_rss_probe_subprocess(args, run_dirs)
        progress("timing flatten+plan of a 10,000-tensor state ...")
        extras["flatten_plan"] = flatten_plan_seconds(10_000, chunk_bytes=args.chunk_bytes)
        bench = Bench(args, run_dirs, notes)
        progress("fixed costs: 5 saves replacing a 256 MiB checkpoint ...")
        extras["replacing"] = replacing_save_phases(run_dirs[0], min(256 << 20, args.size), **bench.config_kwargs)
        remove_path(extras["replacing"].pop("path"))
        progress("the pipeline alone: saves into the null sink against memcpy ...")
        extras["null_sink"] = null_sink_vs_memcpy(run_dirs[0], bench.state, args.reps, **bench.config_kwargs)
        add_save_methods(bench)
        add_load_methods(bench)
        try:
            progress(
                f"state: {bench.nbytes / 2**30:.3f} GiB, {bench.tensor_count} tensors; "
                f"{len(bench.save_methods)} save and {len(bench.load_methods)} load methods x {args.reps} reps"
            )
            bench.run_saves()
            bench.run_loads()
        finally:
            bench.cleanup()
        for key, count in bench.loaded_tensors.items():
            if count < bench.tensor_count - 1:  # safetensors holds the tied weight as one more tensor
                notes.append(f"{key} returned {count} tensors, expected {bench.tensor_count}")
        summary = summarise(bench, extras)
        report = _report(args, dirs, bench, summary, extras, notes)
        del bench
        gc.collect()
    print(table(report), flush=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"\nresults written to {os.path.abspath(args.json)}", flush=True)
    if args.plot:
        try:
            plot(report, args.plot)
        except ImportError:
            print("note: --plot needs matplotlib (pip install 'fastpersist[plot]'); no chart drawn", flush=True)
        else:
            print(f"chart written to {os.path.abspath(args.plot)}", flush=True)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fastpersist.tools.bench``: the same as ``fastpersist bench`` (plus the internal ``--rss-probe``)."""
    parser = argparse.ArgumentParser(
        prog="python -m fastpersist.tools.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


def run_cli(args: argparse.Namespace) -> int:
    """Runs what the parsed command line asks for: the benchmark, or the internal RSS probe."""
    if args.rss_probe:
        dirs = args.dirs or [os.getcwd()]
        settle_settings(args, dirs[0])
        print(json.dumps(rss_probe(args.size, dirs, args.chunk_bytes, args.pool_bytes, args.queue_depth)), flush=True)
        return 0
    run(args)
    return 0
