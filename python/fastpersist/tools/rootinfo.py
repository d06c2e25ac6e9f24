"""``fastpersist inspect ROOT`` for a Checkpointer root: its steps, and what each holds on each level.

A Checkpointer root is a directory holding step directories and/or an index, not itself a
checkpoint. For each step: its checkpoint id, whether it was saved with ``replicas=k`` (the
partner level), and for such a step which shares are present in this root, as regular files of
their recorded sizes (:mod:`fastpersist.levels.partner_holdings`; no data is read, ``verify`` checks
the bytes): this node's own ranks' shares (level "local") and the copies it keeps of its
partners' shares (level "partner").

The same manifest is on every node, so which node a root belongs to is not written in it: it is
``--node``, else ``$FASTPERSIST_NODE`` or the host name when the step's placement names it, else
the one node whose placed shares are exactly those present (None when several fit, as with 2
nodes and ``replicas=1``, where each node holds every share: then own shares and copies are not
told apart, and their bytes are counted under level "unknown").

Example:
    >>> describe_root("runs/exp1")["steps"][0]["replicas"]   # doctest: +SKIP
    1
"""

from __future__ import annotations

import os
from typing import Any

from ..distributed.placement import Placement, node_name
from ..errors import FastPersistError
from ..format.layout import MANIFEST_NAME, is_checkpointer_root, parse_step_dir, shard_name
from ..format.manifest import Manifest, read_manifest
from ..levels.partner_holdings import Share, share_problem, shares_of
from ..levels.run_identity import read_local_index

__all__ = ["describe_root", "is_checkpointer_root", "print_root"]


def _share_bytes(step_dir: str, m: Manifest, share: Share) -> int:
    """Bytes of `share`'s files: data files (and, sharded, its shard's manifest)."""
    if not m.shards:
        return share.nbytes
    shard_dir = os.path.join(step_dir, shard_name(share.index))
    try:
        files = read_manifest(shard_dir).files
        return sum(f.len_bytes for f in files) + os.path.getsize(os.path.join(shard_dir, MANIFEST_NAME))
    except (FastPersistError, OSError):
        return 0


def _root_node(m: Manifest, present: set[int], node: str | None) -> tuple[str | None, str]:
    """(the node this root belongs to, how it was found) for a partner-level step."""
    levels = m.extra.get("levels", {})
    placement = Placement(levels.get("rank_nodes", []))
    if node is not None:
        return node, "--node"
    here = node_name()
    if here in placement.nodes:
        return here, "FASTPERSIST_NODE or host name"
    replicas = int(levels.get("replicas", 0))
    shares = shares_of(m) or []
    fits = [
        name
        for i, name in enumerate(placement.nodes)
        if {s.index for s in shares if i in placement.holder_nodes(s.owner, replicas)} == present
    ]
    if len(fits) == 1:
        return fits[0], "the only node whose placed shares are the ones present"
    return None, "several nodes would hold these shares: pass --node"


def _partner_shares(step_dir: str, m: Manifest, node: str | None) -> dict[str, Any]:
    levels = m.extra["levels"]
    rank_nodes = list(levels.get("rank_nodes", []))
    shares = shares_of(m) or []
    problems = {s.index: share_problem(step_dir, m, s) for s in shares}
    present = {i for i, p in problems.items() if p is None}
    node, found = _root_node(m, present, node)
    rows = []
    for s in shares:
        owner_node = rank_nodes[s.owner] if s.owner < len(rank_nodes) else None
        kind = "?" if node is None else ("own" if owner_node == node else "copy")
        row = {"share": s.index, "owner_rank": s.owner, "owner_node": owner_node, "kind": kind}
        row |= {"present": problems[s.index] is None, "problem": problems[s.index]}
        row["bytes"] = _share_bytes(step_dir, m, s) if row["present"] else 0
        rows.append(row)
    nodes = list(dict.fromkeys(rank_nodes))
    return {
        "replicas": int(levels.get("replicas", 0)),
        "nodes": nodes,
        "node": node,
        "node_from": found,
        "shares": rows,
    }


def _step(root: str, step: int, name: str, index: int | None, node: str | None) -> dict[str, Any]:
    path = os.path.join(root, name)
    row: dict[str, Any] = {"step": step, "path": path, "indexed": index == step}
    row["above_index"] = index is not None and step > index
    try:
        m = read_manifest(path)
    except (FastPersistError, OSError) as e:
        return row | {"committed": False, "problem": str(e), "replicas": 0, "bytes_here": 0}
    row |= {"committed": True, "checkpoint_id": m.checkpoint_id, "created": m.created}
    row |= {"sharded": bool(m.shards), "replicas": 0}
    if shares_of(m) is None:
        size = sum(f.len_bytes for f in m.files)
        if m.shards:
            size = 0
            for shard in m.shards:
                try:
                    size += sum(f.len_bytes for f in read_manifest(os.path.join(path, shard)).files)
                except (FastPersistError, OSError):
                    continue
        return row | {"bytes_here": size}
    row |= _partner_shares(path, m, node)
    row["bytes_here"] = sum(s["bytes"] for s in row["shares"])
    return row


def describe_root(root: str, node: str | None = None) -> dict[str, Any]:
    """Everything ``inspect ROOT`` shows, as a dict (``--json`` prints it)."""
    root = os.path.abspath(root)
    index = read_local_index(root).step
    steps = sorted((s, n) for n in os.listdir(root) if (s := parse_step_dir(n)) is not None)
    rows = [_step(root, step, name, index, node) for step, name in steps]
    levels: dict[str, dict[str, Any]] = {name: {"steps": [], "bytes": 0} for name in ("local", "partner", "unknown")}
    by_kind = {"own": levels["local"], "copy": levels["partner"], "?": levels["unknown"]}
    for row in rows:
        if not row["committed"]:
            continue
        if not row["replicas"]:
            levels["local"]["steps"].append(row["step"])
            levels["local"]["bytes"] += row["bytes_here"]
            continue
        for share in row["shares"]:
            level = by_kind[share["kind"]]
            if share["present"] and row["step"] not in level["steps"]:
                level["steps"].append(row["step"])
            level["bytes"] += share["bytes"]
    if not levels["unknown"]["steps"]:
        del levels["unknown"]  # every share's level is known (or there are no partner-level steps)
    return {"root": root, "index_step": index, "steps": rows, "levels": levels}


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def _print_step(row: dict[str, Any]) -> None:
    flags = (
        " (indexed: latest)" if row["indexed"] else " (above the index: another run's)" if row["above_index"] else ""
    )
    if not row["committed"]:
        print(f"  step {row['step']}{flags}: not a committed checkpoint ({row['problem']})")
        return
    how = f"replicas={row['replicas']} over nodes {', '.join(row['nodes'])}" if row["replicas"] else "no replicas"
    kind = "sharded" if row["sharded"] else "replicated"
    print(
        f"  step {row['step']}{flags}: id {row['checkpoint_id']}, created {row['created']}, {kind}, {how}; "
        f"{row['bytes_here']:,} bytes here ({_human(row['bytes_here'])})"
    )
    if not row["replicas"]:
        return
    print(f"    this root is node {row['node'] or '?'} ({row['node_from']})")
    for s in row["shares"]:
        state = f"present, {s['bytes']:,} bytes" if s["present"] else f"missing ({s['problem']})"
        print(f"    share {s['share']} of rank {s['owner_rank']} (node {s['owner_node']}): {s['kind']}, {state}")


def print_root(info: dict[str, Any]) -> None:
    """Prints :func:`describe_root`'s result for a person."""
    index = info["index_step"]
    print(f"{info['root']}: Checkpointer root, {len(info['steps'])} step(s), index names step {index}")
    for row in info["steps"]:
        _print_step(row)
    for name, level in info["levels"].items():
        steps = ", ".join(map(str, level["steps"])) or "none"
        what = "local or partner (pass --node)" if name == "unknown" else name
        print(f"  level {what}: steps {steps}; {level['bytes']:,} bytes ({_human(level['bytes'])})")
