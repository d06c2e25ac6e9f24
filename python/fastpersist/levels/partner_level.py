"""A :class:`~fastpersist.Checkpointer`'s partner level: what it does differently with ``replicas=k``.

Each node's root holds that node's own step directories (the shares of its ranks and copies of
its partners' shares, :mod:`fastpersist.saving.partner_copies`); the node's leader (its lowest rank)
cleans that root, writes its index and retires its old steps, each only once the new step is
complete on the node. ``latest()`` and ``load()`` are agreed over the group
(:mod:`fastpersist.levels.partner_restore`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

from ..cleanup import clean
from ..config import Config
from ..distributed.control import ControlGroup, control_for
from ..distributed.placement import Placement, node_name
from ..errors import FastPersistError
from ..format.layout import MANIFEST_NAME, shard_name
from ..format.manifest import read_manifest
from ..futures import SaveResult
from ..loading.phases import PhaseClock
from ..loading.pipeline import LoadOptions
from .host import LevelHost
from .partner_holdings import retire_on_node, share_problem, shares_of
from .partner_restore import candidates, node_report, restore_step, verified_step

__all__ = ["PartnerLevel"]

log = logging.getLogger("fastpersist")


class PartnerLevel:
    """The partner level of one Checkpointer (one per rank): its root level
    (:class:`~fastpersist.levels.host.RootLevel`)."""

    per_rank_shares = True

    def __init__(self, host: LevelHost, replicas: int) -> None:
        self.host = host
        self.replicas = replicas
        self.node = node_name()
        self.last: SaveResult | None = None
        #: (step directory, share) -> fingerprint of the copy this rank last verified.
        self.verified: dict[tuple[str, int], tuple[Any, ...]] = {}

    def control(self) -> ControlGroup:
        return control_for(self.host.group, self.host.timeout_s)

    def placement(self) -> Placement:
        return Placement(self.control().nodes)

    def is_leader(self) -> bool:
        """Whether this rank is its node's lowest (collective on first use: every rank must call)."""
        return self.placement().is_leader(self.host.rank)

    def committer(self) -> bool:
        return self.is_leader()

    def clean(self) -> list[str]:
        """The node leader cleans its node's root (collective on first use)."""
        return clean(self.host.root) if self.is_leader() else []

    def after_commit(self, step: int, result: SaveResult, candidates: list[str]) -> None:
        """The node leader's index and retention once `step` committed on every node."""
        self.last = result
        if not self.is_leader():
            return
        self.host.write_index(step)
        placement = self.placement()
        here = placement.node_ranks[placement.node_of(self.host.rank)]
        kept = sorted({s for r in here for s in placement.sources(r, self.replicas)})
        log.info(
            "step %d is on node %s under %s: local level, the shares of ranks %s; partner level, copies of "
            "the shares of ranks %s (local write %.3f s, copies %.3f s)",
            step,
            self.node,
            self.host.root,
            here,
            kept,
            result.seconds - result.phases.get("replicate", 0.0),
            result.phases.get("replicate", 0.0),
        )
        removed = retire_on_node(self.host.path(step), candidates, self.node)
        if removed:
            log.info("node %s retired %s under %s", self.node, [os.path.basename(p) for p in removed], self.host.root)

    def _reports(self) -> list[Any]:
        control = self.control()
        mine = node_report(control.rank, self.host.root, self.host.local.index_step())
        return control.all_gather(mine)

    def latest(self) -> int | None:
        self.host.in_flight.finish_all()  # the save in flight uses the same control group
        control = self.control()
        return verified_step(control, self.host.root, self.host.path, self._reports(), self.verified)

    def holds(self, step: int) -> bool:
        """Whether the nodes, between them, hold every share of `step` (copies not yet read:
        the restore verifies them). Collective."""
        self.host.in_flight.finish_all()
        return any(c.step == step for c in candidates(self._reports()))

    def load(self, step: int | None, out: object, map_location: Any, namedtuple_types: Iterable[type]) -> Any:
        self.host.in_flight.finish_all()
        config = self.host.config or Config()
        options = LoadOptions(map_location, True, config, namedtuple_types, PhaseClock(None))
        found, state = restore_step(self.control(), self.host.root, self.host.path, self._reports(), options, step, out)
        log.info("rank %d restored step %d (node %s)", self.host.rank, found, self.node)
        return state

    def levels(self) -> dict[str, Any]:
        """What this node holds on each level: steps, bytes, seconds of the last copy."""
        local: dict[str, Any] = {"root": self.host.root, "node": self.node, "steps": [], "bytes": 0}
        partner: dict[str, Any] = {"replicas": self.replicas, "steps": [], "bytes": 0}
        for step in self.host.steps():
            path = self.host.path(step)
            try:
                m = read_manifest(path)
            except (FastPersistError, OSError):
                continue
            rank_nodes = m.extra.get("levels", {}).get("rank_nodes", [])
            for share in shares_of(m) or []:
                if share_problem(path, m, share) is not None:
                    continue
                own = share.owner < len(rank_nodes) and rank_nodes[share.owner] == self.node
                level = local if own else partner
                if step not in level["steps"]:
                    level["steps"].append(step)
                level["bytes"] += _share_bytes(path, m, share)
        if self.last is not None:
            local["last_seconds"] = self.last.seconds - self.last.phases.get("replicate", 0.0)
            partner["last_seconds"] = self.last.phases.get("replicate", 0.0)
        return {"local": local, "partner": partner}


def _share_bytes(path: str, m: Any, share: Any) -> int:
    if not m.shards:
        return int(share.nbytes)

    shard_dir = os.path.join(path, shard_name(share.index))
    try:
        return sum(f.len_bytes for f in read_manifest(shard_dir).files) + os.path.getsize(
            os.path.join(shard_dir, MANIFEST_NAME)
        )
    except (FastPersistError, OSError):
        return 0
