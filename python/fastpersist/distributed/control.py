"""The control plane of a process group: one private gloo group per (group, timeout) for the
small messages of group saves, group loads and retention, and the facts every rank derives
from the group (its rank and size, which ranks write).

Collectives on the control group time out after ``Config.timeout_s``; :func:`collective` turns
a timeout or a dead peer into the caller's error class (:class:`~fastpersist.GroupSaveError`,
:class:`~fastpersist.GroupLoadError`) and forgets the control group, whose state is no longer
trustworthy after a failed collective.

Example:
    >>> writer_map(["a", "a", "b", "b"], "node")
    {0: 0, 2: 1}
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch.distributed as dist

from ..errors import FastPersistError
from ..levels.placement import node_name

__all__ = [
    "ControlGroup",
    "collective",
    "control_for",
    "describe",
    "forget_control",
    "group_rank_and_size",
    "writer_map",
]

T = TypeVar("T")


class ControlGroup:
    """A private gloo group with the save's timeout, for the protocol's small messages."""

    def __init__(self, group: Any, timeout_s: float) -> None:
        ranks = dist.get_process_group_ranks(group)
        self.pg: Any = cast(
            Any,
            dist.new_group(
                ranks=ranks, backend="gloo", timeout=timedelta(seconds=timeout_s), use_local_synchronization=True
            ),
        )
        self.rank = dist.get_rank(self.pg)
        self.size = dist.get_world_size(self.pg)
        self.timeout_s = timeout_s
        #: Each rank's node (:func:`fastpersist.levels.placement.node_name`), gathered once per group.
        self.nodes: list[str] = self.all_gather(node_name())

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's `obj`, in rank order."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, group=self.pg, group_src=0)
        return box[0]


_controls: dict[tuple[int, float], ControlGroup] = {}
_controls_lock = threading.Lock()


def control_for(group: Any, timeout_s: float) -> ControlGroup:
    """The private gloo group (operations time out after `timeout_s`) over `group`'s ranks,
    created on first use and kept for later saves and loads through the same group."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group= needs an initialised torch.distributed process group (dist.init_process_group)")
    group = dist.group.WORLD if group is None else group
    key = (id(group), float(timeout_s))
    with _controls_lock:
        control = _controls.get(key)
    if control is None:
        control = ControlGroup(group, timeout_s)
        with _controls_lock:
            _controls[key] = control
    return control


def forget_control(control: ControlGroup) -> None:
    """Drops a control group after a failed collective (its state is no longer trustworthy)."""
    with _controls_lock:
        for key, value in list(_controls.items()):
            if value is control:
                del _controls[key]


def collective(
    control: ControlGroup, what: str, op: Callable[[], T], error: type[FastPersistError], consequence: str = ""
) -> T:
    """Runs the collective `op`; if the group stops answering, forgets `control` and raises `error`
    naming this rank, `what` it was trying to do, the timeout, and `consequence` (appended)."""
    try:
        return op()
    except Exception as e:
        forget_control(control)
        raise error(
            f"rank {control.rank}: the process group stopped answering while trying to {what} "
            f"(a rank failed, was killed, or took longer than timeout_s={control.timeout_s}): {e}{consequence}"
        ) from e


def describe(error: BaseException) -> str:
    """An error as one rank tells the others of it: its class and its message."""
    return f"{type(error).__name__}: {error}"


def group_rank_and_size(group: Any) -> tuple[int, int]:
    """This process's rank in `group` (None = the default group) and the group's size."""
    pg: Any = dist.group.WORLD if group is None else group
    return dist.get_rank(pg), dist.get_world_size(pg)


def writer_map(nodes: list[str], writers: str | int) -> dict[int, int]:
    """Maps group rank -> writer index for ``Config.writers``, given each rank's node.

    ``"rank"``: every rank writes; ``"node"``: the lowest rank of each node; ``k``: the ``k``
    lowest ranks of each node. Writer indices follow rank order.

    Example:
        >>> writer_map(["a", "a", "b", "b"], "node")
        {0: 0, 2: 1}
    """
    if writers == "rank":
        chosen = list(range(len(nodes)))
    else:
        per_host = 1 if writers == "node" else int(writers)
        seen: dict[str, int] = {}
        chosen = []
        for rank, node in enumerate(nodes):
            if seen.get(node, 0) < per_host:
                seen[node] = seen.get(node, 0) + 1
                chosen.append(rank)
    return {rank: index for index, rank in enumerate(chosen)}
