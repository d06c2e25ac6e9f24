"""Nodes and partner placement for the partner level.

A node is the value of ``FASTPERSIST_NODE`` if set (tests simulate nodes with it), else the host
name. The nodes of a group are numbered in the order their lowest rank appears. A rank's share
is replicated on ``replicas`` other nodes by a ring over the nodes: the i-th copy of a share of a
rank on node ``n`` goes to node ``(n + i) % node_count``, to the rank there whose local index
(its position among its node's ranks) equals the sender's, modulo that node's rank count. A
copy is never on the sender's own node, so ``replicas`` is at most ``node_count - 1``.

Example:
    >>> p = Placement(["a", "a", "b", "b"])
    >>> p.partners(0, 1), p.partners(3, 1), p.leaders
    ([2], [1], [0, 2])
"""

from __future__ import annotations

import os
import socket

__all__ = ["NODE_ENV", "Placement", "node_name"]

#: The environment variable naming this process's node (else the host name).
NODE_ENV = "FASTPERSIST_NODE"


def node_name() -> str:
    """This process's node: ``$FASTPERSIST_NODE`` if set and not empty, else the host name."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


class Placement:
    """Which node each rank of a group is on, and where each rank's share is replicated."""

    def __init__(self, rank_nodes: list[str]) -> None:
        self.rank_nodes = list(rank_nodes)
        self.nodes: list[str] = list(dict.fromkeys(rank_nodes))
        self.node_ranks: list[list[int]] = [[] for _ in self.nodes]
        index = {name: i for i, name in enumerate(self.nodes)}
        for rank, name in enumerate(rank_nodes):
            self.node_ranks[index[name]].append(rank)
        self._node_of = [index[name] for name in rank_nodes]

    def node_of(self, rank: int) -> int:
        """The index (in :attr:`nodes`) of `rank`'s node."""
        return self._node_of[rank]

    @property
    def leaders(self) -> list[int]:
        """The lowest rank of each node: it creates and commits that node's step directory."""
        return [ranks[0] for ranks in self.node_ranks]

    def is_leader(self, rank: int) -> bool:
        return self.node_ranks[self.node_of(rank)][0] == rank

    def check_replicas(self, replicas: int) -> None:
        """Raises ValueError unless `replicas` copies fit on other nodes."""
        if replicas > len(self.nodes) - 1:
            raise ValueError(
                f"Partner(replicas={replicas}) needs at least {replicas + 1} nodes, but the group spans "
                f"{len(self.nodes)} ({', '.join(self.nodes[:8])}); a node is ${NODE_ENV} or the host name"
            )

    def partners(self, rank: int, replicas: int) -> list[int]:
        """The ranks that keep the copies of `rank`'s share, nearest in the ring first."""
        node = self.node_of(rank)
        local = self.node_ranks[node].index(rank)
        out = []
        for i in range(1, replicas + 1):
            ranks = self.node_ranks[(node + i) % len(self.nodes)]
            out.append(ranks[local % len(ranks)])
        return out

    def sources(self, rank: int, replicas: int) -> list[int]:
        """The ranks whose shares `rank` keeps a copy of (the inverse of :meth:`partners`)."""
        return [r for r in range(len(self.rank_nodes)) if rank in self.partners(r, replicas)]

    def holder_nodes(self, rank: int, replicas: int) -> list[int]:
        """The nodes holding `rank`'s share: its own first, then its partners' in ring order."""
        return [self.node_of(rank)] + [self.node_of(p) for p in self.partners(rank, replicas)]
