"""What a node's step directory holds on the partner level.

A step saved with ``replicas=k`` (:mod:`fastpersist.saving.partner_copies`) is a set of *shares*, one
per writing rank: a replicated save's share is the data files of one writer, a sharded save's
the shard directory of one rank. Every node's step directory carries the same manifest (its
``extra["levels"]`` names the placement) and the shares of its own ranks and of the ranks it is
a partner of. A share is *present* on a node when its files are there, regular files of their
recorded sizes (cheap: no data is read); a restore uses a copy only after its checksums verify.

Example:
    >>> Share(0, 2, [("data-w0-s0.bin", 4096)]).nbytes
    4096
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from ..distributed.placement import Placement
from ..errors import FastPersistError
from ..format.confine import data_file_problem
from ..format.layout import shard_name
from ..format.manifest import Manifest, read_manifest
from ..memory_level.recycle import recycle_checkpoint
from ..saving.remover import remove_checkpoint_later

__all__ = ["Share", "held_shares", "retire_on_node", "share_problem", "shares_of"]

log = logging.getLogger("fastpersist")


@dataclass(frozen=True)
class Share:
    """One rank's share of a step: its index (writer or shard), its owner rank, its data files."""

    index: int
    owner: int
    files: list[tuple[str, int]]

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.files)


def shares_of(m: Manifest) -> list[Share] | None:
    """The shares of a step saved with replicas (files named relative to the step directory);
    None for a checkpoint without partner copies. A sharded step's shares list no files: they
    are in each shard's own manifest (:func:`share_problem` reads it)."""
    levels = m.extra.get("levels")
    if not isinstance(levels, dict):
        return None
    owners = levels.get("share_ranks")
    if not isinstance(owners, list) or not all(type(r) is int and r >= 0 for r in owners):
        return None
    if m.shards:
        return [Share(i, owners[i] if i < len(owners) else i, []) for i in range(len(m.shards))]
    # One share per writer, even a writer with no bytes (a stream of fewer chunks than writers).
    by_writer: dict[int, list[tuple[str, int]]] = {w: [] for w in range(len(owners))}
    for f in m.files:
        by_writer.setdefault(f.writer, []).append((f.name, f.len_bytes))
    return [Share(w, owners[w] if w < len(owners) else w, files) for w, files in sorted(by_writer.items())]


def share_problem(step_dir: str, m: Manifest, share: Share) -> str | None:
    """Why `share` is not present in `step_dir` (a missing or wrong-sized file), or None."""
    try:
        if m.shards:
            shard_dir = os.path.join(step_dir, shard_name(share.index))
            shard = read_manifest(shard_dir)
            files = [(shard.file_path(shard_dir, f), f.len_bytes) for f in shard.files]
            where = shard_dir
        else:
            files = [(os.path.join(step_dir, name), n) for name, n in share.files]
            where = step_dir
        for path, n in files:
            problem = data_file_problem(where, path, n)
            if problem:
                return problem
    except (FastPersistError, OSError) as e:
        return str(e)
    return None


def held_shares(step_dir: str, m: Manifest) -> list[int]:
    """The indices of the shares present in `step_dir`."""
    shares = shares_of(m) or []
    return [s.index for s in shares if share_problem(step_dir, m, s) is None]


def _placed_here(m: Manifest, node: str) -> list[Share]:
    """The shares the placement recorded in `m` puts on `node`."""
    levels = m.extra.get("levels", {})
    placement = Placement(levels.get("rank_nodes", []))
    replicas = int(levels.get("replicas", 0))
    if node not in placement.nodes:
        return []
    here = placement.nodes.index(node)
    return [s for s in shares_of(m) or [] if here in placement.holder_nodes(s.owner, replicas)]


def retire_on_node(step_dir: str, candidates: list[str], node: str) -> list[str]:
    """A node leader's retention: removes `candidates` once the new step at `step_dir` holds
    every share the placement puts on `node`; returns what it removed."""
    try:
        m = read_manifest(step_dir)
        problems = [p for s in _placed_here(m, node) if (p := share_problem(step_dir, m, s))]
    except (FastPersistError, OSError) as e:
        problems = [str(e)]
    if problems and candidates:
        log.warning("keeping %s: the new step %s is not complete on this node (%s)", candidates, step_dir, problems[0])
        return []
    # On a memory root the newest retired step's files are recycled for the next save to overwrite.
    recycled = bool(candidates) and recycle_checkpoint(os.path.dirname(step_dir), candidates[-1])
    for path in candidates[:-1] if recycled else candidates:
        remove_checkpoint_later(path, None)
    return list(candidates)
