"""The control plane of a process group: one private gloo group per (group, timeout) for the
small messages of group saves, group loads and retention, and the facts every rank derives
from the group (its rank and size, which ranks write).

Collectives on the control group time out after ``Config.timeout_s``; :func:`collective` turns
a timeout or a dead peer into the caller's error class (:class:`~fastpersist.GroupSaveError`,
:class:`~fastpersist.GroupLoadError`) and forgets the control group, whose state is no longer
trustworthy after a failed collective. Every wait on the group (:meth:`ControlGroup.wait`) also
watches the peers (:mod:`fastpersist.distributed.watch`): a rank killed, or one that left a failed
collective (forgetting the group closes its connections), is noticed by every other rank within
about :data:`GONE_GRACE_S`, wherever they wait, instead of after ``timeout_s``.

Example:
    >>> writer_map(["a", "a", "b", "b"], "node")
    {0: 0, 2: 1}
"""

from __future__ import annotations

import atexit
import pickle
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from ..errors import FastPersistError, GroupSaveError
from .placement import node_name
from .watch import Address, PeerWatch

__all__ = [
    "ControlGroup",
    "GONE_GRACE_S",
    "PeerGoneError",
    "WAIT_SLICE",
    "agree",
    "collective",
    "control_for",
    "describe",
    "failures_in",
    "forget_control",
    "group_rank_and_size",
    "outcome",
    "writer_map",
]

T = TypeVar("T")

#: How long a wait blocks before it looks at the watch again.
WAIT_SLICE = timedelta(seconds=0.05)
#: How long a work may still finish after a peer's connection closed (a rank that exits right
#: after its last send closes it while its bytes are still arriving).
GONE_GRACE_S = 0.5


class PeerGoneError(FastPersistError):
    """A peer rank of a control group is gone (killed, or it left a failed collective)."""


class ControlGroup:
    """A private gloo group with the save's timeout, for the protocol's small messages, and the
    watch that tells at once when a peer is gone (:mod:`fastpersist.distributed.watch`)."""

    def __init__(self, group: Any, timeout_s: float) -> None:
        ranks = dist.get_process_group_ranks(group)
        self._pg: Any = cast(
            Any,
            dist.new_group(
                ranks=ranks, backend="gloo", timeout=timedelta(seconds=timeout_s), use_local_synchronization=True
            ),
        )
        self.rank = dist.get_rank(self._pg)
        self.size = dist.get_world_size(self._pg)
        self.timeout_s = timeout_s
        self._abandoned: Any = None  # a work given up on: see close()
        self.watch = PeerWatch(self.rank, self.size, self._exchange_addresses, timeout_s)
        #: Each rank's node (:func:`fastpersist.distributed.placement.node_name`), gathered once per group.
        self.nodes: list[str] = self.all_gather(node_name())

    def _exchange_addresses(self, mine: Address) -> list[Address]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, mine, group=self._pg)  # the watch is not up yet: a plain wait
        return out

    @property
    def pg(self) -> Any:
        """The gloo process group; raises once :meth:`close` dropped it (never falls back to the
        default group, as ``group=None`` would)."""
        if self._pg is None:
            raise FastPersistError(
                f"rank {self.rank}: this control group was closed after a failed collective; a new one is made "
                "for the next save or load"
            )
        return self._pg

    def wait(self, work: Any) -> None:
        """Waits for the gloo `work` of this group (an ``async_op`` collective, an ``isend`` or
        ``irecv``), raising its error; raises :class:`PeerGoneError` as soon as a peer's watch
        connection closed and the work does not finish within :data:`GONE_GRACE_S` after, and
        TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                work.wait(WAIT_SLICE)
                return
            except RuntimeError:
                if work.is_completed():
                    work.wait()  # the work's own outcome: its error, or done as the slice ran out
                    return
            gone = self.watch.gone()
            if gone and time.monotonic() - min(gone.values()) > GONE_GRACE_S:
                self._abandoned = work
                raise PeerGoneError(
                    f"rank {self.rank}: ranks {sorted(gone)} are gone (killed, or left a failed collective: their "
                    "connections closed)"
                )
            if time.monotonic() > deadline:
                self._abandoned = work
                raise TimeoutError(f"rank {self.rank}: no answer from the group within timeout_s={self.timeout_s}")

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's `obj` (pickled), in rank order."""
        data = pickle.dumps(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.wait(dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.pg, async_op=True))
        longest = max(int(n.item()) for n in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        self.wait(dist.all_gather(out, mine, group=self.pg, async_op=True))
        return [pickle.loads(t[: int(n.item())].numpy().tobytes()) for t, n in zip(out, sizes, strict=True)]

    def max_of(self, values: list[int]) -> list[int]:
        """The element-wise maximum of every rank's `values` (one small collective, no pickling)."""
        mine = torch.tensor(values, dtype=torch.int64)
        self.wait(dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.pg, async_op=True))
        return [int(v) for v in mine.tolist()]

    def broadcast(self, obj: T, src: int = 0) -> T:
        """Rank `src`'s `obj` (pickled) on every rank."""
        data = pickle.dumps(obj) if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self.wait(dist.broadcast(size, group=self.pg, group_src=src, async_op=True))
        payload = torch.zeros(int(size.item()), dtype=torch.uint8)
        if self.rank == src:
            payload[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.wait(dist.broadcast(payload, group=self.pg, group_src=src, async_op=True))
        return cast(T, obj if self.rank == src else pickle.loads(payload.numpy().tobytes()))

    def close(self) -> None:
        """Closes the watch connections, so that every peer still waiting on this rank fails at
        once, and destroys the gloo group (idempotent). A group with a work left waiting on a gone
        peer is kept instead (destroying it would wait for that work, up to ``timeout_s``); it is
        never used again."""
        self.watch.close()
        pg, self._pg = self._pg, None
        if pg is None:
            return
        if self._abandoned is not None:
            _abandoned.append((pg, self._abandoned))
            return
        dist.destroy_process_group(pg)


#: Groups closed with a work still waiting on a gone peer, and that work: kept alive (see
#: :meth:`ControlGroup.close`).
_abandoned: list[tuple[Any, Any]] = []
_controls: dict[tuple[int, float, str], ControlGroup] = {}
_controls_lock = threading.Lock()


def _close_all_at_exit() -> None:
    """Closes this process's control groups while the interpreter is still whole. A gloo group
    that lives into interpreter finalization can abort the process ("terminate called without
    an active exception"): its threads' works hold tensors whose release needs the GIL. Our
    reference kept each group alive even after the script's own destroy_process_group()."""
    with _controls_lock:
        controls = list(_controls.values())
        _controls.clear()
    for control in controls:
        try:
            control.close()
        except Exception:  # the script destroyed every group already: only our reference is left
            control._pg = None


def control_for(group: Any, timeout_s: float, lane: str = "saves") -> ControlGroup:
    """The private gloo group (operations time out after `timeout_s`) over `group`'s ranks,
    created on first use and kept for later saves and loads through the same group.

    Each `lane` is a group of its own. Collectives on one group must be issued in the same order
    on every rank, so a thread that runs its collectives while another thread runs a save's (a
    Checkpointer's per-step agreement, in the loop's thread, while the previous save commits on
    its own) takes a lane of its own."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group= needs an initialised torch.distributed process group (dist.init_process_group)")
    group = dist.group.WORLD if group is None else group
    key = (id(group), float(timeout_s), lane)
    with _controls_lock:
        control = _controls.get(key)
    if control is None:
        control = ControlGroup(group, timeout_s)
        with _controls_lock:
            if not _controls:
                atexit.register(_close_all_at_exit)  # once per set of groups; a no-op when empty
            _controls[key] = control
    return control


def forget_control(control: ControlGroup) -> None:
    """Drops a control group after a failed collective (its state is no longer trustworthy) and
    closes it, so that the peers blocked on this rank notice at once (:meth:`ControlGroup.close`)."""
    with _controls_lock:
        for key, value in list(_controls.items()):
            if value is control:
                del _controls[key]
    control.close()


def collective(
    control: ControlGroup, what: str, op: Callable[[], T], error: type[FastPersistError], consequence: str = ""
) -> T:
    """Runs the collective `op`; if the group stops answering, forgets `control` and raises `error`
    naming this rank, `what` it was trying to do, the timeout, and `consequence` (appended)."""
    try:
        return op()
    except Exception as e:
        # The frames of the failed call and `op` hold the group (torch's arguments, a partial):
        # released here, the group's last reference goes with forget_control and its sockets close.
        del op
        if e.__traceback__ is not None and e.__traceback__.tb_next is not None:
            traceback.clear_frames(e.__traceback__.tb_next)
        forget_control(control)
        raise error(
            f"rank {control.rank}: the process group stopped answering while trying to {what} "
            f"(a rank failed, was killed, or took longer than timeout_s={control.timeout_s}): {e}{consequence}"
        ) from e


def agree(
    control: ControlGroup | None,
    what: str,
    error: BaseException | None,
    consequence: str = "",
    raises: type[FastPersistError] = GroupSaveError,
) -> None:
    """Every rank tells the others whether its part of `what` went well: raises this rank's
    `error`, else `raises` (a :class:`~fastpersist.GroupSaveError`, or a
    :class:`~fastpersist.GroupLoadError` for a restore) naming the first rank that failed, with
    `consequence` appended (one process, `control` None: raises `error`)."""
    if control is None:
        if error is not None:
            raise error
        return
    outcomes = collective(control, what, lambda: control.all_gather(outcome(error)), raises, consequence)
    if error is not None:
        raise error
    for rank, why in failures_in(outcomes):
        raise raises(f"rank {control.rank}: rank {rank} failed to {what} ({why}){consequence}")


def outcome(error: BaseException | None) -> str | None:
    """What one rank tells the others of its part of a collective step: None if it went well,
    else its error (:func:`describe`). Gathered, :func:`failures_in` reads them back."""
    return None if error is None else describe(error)


def failures_in(outcomes: Sequence[str | None]) -> list[tuple[int, str]]:
    """``(rank, why)`` of each rank whose gathered :func:`outcome` says it failed, in rank order."""
    return [(rank, why) for rank, why in enumerate(outcomes) if why is not None]


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
