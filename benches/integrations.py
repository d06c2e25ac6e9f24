"""Each stack's own checkpoint writers against fastpersist's integration, side by side in one run.

The same model, the same steps and the same batches for every writer of a stack; per writer and
rep, two measurements:

* **lost/ckpt s** (the training time lost per checkpoint): the loop's wall time with a checkpoint
  every ``--every`` steps minus the same loop's wall time without checkpoints (run in the same
  rep), divided by the number of checkpoints. The loop's time starts at the first step (the
  Trainer's and Lightning's set-up before ``on_train_begin``/``on_train_start`` is left out)
  and ends once the writer's own saves are done (DeepSpeed: a decoupled engine's last tag
  committed; Lightning and the Trainer: their ``fit``/``train`` return, which waits for saves in
  flight), so what an overlapped writer leaves running is counted. The bench adds no fsync here:
  each writer is timed as it ships (torch.save leaves its bytes in the page cache). This one
  definition is used for every stack.
* **GB/s** (the save's speed to durable): one more checkpoint, saved with the loop idle (and the
  page cache written back first, untimed, so the loop's checkpoints are not flushed meanwhile), from
  the call until every file is durable: the writer's own wait (commit, ``wait_for_checkpoint``,
  ``teardown``), then the bench fsyncs every file of the checkpoint and its directories (a no-op
  for files fastpersist already made durable). GB/s = checkpoint bytes / that time; the bytes
  are what is on disk in the checkpoint's directory (GB = 1e9 bytes).

Each table shows medians over ``--reps`` reps (writers interleaved, their order rotated from rep
to rep, after one no-checkpoint loop not counted, which pays for first-call set-up), and each
row's ratio to its best peer (the best of the other rows: for lost/ckpt below
1 beats every peer, for GB/s above 1 does).

Stacks (``--stacks``):

* ``deepspeed``: 2 ranks (torch.multiprocessing spawn, gloo, DS_ACCELERATOR=cpu), ZeRO stage
  ``--zero-stage``, an MLP of ``--params`` parameters with Adam. Writers: DeepSpeed's default
  ``TorchCheckpointEngine``; ``FastCheckpointEngine`` (``"checkpoint": {"writer": {"type":
  "fast"}}``, DeepSpeed's FastPersist; needs its ``async_io`` op: ``apt-get install libaio-dev``);
  ``DecoupledCheckpointEngine`` (``"writer": {"type": "fast", "decoupled": true}``); fastpersist's
  ``install(engine)`` blocking and ``install(engine, decoupled=True)``. Each engine saves once,
  untimed, before its loop (DecoupledCheckpointEngine's writer process starts and imports
  DeepSpeed meanwhile, which would otherwise count against the first checkpoint). On a machine without CUDA
  two steps of DeepSpeed's fast writer have no CPU build; the bench stands in for them and says
  so: ``Tensor.pin_memory()`` becomes a no-op, and ``UtilsBuilder``'s ``cast_to_byte_tensor``
  becomes a plain-torch byte view of each tensor.
* ``hf``: the stock ``transformers.Trainer`` against ``FastPersistTrainer``, a GPT-2 of about
  ``--params`` parameters built from a config (nothing downloaded), ``save_steps=--every``.
* ``accelerate``: ``save_state`` stock against ``FastPersistStateHooks`` as installed and with
  ``background=True`` (benches/integrations_accelerate.py), the same MLP, every folder kept.
* ``lightning``: the stock ``TorchCheckpointIO``, Lightning's ``AsyncCheckpointIO`` around it,
  and ``FastPersistAsyncCheckpointIO`` (its pool sized to the checkpoint), ``ModelCheckpoint``
  every ``--every`` steps keeping all, the same MLP as DeepSpeed's.

Sizes for about 9 minutes on 2 cores (all three stacks at 75M parameters, 2 reps took 5.7
minutes on a busy 2-core machine; ZeRO-1 in fp32 writes 16 bytes a parameter: the weights, the
fp32 partitions and Adam's two moments, about 1.2 GB at 75M):

    python benches/integrations.py --params 75e6 --steps 6 --every 3 --reps 3 --json integrations.json
    python benches/integrations.py --tiny      # under a minute per stack: a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports DeepSpeed

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import integrations_accelerate
import integrations_workers as workers

STACKS = ("deepspeed", "hf", "lightning", "accelerate")


def machine(root: str) -> list[str]:
    """Lines saying where the numbers come from: cores, the disk under ``root``, versions, load."""
    lines = [f"machine: {os.cpu_count()} cores, {platform.machine()}, Linux {platform.release()}"]
    try:
        source, fstype = subprocess.run(
            ["findmnt", "-no", "SOURCE,FSTYPE", "-T", root], capture_output=True, text=True, check=True
        ).stdout.split()[:2]
        dev = os.path.basename(os.path.realpath(source))
        base = dev.rstrip("0123456789") if not dev.startswith("nvme") else dev.split("p")[0]
        sys_dir = f"/sys/block/{base}"
        model = _read(f"{sys_dir}/device/model") or _read(f"{sys_dir}/device/vendor") or "?"
        rotational = {"0": "non-rotational", "1": "rotational"}.get(_read(f"{sys_dir}/queue/rotational"), "?")
        free_gb = shutil.disk_usage(root).free / 1e9
        lines.append(
            f"disk of --dir: {root} on {source} ({fstype}, {rotational}, model {model}), {free_gb:.0f} GB free"
        )
    except (OSError, subprocess.CalledProcessError, ValueError) as e:
        lines.append(f"disk of --dir: {root} (findmnt failed: {e})")
    versions = [f"torch {torch.__version__}"]
    for name in ("deepspeed", "transformers", "lightning", "fastpersist"):
        try:
            versions.append(f"{name} {__import__(name).__version__}")
        except Exception as e:
            versions.append(f"{name} missing ({type(e).__name__})")
    lines.append("versions: " + ", ".join(versions))
    lines.append("load average (1, 5, 15 min): " + ", ".join(f"{x:.1f}" for x in os.getloadavg()))
    return lines


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def report(stack: str, title: str, runs: list[dict[str, Any]], writers: list[str]) -> dict[str, Any]:
    """Prints one stack's table from its runs ({rep, writer, loop_s, ckpts, durable_s, bytes}); returns its rows."""
    base = {r["rep"]: r["loop_s"] for r in runs if r["writer"] == workers.NONE}
    rows: dict[str, dict[str, Any]] = {}
    for name in writers:
        mine = [r for r in runs if r["writer"] == name]
        if not mine:
            continue
        if "skipped" in mine[0]:
            rows[name] = {"skipped": mine[0]["skipped"]}
            continue
        lost = [(r["loop_s"] - base[r["rep"]]) / r["ckpts"] for r in mine if r["rep"] in base]
        durable = statistics.median(r["durable_s"] for r in mine)
        nbytes = statistics.median(r["bytes"] for r in mine)
        rows[name] = {
            "lost_per_ckpt_s": statistics.median(lost),
            "lost_min_s": min(lost),
            "lost_max_s": max(lost),
            "loop_s": statistics.median(r["loop_s"] for r in mine),
            "durable_s": durable,
            "gb_per_s": nbytes / 1e9 / durable,
            "bytes": nbytes,
            "ckpts": mine[0]["ckpts"],
        }
    done = {k: v for k, v in rows.items() if "skipped" not in v}
    for name, row in done.items():
        peers = [v for k, v in done.items() if k != name]
        best_lost = min((p["lost_per_ckpt_s"] for p in peers), default=float("nan"))
        best_gbs = max((p["gb_per_s"] for p in peers), default=float("nan"))
        lost = row["lost_per_ckpt_s"]
        row["lost_vs_best_peer"] = lost / best_lost if best_lost > 0 and lost > 0 else float("nan")
        row["gbs_vs_best_peer"] = row["gb_per_s"] / best_gbs if best_gbs > 0 else float("nan")
    reps = len(base)
    print(f"\n{stack}: {title}; median of {reps} rep(s); no-checkpoint loop {statistics.median(base.values()):.3f} s")
    print(
        f"{'writer':34} {'lost/ckpt s':>11} {'min':>7} {'max':>7} {'vs best':>8} {'durable s':>9} "
        f"{'GB/s':>7} {'vs best':>8} {'GB/ckpt':>8} {'ckpts':>5}"
    )
    for name, row in rows.items():
        if "skipped" in row:
            print(f"{name:34} skipped: {row['skipped']}")
            continue
        print(
            f"{name:34} {row['lost_per_ckpt_s']:11.3f} {row['lost_min_s']:7.3f} {row['lost_max_s']:7.3f} "
            f"{_ratio(row['lost_vs_best_peer'])} {row['durable_s']:9.3f} {row['gb_per_s']:7.3f} "
            f"{_ratio(row['gbs_vs_best_peer'])} {row['bytes'] / 1e9:8.3f} {row['ckpts']:5d}"
        )
    if any(r.get("lost_per_ckpt_s", 1) <= 0 for r in done.values()):
        print("(a lost/ckpt at or below 0 is within the loop's noise: no ratio is taken against it)")
    return rows


def _ratio(x: float) -> str:
    return f"{'n/a':>8}" if math.isnan(x) else f"{x:7.2f}x"


def run_in_process(
    stack: str, o: dict[str, Any], root: str, make: Callable[[dict[str, Any], str], workers.Stack]
) -> tuple[list[dict[str, Any]], workers.Stack]:
    """Runs a one-process stack's writers (and the no-checkpoint loop), interleaved over reps."""
    bench = make(o, root)
    print(f"{stack}: warm-up (a no-checkpoint loop, not counted) ...", file=sys.stderr, flush=True)
    bench.run(workers.NONE, -1)  # the first loop in a process pays for imports and first-call set-up
    runs = []
    order = [workers.NONE, *bench.writers]
    for rep in range(o["reps"]):
        shift = rep % len(order)
        for name in order[shift:] + order[:shift]:
            print(f"{stack}: rep {rep} {name} ...", file=sys.stderr, flush=True)
            runs.append({"rep": rep, "writer": name, **bench.run(name, rep)})
    return runs, bench


def run_deepspeed(o: dict[str, Any], root: str) -> list[dict[str, Any]] | None:
    """Spawns the 2 DeepSpeed ranks; returns rank 0's runs (each already the slowest rank's)."""
    outs = [os.path.join(root, f"ds-out-{r}.json") for r in range(workers.DS_WORLD)]
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=workers.deepspeed_rank, args=(r, root, o, outs[r])) for r in range(workers.DS_WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    if not os.path.exists(outs[0]):
        print(f"deepspeed: ranks failed, exit codes {codes}", file=sys.stderr)
        return None
    if any(codes):
        print(f"deepspeed: ranks failed (exit codes {codes}); the rows done before are shown", file=sys.stderr)
    with open(outs[0]) as f:
        return json.load(f)  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stacks", default=",".join(STACKS), help="comma-separated: deepspeed,hf,lightning,accelerate")
    parser.add_argument("--params", type=float, default=100e6, help="model parameters (default 100e6)")
    parser.add_argument("--steps", type=int, default=12, help="training steps per loop (default 12)")
    parser.add_argument("--every", type=int, default=4, help="a checkpoint every N steps (default 4)")
    parser.add_argument("--reps", type=int, default=2, help="interleaved reps, medians reported (default 2)")
    parser.add_argument("--zero-stage", type=int, default=1, help="DeepSpeed ZeRO stage (default 1)")
    parser.add_argument(
        "--ds-data-parallel", choices=["replica", "socket", "machine"], default="replica",
        help="the fast writers' writer.data_parallel unit (default replica: every data-parallel rank writes its byte "
        "range of each replicated file, as the paper does; DeepSpeed 0.19.8's default, none, fails without a model-"
        "parallel unit, and 'machine' on one machine has both ranks write the same model file (its fsync fails: EIO))",
    )  # fmt: skip
    parser.add_argument(
        "--ds-timeout-s", type=float, default=600, help="DeepSpeed's collectives' timeout (default 600)"
    )
    parser.add_argument(
        "--ds-precision", choices=["fp32", "bf16"], default="fp32",
        help="DeepSpeed's training precision (default fp32; bf16 adds ZeRO's fp32 master partitions to the checkpoint)",
    )  # fmt: skip
    parser.add_argument(
        "--dir", default=None, help="where checkpoints go (default: a temporary directory under /var/tmp)"
    )
    parser.add_argument("--tiny", action="store_true", help="a smoke run: 1M parameters, 4 steps, every 2, 1 rep")
    parser.add_argument("--json", default=None, help="write every run and row here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.params, args.steps, args.every, args.reps = 1e6, 4, 2, 1
    stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    if unknown := [s for s in stacks if s not in STACKS]:
        parser.error(f"unknown stacks {unknown}; choose from {','.join(STACKS)}")
    if args.every > args.steps:
        parser.error("--every must be at most --steps (no checkpoint would be taken)")
    o = vars(args) | {"params": int(args.params)}
    root = tempfile.mkdtemp(prefix="fp-integrations-", dir=args.dir or "/var/tmp")
    for line in machine(root):
        print(line)
    print(
        f"sizes: {o['params'] / 1e6:.1f}M parameters, {o['steps']} steps, a checkpoint every {o['every']}, "
        f"{o['reps']} rep(s)"
    )
    result: dict[str, Any] = {"options": o, "machine": machine(root), "stacks": {}}
    failed = False
    try:
        for stack in stacks:
            if stack == "deepspeed":
                runs = run_deepspeed(o, root)
                if runs is None:
                    failed = True
                    continue
                title = (
                    f"2 ranks (gloo, CPU), ZeRO stage {o['zero_stage']}, {o['ds_precision']}, MLP, Adam; "
                    f"DeepSpeed's fast writer with data_parallel={o['ds_data_parallel']!r}"
                )
                names = list(workers.DS_WRITERS)
                for note in sorted({n for r in runs for n in r.get("notes", [])}):
                    print(f"deepspeed: {note}")
            else:
                make: Callable[[dict[str, Any], str], workers.Stack] = {
                    "hf": workers.HFStack,
                    "lightning": workers.LightningStack,
                    "accelerate": integrations_accelerate.AccelerateStack,
                }[stack]
                runs, bench = run_in_process(stack, o, root, make)
                title, names = bench.title, bench.writers
            result["stacks"][stack] = {"runs": runs, "rows": report(stack, title, runs, names)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\nload average (1, 5, 15 min) after: " + ", ".join(f"{x:.1f}" for x in os.getloadavg()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
