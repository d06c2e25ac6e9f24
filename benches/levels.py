"""The partner level (``levels=[Partner(replicas=k)]``): its per-iteration cost, and restoring after a node loss.

Runs ``--nodes x --ranks-per-node`` spawned gloo ranks on this machine as simulated nodes
(``FASTPERSIST_NODE=node0, node1, ...``), each node with its own root under ``--dir``.

``--part overhead``: a training loop of ``--iters`` iterations per measurement, each one
GIL-free "device work" (a wait of T seconds, as a GPU kernel frees the CPU), a tiny all-reduce
(the gradient sync that keeps the ranks in step), ``ck.wait_staged()``, an in-place update of
every tensor of the state, ``ck.save(i, state)``. Interleaved round by round, it compares the
per-iteration time (the slowest rank's loop wall / iterations) of no checkpoint,
``Checkpointer(every=1)`` (the plain group save, every rank writing into rank 0's
step directory: on one root that every rank passes, as on a shared filesystem) and
``Checkpointer(every=1, levels=[Partner(replicas=1)])`` (each node its own root). One Checkpointer per method lives
through the whole run; its first save (not timed) builds the control group and the pool. T defaults to 1.1 x the slowest
rank's replicas=1 save time, measured in a warm-up. The bytes each rank sends and receives per
save are counted at the partner transfer's ``isend``/``irecv`` and compared with what the
manifests say (each share once per replica).

``--part recovery``: one group saves a step with ``replicas=1``; a fresh group then times, rep
by rep, ``ck.load()`` with every node's root present, ``ck.load()`` with node1's root gone (moved
aside, so node1's ranks start from an empty root, then put back), every rank's plain
``fp.load`` of its own share from its node's root at once, and a plain ``fp.load`` of one share
in one process (the others wait) - "a plain local load".

``--fake-device``: the state's tensors are staged by a fake copy engine (one host thread per
rank, ``fastpersist.gpu.use_copier``) as a GPU state's are, so a step due while any rank's
previous save still writes is skipped on every rank (docs/levels.md, "A step every iteration");
the ``saved`` column counts the steps each measurement saved. With ``--device-seconds`` below
the save time it shows what an every-step Checkpointer costs a loop faster than the disk.

``--mode sharded`` (default): each rank's own ``--mib`` state (FSDP/ZeRO-style);
``--mode replicated``: one ``--mib`` state on every rank, each rank writing a quarter of it.

The two "nodes" share this machine's drive and cores, and the copies go over loopback TCP: the
load average before and after is printed, since other jobs on the machine move the numbers.

Run: ``python benches/levels.py --part overhead --mib 64 --iters 6 --rounds 3`` and
``python benches/levels.py --part recovery --mib 256 --repeats 5``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

METHODS = {"no checkpoint": None, "replicas=0": 0, "replicas=1": 1}
RESTORES = ("restore, both nodes", "restore, node1 lost", "plain load, every rank", "plain load, one process")


def node_of(rank: int, per_node: int) -> str:
    return f"node{rank // per_node}"


def build(mib: int, rank: int, sharded: bool) -> dict[str, Any]:
    """A state of `mib` MiB of fp32 tensors of 16 MiB (seeded: per rank if sharded, else shared)."""
    import torch

    gen = torch.Generator().manual_seed(1000 + (rank if sharded else 0))
    count, last = divmod(mib, 16)
    sizes = [16] * count + ([last] if last else [])
    tensors = {f"t{i}": torch.randn(n << 18, generator=gen) for i, n in enumerate(sizes)}
    return {"model": tensors, "step": 0, "rank": rank if sharded else -1}


class WireCount:
    """Counts the bytes of every ``isend``/``irecv`` of the partner transfer (fastpersist.distributed.transfer)."""

    def __init__(self) -> None:
        import torch.distributed

        import fastpersist.distributed.transfer as transfer

        self.dist = torch.distributed
        self.sent = self.received = 0
        transfer.dist = self  # type: ignore[assignment]

    def isend(self, tensor: Any, **kwargs: Any) -> Any:
        self.sent += tensor.numel() * tensor.element_size()
        return self.dist.isend(tensor, **kwargs)

    def irecv(self, tensor: Any, **kwargs: Any) -> Any:
        self.received += tensor.numel() * tensor.element_size()
        return self.dist.irecv(tensor, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dist, name)


def expected_bytes(step_dir: str, rank: int) -> tuple[int, int, int]:
    """(bytes `rank` sends, bytes it receives, bytes it writes as copies from its own state) per
    save, from the manifest of its node's `step_dir`. Sharded: each share goes once to each of its
    partners. Replicated: each partner writes its copy from its own identical state, so nothing
    crosses the group (the copy is checked against the owner's chunk checksums)."""
    from fastpersist.distributed.placement import Placement
    from fastpersist.format.layout import MANIFEST_NAME, shard_name
    from fastpersist.format.manifest import read_manifest
    from fastpersist.levels.partner_holdings import shares_of

    m = read_manifest(step_dir)
    levels = m.extra["levels"]
    placement, replicas = Placement(levels["rank_nodes"]), int(levels["replicas"])
    sent = received = copied = 0
    for share in shares_of(m) or []:
        partners = placement.partners(share.owner, replicas)
        if share.owner != rank and rank not in partners:
            continue
        nbytes = share.nbytes
        if m.shards:
            shard_dir = os.path.join(step_dir, shard_name(share.index))
            nbytes = sum(f.len_bytes for f in read_manifest(shard_dir).files)
            nbytes += os.path.getsize(os.path.join(shard_dir, MANIFEST_NAME))
        if not m.shards:
            copied += nbytes if rank in partners else 0
            continue
        sent += nbytes * len(partners) if share.owner == rank else 0
        received += nbytes if rank in partners else 0
    return sent, received, copied


def _checkpointer(root: str, replicas: int, sharded: bool, mib: int) -> Any:
    import torch.distributed as dist

    import fastpersist as fp

    config = fp.Config(pool_bytes=max(256, mib + 16) << 20, timeout_s=300)
    return fp.Checkpointer(
        root,
        every=1,
        keep=2,
        config=config,
        group=dist.group.WORLD,
        sharded=sharded,
        levels=[fp.Partner(replicas=replicas)] if replicas else [],
    )


def _loop(o: dict[str, Any], state: dict[str, Any], ck: Any, first: int, t_dev: float) -> dict[str, float]:
    """One measurement, saving steps `first`, `first` + 1, ...: seconds per iteration, seconds
    to drain the last save, and the median save's seconds until committed and of its copies."""
    import torch
    import torch.distributed as dist

    tiny = torch.zeros(16)
    tensors = list(state["model"].values())
    futures = []
    dist.barrier()
    started = time.perf_counter()
    for step in range(first, first + o["iters"]):
        time.sleep(t_dev)  # the device work: releases the GIL, like waiting on a GPU
        dist.all_reduce(tiny)  # the gradient sync: keeps the ranks in step
        if ck is not None:
            ck.wait_staged()
        torch._foreach_add_(tensors, 1e-3)
        state["step"] = step
        if ck is not None:
            futures.append(ck.save(step, state))
    loop = time.perf_counter() - started
    started = time.perf_counter()
    if ck is not None:
        ck.wait()
    results = [f.result() for f in futures if f is not None]
    row = {"per_iter_s": loop / o["iters"], "drain_s": time.perf_counter() - started, "save_s": 0.0, "copy_s": 0.0}
    row["saved"] = len(results)
    if results:
        row["save_s"] = statistics.median(r.seconds for r in results)
        row["copy_s"] = statistics.median(r.phases.get("replicate", 0.0) for r in results)
    return row


def _checkpointers(o: dict[str, Any], rank: int, state: dict[str, Any], root: str) -> tuple[dict[str, Any], float]:
    """One Checkpointer per method, kept for the whole run, each having saved step 0 (the control
    group, the staging pool, the first save's cleaning); and the slowest rank's replicas=1 save
    seconds (the same on every rank). replicas=1: each node its own root; replicas=0 (the plain
    group save, whose step directory every rank writes into): one root for every rank, as that
    save expects of a shared filesystem (with per-node roots its retention, run on each rank's
    own root, finds the new step missing on node1 and never retires a step)."""
    import torch
    import torch.distributed as dist

    cks: dict[str, Any] = {}
    seconds = 0.0
    for name, replicas in METHODS.items():
        if replicas is None:
            continue
        where = node_of(rank, o["per_node"]) if replicas else "shared"
        cks[name] = ck = _checkpointer(os.path.join(root, name, where), replicas, o["sharded"], o["mib"])
        ck.save(0, state)
        result = ck.wait()
        if replicas == 1 and result is not None:
            seconds = result.seconds
    worst = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return cks, float(worst.item())


def overhead_rank(rank: int, world: int, root: str, o: dict[str, Any], out: str) -> None:
    if not o["fake_device"]:
        return _overhead_rank(rank, world, root, o, out)
    import device_staging  # benches/, beside this script

    from fastpersist.gpu.copiers import use_copier

    device_staging.ThreadCopier.engine = device_staging._CopyEngine()
    with use_copier(lambda t: True, device_staging._factory):
        return _overhead_rank(rank, world, root, o, out)


def _overhead_rank(rank: int, world: int, root: str, o: dict[str, Any], out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ["FASTPERSIST_NODE"] = node_of(rank, o["per_node"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/pg-overhead", rank=rank, world_size=world)
    wire = WireCount()
    state = build(o["mib"], rank, o["sharded"])
    cks, save_s = _checkpointers(o, rank, state, root)
    t_dev = o["device_seconds"] or round(1.1 * save_s, 3)
    rows: list[dict[str, Any]] = []
    for rnd in range(o["rounds"]):
        first = 1 + rnd * o["iters"]
        for name in METHODS:
            ck = cks.get(name)
            wire.sent = wire.received = 0
            row = {"round": rnd, "method": name} | _loop(o, state, ck, first, t_dev)
            if name == "replicas=1":
                saves = max(row["saved"], 1)
                row["sent"], row["received"] = wire.sent / saves, wire.received / saves
                last = ck.path(max(ck.steps()))  # the newest saved (with --fake-device a step may be skipped)
                row["expected_sent"], row["expected_received"], row["copied"] = expected_bytes(last, rank)
            rows.append(row)
    for ck in cks.values():
        ck.close()
    with open(out, "w") as f:
        json.dump({"T": t_dev, "save_s": save_s, "rows": rows}, f)
    dist.barrier()
    dist.destroy_process_group()


def save_rank(rank: int, world: int, root: str, o: dict[str, Any], out: str) -> None:
    import torch.distributed as dist

    os.environ["FASTPERSIST_NODE"] = node_of(rank, o["per_node"])
    dist.init_process_group("gloo", init_method=f"file://{root}/pg-save", rank=rank, world_size=world)
    state = build(o["mib"], rank, o["sharded"])
    state["step"] = 1
    with _checkpointer(os.path.join(root, "ck", node_of(rank, o["per_node"])), 1, o["sharded"], o["mib"]) as ck:
        ck.save(1, state)
        result = ck.wait()
    with open(out, "w") as f:
        json.dump({"save_s": result.seconds if result else None}, f)
    dist.destroy_process_group()


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a["rank"] == b["rank"] and all(torch.equal(a["model"][k], v) for k, v in b["model"].items())


def _timed(what: Any) -> tuple[float, Any]:
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    value = what()
    seconds = time.perf_counter() - started
    dist.barrier()
    return seconds, value


def recovery_rank(rank: int, world: int, root: str, o: dict[str, Any], out: str) -> None:
    import torch.distributed as dist

    import fastpersist as fp
    from fastpersist.format.layout import step_dir_name

    per_node = o["per_node"]
    os.environ["FASTPERSIST_NODE"] = node_of(rank, per_node)
    dist.init_process_group("gloo", init_method=f"file://{root}/pg-restore", rank=rank, world_size=world)
    ck_dir = os.path.join(root, "ck")
    mine = os.path.join(ck_dir, node_of(rank, per_node))
    expected = build(o["mib"], rank, o["sharded"])
    step_dir = os.path.join(mine, step_dir_name(1))

    def restore() -> Any:
        return _checkpointer(mine, 1, o["sharded"], o["mib"]).load()

    def plain() -> Any:
        return fp.load(step_dir, shard=rank) if o["sharded"] else fp.load(step_dir)

    def one_process() -> Any:
        return plain() if rank == 0 else None

    _timed(restore)  # warm-up, not timed: builds the control group
    rows, checks = [], []
    for rep in range(o["repeats"]):
        seconds, state = _timed(restore)
        rows.append({"rep": rep, "what": RESTORES[0], "s": seconds})
        checks.append(_same(state, expected))
        del state
        if rank == 0:
            os.rename(os.path.join(ck_dir, "node1"), os.path.join(root, "node1-away"))
        seconds, state = _timed(restore)
        rows.append({"rep": rep, "what": RESTORES[1], "s": seconds})
        checks.append(_same(state, expected))
        del state
        dist.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(ck_dir, "node1"))
            os.rename(os.path.join(root, "node1-away"), os.path.join(ck_dir, "node1"))
        seconds, state = _timed(plain)
        rows.append({"rep": rep, "what": RESTORES[2], "s": seconds})
        del state
        seconds, state = _timed(one_process)
        if rank == 0:
            rows.append({"rep": rep, "what": RESTORES[3], "s": seconds})
            checks.append(_same(state, expected))
        del state
    with open(out, "w") as f:
        json.dump({"rows": rows, "bit_identical": all(checks)}, f)
    dist.destroy_process_group()


def _spawn(target: Any, world: int, root: str, o: dict[str, Any], tag: str) -> list[dict[str, Any]] | None:
    ctx = multiprocessing.get_context("spawn")
    outs = [os.path.join(root, f"out-{tag}-{r}.json") for r in range(world)]
    procs = [ctx.Process(target=target, args=(r, world, root, o, outs[r])) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    if not all(os.path.exists(path) for path in outs):
        print(f"{tag}: ranks failed, exit codes {codes}", file=sys.stderr)
        return None
    if any(codes):  # seen: SIGABRT ("terminate called without an active exception") at interpreter exit
        print(f"{tag}: every rank wrote its result, but exit codes are {codes}", file=sys.stderr)
    results = []
    for path in outs:
        with open(path) as f:
            results.append(json.load(f))
    return results


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def report_overhead(per_rank: list[dict[str, Any]], o: dict[str, Any]) -> dict[str, Any]:
    """Prints the overhead table; returns its rows."""
    walls: dict[str, list[float]] = {name: [] for name in METHODS}
    drains: dict[str, list[float]] = {name: [] for name in METHODS}
    saves: dict[str, list[float]] = {name: [] for name in METHODS}
    copies: dict[str, list[float]] = {name: [] for name in METHODS}
    saved: dict[str, list[int]] = {name: [] for name in METHODS}
    for rnd in range(o["rounds"]):
        for name in METHODS:
            mine = [next(r for r in rank["rows"] if r["round"] == rnd and r["method"] == name) for rank in per_rank]
            walls[name].append(max(r["per_iter_s"] for r in mine))
            drains[name].append(max(r["drain_s"] for r in mine))
            saves[name].append(max(r["save_s"] for r in mine))
            copies[name].append(max(r["copy_s"] for r in mine))
            saved[name].append(min(r["saved"] for r in mine))
    base = statistics.median(walls["no checkpoint"])
    plain = statistics.median(walls["replicas=0"])
    print(
        f"\n{o['mode']} state, {o['mib']} MiB per rank, {len(per_rank)} ranks on {len(per_rank) // o['per_node']} "
        f"simulated nodes, T = {per_rank[0]['T']:.3f} s (replicas=1 save: {per_rank[0]['save_s']:.3f} s), "
        f"{o['iters']} iterations x {o['rounds']} rounds (median of the slowest rank)"
        + (", tensors staged by a fake copy engine" if o["fake_device"] else "")
    )
    print(
        f"{'method':14} {'s/iter':>8} {'min':>7} {'max':>7} {'vs none':>8} {'vs replicas=0':>14} {'drain s':>8} "
        f"{'save s':>7} {'copy s':>7} {'saved':>6}"
    )
    rows = {}
    for name, values in walls.items():
        med = statistics.median(values)
        rows[name] = {"per_iter_s": med, "min": min(values), "max": max(values)}
        rows[name] |= {k: statistics.median(v[name]) for k, v in (("drain_s", drains), ("save_s", saves))}
        rows[name] |= {"copy_s": statistics.median(copies[name]), "saved": statistics.median(saved[name])}
        rows[name] |= {"overhead_vs_none": med / base - 1, "overhead_vs_replicas0": med / plain - 1}
        print(
            f"{name:14} {med:8.3f} {min(values):7.3f} {max(values):7.3f} {med / base - 1:8.1%} "
            f"{med / plain - 1:14.1%} {rows[name]['drain_s']:8.3f} {rows[name]['save_s']:7.3f} "
            f"{rows[name]['copy_s']:7.3f} {rows[name]['saved']:6g}"
        )
    print(
        f"\n{'rank':>4} {'MiB sent/save':>14} {'expected':>9} {'MiB received/save':>18} {'expected':>9} "
        f"{'MiB copied from own state':>26}"
    )
    traffic = []
    for rank, result in enumerate(per_rank):
        last = [r for r in result["rows"] if r["method"] == "replicas=1"][-1]
        traffic.append({k: last[k] for k in ("sent", "expected_sent", "received", "expected_received", "copied")})
        print(
            f"{rank:4} {_mib(last['sent']):>14} {_mib(last['expected_sent']):>9} {_mib(last['received']):>18} "
            f"{_mib(last['expected_received']):>9} {_mib(last['copied']):>26}"
        )
    return {"T": per_rank[0]["T"], "save_s": per_rank[0]["save_s"], "rows": rows, "traffic": traffic}


def report_recovery(per_rank: list[dict[str, Any]], o: dict[str, Any], save_s: float) -> dict[str, Any]:
    """Prints the recovery table; returns its rows."""
    rows = {}
    for what in RESTORES:
        walls = [
            max(r["s"] for rank in per_rank for r in rank["rows"] if r["rep"] == rep and r["what"] == what)
            for rep in range(o["repeats"])
        ]
        rows[what] = {"median_s": statistics.median(walls), "min": min(walls), "max": max(walls)}
    local = rows[RESTORES[3]]["median_s"]
    every = rows[RESTORES[2]]["median_s"]
    identical = all(r["bit_identical"] for r in per_rank)
    print(
        f"\n{o['mode']} state, {o['mib']} MiB per rank, replicas=1 saved in {save_s:.2f} s; {o['repeats']} "
        f"interleaved reps (median wall, slowest rank); restored bit-identical: {identical}"
    )
    print(f"{'load':26} {'median s':>9} {'min':>7} {'max':>7} {'vs one process':>15} {'vs every rank':>14}")
    for what, row in rows.items():
        row["vs_one_process"], row["vs_every_rank"] = row["median_s"] / local, row["median_s"] / every
        print(
            f"{what:26} {row['median_s']:9.3f} {row['min']:7.3f} {row['max']:7.3f} "
            f"{row['vs_one_process']:14.2f}x {row['vs_every_rank']:13.2f}x"
        )
    return {"save_s": save_s, "bit_identical": identical, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["overhead", "recovery", "both"], default="both")
    parser.add_argument("--mode", choices=["sharded", "replicated"], default="sharded")
    parser.add_argument("--mib", type=int, default=64, help="MiB of state per rank (default 64)")
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--iters", type=int, default=6, help="iterations per measurement (default 6)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    parser.add_argument("--device-seconds", type=float, default=0.0, help="T; default 1.1 x the replicas=1 save")
    parser.add_argument("--fake-device", action="store_true", help="stage the state as a GPU state (see above)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved restore reps (median reported)")
    parser.add_argument("--dir", default=None, help="where the roots go (default: a temporary directory here)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.nodes < 2:
        parser.error("--nodes must be at least 2 (replicas=1 needs another node)")
    world = args.nodes * args.ranks_per_node
    o = vars(args) | {"per_node": args.ranks_per_node, "sharded": args.mode == "sharded"}
    root = tempfile.mkdtemp(prefix="fp-levels-", dir=args.dir or os.getcwd())
    report: dict[str, Any] = {"mode": args.mode, "mib": args.mib, "ranks": world, "nodes": args.nodes}
    report["loadavg_before"] = os.getloadavg()  # other jobs on the machine: the numbers are only as quiet as it
    try:
        if args.part in ("overhead", "both"):
            print("overhead ...", file=sys.stderr, flush=True)
            per_rank = _spawn(overhead_rank, world, root, o, "overhead")
            if per_rank is None:
                return 1
            report["overhead"] = report_overhead(per_rank, o)
        if args.part in ("recovery", "both"):
            print("recovery: saving ...", file=sys.stderr, flush=True)
            saved = _spawn(save_rank, world, root, o, "save")
            print("recovery: loading in a fresh group ...", file=sys.stderr, flush=True)
            per_rank = _spawn(recovery_rank, world, root, o, "restore") if saved else None
            if saved is None or per_rank is None:
                return 1
            report["recovery"] = report_recovery(per_rank, o, max(r["save_s"] for r in saved))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["loadavg_after"] = os.getloadavg()
    before, after = (", ".join(f"{x:.1f}" for x in report[k]) for k in ("loadavg_before", "loadavg_after"))
    print(f"\nload average (1, 5, 15 min) before: {before}; after: {after}; {os.cpu_count()} CPUs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
