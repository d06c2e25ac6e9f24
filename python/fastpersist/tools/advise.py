"""``fastpersist advise``: the command-line face of :func:`fastpersist.advise`."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys

from ..advisor.advice import Advice
from ..advisor.devinfo import device_info
from ..advisor.interval import advise
from ..advisor.model import CostOverrides
from ..advisor.multilevel import Failures, LevelAdvice, LevelCosts, advise_levels
from ..advisor.sources import Measured, from_bench, from_root
from ..advisor.wear import Endurance, Wear
from ..format.layout import HISTORY_NAME

__all__ = ["add_arguments", "register", "run_cli"]

DESCRIPTION = f"""\
Recommends a checkpoint interval from measured save costs and a failure model, shows the
expected overhead at every step, at the recommendation and at your current setting, projects
drive wear against the drives' endurance and says what "durable" means on the target device.

Measured numbers come from --from-root (a Checkpointer's root: its {HISTORY_NAME}) or
--from-bench (the JSON of `fastpersist bench`); any --*-seconds/--bytes option overrides them.

Example:
  fastpersist advise --from-bench bench.json --step-seconds 6 --mtbf-hours 6000 --nodes 16 \\
      --drives 64 --tbw-tb 7008 --until 2027-12-31
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``advise`` options to `parser`."""
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--from-bench", metavar="JSON", help="a `fastpersist bench --json` report")
    src.add_argument("--from-root", metavar="DIR", help=f"a Checkpointer root (reads DIR/{HISTORY_NAME})")
    fail = parser.add_argument_group("failure model (one of)")
    fail.add_argument("--mtbf-hours", type=float, help="MTBF of one node (or of the job with --nodes 1)")
    fail.add_argument("--nodes", type=int, default=1, help="nodes in the job; job MTBF = node MTBF / nodes")
    fail.add_argument("--job-mtbf-hours", type=float, help="the job's MTBF directly")
    costs = parser.add_argument_group("costs (override what the source measured)")
    costs.add_argument("--step-seconds", type=float, help="one training step, without checkpointing")
    costs.add_argument("--stall-seconds", type=float, help="what the loop waits per save")
    costs.add_argument("--write-seconds", type=float, help="from a save's start until it is durable")
    costs.add_argument("--restart-seconds", type=float, help="the whole restart after a failure")
    costs.add_argument(
        "--restart-overhead-seconds", type=float, help="relaunch time added to the measured load (default 0)"
    )
    costs.add_argument("--bytes", type=float, dest="nbytes", help="bytes per checkpoint, all drives together")
    costs.add_argument("--every", type=int, help="your current interval in steps (for comparison)")
    wear = parser.add_argument_group("drive wear")
    wear.add_argument("--drives", type=int, help="drives one checkpoint is spread over")
    wear.add_argument("--tbw-tb", type=float, help="one drive's rated endurance in TB written")
    wear.add_argument("--dwpd", type=float, help="one drive's rated drive writes per day (needs --capacity-tb)")
    wear.add_argument("--capacity-tb", type=float, help="one drive's capacity in TB, for --dwpd")
    wear.add_argument("--warranty-years", type=float, default=5.0, help="for --dwpd (default 5)")
    wear.add_argument("--used-percent", type=float, default=0.0, help="endurance already used (NVMe percent_used)")
    wear.add_argument("--until", type=datetime.date.fromisoformat, help="YYYY-MM-DD the drives must last to")
    levels = parser.add_argument_group("levels (docs/levels.md): also advise every, replicas and remote_every together")
    levels.add_argument(
        "--process-mtbf-hours", type=float, help="MTBF of a process crash (the local level survives it)"
    )
    levels.add_argument(
        "--cluster-mtbf-hours",
        type=float,
        help="MTBF of losing several nodes or the cluster (only the remote survives)",
    )
    levels.add_argument("--replicate-seconds", type=float, default=0.0, help="the partner copies' time per save")
    levels.add_argument("--drain-seconds", type=float, help="one drain of a step to the remote level")
    levels.add_argument(
        "--drain-overhead-seconds", type=float, default=0.0, help="training time one drain costs through contention"
    )
    levels.add_argument("--remote-restart-seconds", type=float, help="a restart from the remote (default: --restart)")
    parser.add_argument("--json", action="store_true", help="print the advice as JSON")


def _endurance(args: argparse.Namespace, dirs: list[str]) -> Endurance | None:
    """One drive's endurance from the options; --dwpd without --capacity-tb takes the size from sysfs."""
    used = args.used_percent / 100.0
    if args.tbw_tb is not None and args.dwpd is not None:
        raise SystemExit("fastpersist advise: give --tbw-tb or --dwpd, not both")
    if args.tbw_tb is not None:
        return Endurance.from_tbw(args.tbw_tb, used_fraction=used)
    if args.dwpd is None:
        return None
    capacity = args.capacity_tb * 1e12 if args.capacity_tb is not None else None
    for d in dirs if capacity is None else []:
        if os.path.exists(d):
            capacity = device_info(d).capacity_bytes
            break
    if capacity is None:
        raise SystemExit("fastpersist advise: --dwpd needs --capacity-tb (one drive's size; sysfs did not say)")
    endurance = Endurance.from_dwpd(
        args.dwpd, capacity_bytes=float(capacity), warranty_years=args.warranty_years, used_fraction=used
    )
    if args.capacity_tb is None:
        endurance = dataclasses.replace(endurance, source=endurance.source.replace("(given)", "(capacity from sysfs)"))
    return endurance


def _failures(args: argparse.Namespace) -> Failures:
    """The failure model of the single-level advice: --job-mtbf-hours is the job's MTBF, --mtbf-hours one node's."""
    if args.job_mtbf_hours is not None:
        return Failures(process_mtbf_s=args.job_mtbf_hours * 3600)
    return Failures(node_mtbf_s=args.mtbf_hours * 3600, nodes=args.nodes)


def _costs(args: argparse.Namespace) -> CostOverrides:
    return CostOverrides(
        step_s=args.step_seconds,
        stall_s=args.stall_seconds,
        write_s=args.write_seconds,
        restart_s=args.restart_seconds,
        restart_overhead_s=args.restart_overhead_seconds,
        nbytes=int(args.nbytes) if args.nbytes is not None else None,
    )


def _wear(args: argparse.Namespace, dirs: list[str]) -> Wear:
    return Wear(drives=args.drives, endurance=_endurance(args, dirs), until=args.until)


def run_cli(args: argparse.Namespace) -> int:
    """Runs ``fastpersist advise`` as parsed by :func:`add_arguments`; returns the exit status."""
    if (args.mtbf_hours is None) == (args.job_mtbf_hours is None):
        raise SystemExit("fastpersist advise: give --mtbf-hours (per node, with --nodes) or --job-mtbf-hours")
    try:
        if args.from_root is not None:
            measured = from_root(args.from_root)
        elif args.from_bench is not None:
            measured = from_bench(args.from_bench)
        else:
            measured = Measured()
        advice = advise(
            measured, failures=_failures(args), costs=_costs(args), wear=_wear(args, measured.dirs), every=args.every
        )
    except (ValueError, OSError) as e:
        print(f"fastpersist advise: {e}", file=sys.stderr)
        return 2
    levels = _levels(args, advice) if _wants_levels(args) else None
    if args.json:
        doc = advice.to_json()
        if levels is not None:
            doc["levels"] = [dataclasses.asdict(p) | {"recommended": p == levels.best} for p in levels.options]
        print(json.dumps(doc, indent=2))
    else:
        print(str(advice))
        if levels is not None:
            print("\nAcross levels (replicas: the partner level; remote_every: steps between drains):")
            print(str(levels))
    return 0


def _wants_levels(args: argparse.Namespace) -> bool:
    return any(x is not None for x in (args.process_mtbf_hours, args.cluster_mtbf_hours, args.drain_seconds))


def _levels(args: argparse.Namespace, advice: Advice) -> LevelAdvice:
    """The multi-level advice from the single-level costs the advice resolved and the level options."""
    c = advice.costs
    costs = LevelCosts(
        step_s=c.step_s,
        stall_s=c.stall_s,
        write_s=c.write_s,
        replicate_s=args.replicate_seconds,
        drain_s=args.drain_seconds or 0.0,
        drain_overhead_s=args.drain_overhead_seconds,
        restart_s=c.restart_s,
        remote_restart_s=args.remote_restart_seconds if args.remote_restart_seconds is not None else c.restart_s,
    )
    hours = 3600.0
    failures = Failures(
        process_mtbf_s=args.process_mtbf_hours * hours if args.process_mtbf_hours else None,
        node_mtbf_s=args.mtbf_hours * hours if args.mtbf_hours else None,
        nodes=args.nodes,
        cluster_mtbf_s=args.cluster_mtbf_hours * hours if args.cluster_mtbf_hours else None,
    )
    return advise_levels(costs, failures, remote=args.drain_seconds is not None)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds the ``advise`` subcommand to the ``fastpersist`` command's subparsers."""
    parser = sub.add_parser(
        "advise",
        help="how often to checkpoint: interval, overhead, drive wear, write cache",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run_cli)
