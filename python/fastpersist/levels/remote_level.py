"""A :class:`~fastpersist.Checkpointer`'s remote level: when a step is due for the remote, where
restore finds it, what ``levels()`` says of it (the drain: :mod:`fastpersist.levels.drain`; the
directory: :mod:`fastpersist.levels.remote`)."""

from __future__ import annotations

import collections
import datetime
import logging
import os
import statistics
from typing import Any

from ..advisor.multilevel import Failures, LevelCosts, best_remote_every
from ..errors import FastPersistError
from ..format.layout import MANIFEST_NAME
from .drain import Drainer, DrainResult
from .refill import refill_step
from .remote import Remote

__all__ = ["RemoteLevel"]

log = logging.getLogger("fastpersist")


class RemoteLevel:
    """The remote level of one Checkpointer (one per rank)."""

    def __init__(
        self,
        ck: Any,
        target: str | os.PathLike[str],
        every: int | None,
        keep: int,
        bytes_per_s: float | None,
        failures: Failures | None = None,
    ) -> None:
        if every is not None and (type(every) is not int or every < 1):
            raise ValueError(f"remote_every={every!r}: expected an integer >= 1 or None")
        if type(keep) is not int or keep < 1:
            raise ValueError(f"remote_keep={keep!r}: expected an integer >= 1")
        if bytes_per_s is not None and not bytes_per_s > 0:
            raise ValueError(f"remote_bytes_per_s={bytes_per_s!r}: expected a positive number or None")
        self.ck = ck  # the Checkpointer (not imported: it imports this module)
        self.remote = Remote(target)
        #: None: every committed step is handed over and the drain takes the newest whenever it is
        #: free, i.e. as often as one drain at a time allows; with `failures`, each drain's
        #: measured cost then sets it to the multi-level advisor's choice (:meth:`_advise`).
        self.every = every
        self.failures = failures if every is None else None
        #: The costs the last advice used (None before the first drain, or without `failures`).
        self.advised_costs: LevelCosts | None = None
        self._drain_s: collections.deque[float] = collections.deque(maxlen=16)
        self._drain_cpu_s: collections.deque[float] = collections.deque(maxlen=16)
        self.keep = keep
        self.bytes_per_s = bytes_per_s
        self.drainer: Drainer | None = None
        self.last: DrainResult | None = None
        self.last_submitted = -1
        self._agree_pg: Any = None
        if ck.group is not None:  # collective: every rank makes its Checkpointer
            import torch.distributed as dist

            self._agree_pg = dist.new_group(
                ranks=dist.get_process_group_ranks(ck.group),
                backend="gloo",
                timeout=datetime.timedelta(seconds=self._timeout()),
                use_local_synchronization=True,
            )
        self._verified: dict[int, tuple[Any, ...]] = {}

    def _timeout(self) -> float:
        return float(self.ck.config.timeout_s) if self.ck.config is not None else 600.0

    def after_commit(self, step: int) -> None:
        """Hands `step` to the drain if a multiple of `every` was crossed since the last one."""
        if self.every is not None and step // self.every <= self.last_submitted // self.every:
            return
        self.last_submitted = step
        if self.drainer is None:
            from ..distributed.control import group_rank_and_size

            size = group_rank_and_size(self.ck.group)[1] if self.ck.group is not None else 1
            self.drainer = Drainer(
                self.remote,
                self.ck.path,
                rank=self.ck.rank,
                size=size,
                keep=self.keep,
                timeout_s=self._timeout(),
                bytes_per_s=self.bytes_per_s,
                staging=self._staging,
                writing=self._writing,
                agree=self._agree if self._agree_pg is not None else None,
                on_drained=self._advise if self.failures is not None else None,
            )
        self.drainer.submit(step)

    def _agree(self, step: int) -> int:
        """The step every rank's drain takes now: the newest any rank proposes."""
        import torch.distributed as dist

        proposals: list[Any] = [None] * dist.get_world_size(self._agree_pg)
        dist.all_gather_object(proposals, step, group=self._agree_pg)
        return max(int(p) for p in proposals)

    def costs(self) -> LevelCosts | None:
        """The Checkpointer's measured costs with this level's drains (medians), for the advisor;
        None until a save and a drain were measured. A drain's cost to training is taken as the
        CPU time of its thread; a restart from the remote as one drain's time plus the local
        restart."""
        local = self.ck.history.costs()
        if local is None or not self._drain_s:
            return None
        last = self.ck._last
        replicate = last.phases.get("replicate", 0.0) if last is not None else 0.0
        drain = statistics.median(self._drain_s)
        return LevelCosts(
            step_s=local.step_s,
            stall_s=local.stall_s,
            write_s=max(local.write_s - replicate, 0.0),
            replicate_s=replicate,
            drain_s=drain,
            drain_overhead_s=statistics.median(self._drain_cpu_s),
            restart_s=local.restart_s,
            remote_restart_s=drain + local.restart_s,
        )

    def _advise(self, result: DrainResult) -> None:
        """After a drain (on its thread): sets `every` to the advisor's ``remote_every`` for the
        measured costs and `failures` (docs/advisor.md, "Several levels")."""
        self._drain_s.append(result.seconds)
        self._drain_cpu_s.append(result.cpu_s)
        costs = self.costs()
        if costs is None or self.failures is None:
            return
        new = best_remote_every(self.ck.replicas, self.ck.every, costs, self.failures)
        if new != self.every:
            log.info(
                "remote level %s: remote_every %s -> %d steps (drain %.2f s, drain CPU %.2f s, step %.3f s, every %d)",
                self.remote.root,
                self.every,
                new,
                costs.drain_s,
                costs.drain_overhead_s,
                costs.step_s,
                self.ck.every,
            )
        self.advised_costs, self.every = costs, new

    def pinned(self) -> set[int]:
        """Local steps the drain still reads (kept by retention until it is done)."""
        return self.drainer.pinned() if self.drainer is not None else set()

    def _staging(self) -> bool:
        future = self.ck._future
        return future is not None and not future.staged()

    def _writing(self) -> bool:
        future = self.ck._future
        return future is not None and future.staged() and not future.done()

    def close(self) -> None:
        """Waits for the drain (its thread stops; a later save starts another); raises its failure."""
        drainer, self.drainer = self.drainer, None
        if drainer is not None:
            try:
                drainer.close()
            finally:
                self.last = drainer.last

    def _verifies(self, step: int) -> bool:
        path = self.remote.path(step)
        try:
            fingerprint = (self.remote.committed_id(step),)
            if self._verified.get(step) == fingerprint:
                return True
            self.remote.verify(step)
        except (FastPersistError, OSError) as e:
            log.warning("the remote copy %s fails verification, skipping it: %s", path, e)
            return False
        self._verified[step] = fingerprint
        return True

    def latest(self, above: int | None = None) -> int | None:
        """The newest committed remote step, up to the remote index and newer than `above` (the
        local level's newest: an older remote step is not worth reading), that verifies; in a
        group rank 0 checks and the others follow it."""
        if self.drainer is not None:
            self.drainer.wait()
        indexed = self.remote.index_step()
        found = None
        if self.ck.rank == 0 or self.ck.group is None:
            for step in reversed(self.remote.steps()):
                if above is not None and step <= above:
                    break
                if (indexed is None or step <= indexed) and self._verifies(step):
                    found = step
                    break
        if self.ck.group is not None:
            from ..distributed.control import control_for

            found = control_for(self.ck.group, self._timeout()).broadcast(found)
        return found

    def holds_only(self, step: int) -> bool:
        """Whether `step` is to come from the remote: committed there, and not under the local
        root of some rank (agreed over the group)."""
        there = self.remote.committed_id(step) is not None
        held = os.path.exists(os.path.join(self.ck.path(step), MANIFEST_NAME))
        if self.ck.group is not None:
            from ..distributed.control import control_for

            held = all(control_for(self.ck.group, self._timeout()).all_gather(held))
        return there and not held

    def refill(self, step: int) -> None:
        """Downloads `step` from the remote into the local level (every rank its shares), so it
        loads as a local step (:mod:`fastpersist.levels.refill`)."""
        log.info("rank %d refills step %d from the remote level %s", self.ck.rank, step, self.remote.root)
        refill_step(self.ck, self.remote, step, self._timeout())

    def levels(self) -> dict[str, Any]:
        last = self.drainer.last if self.drainer is not None else self.last
        found: dict[str, Any] = {"root": self.remote.root, "steps": self.remote.steps()}
        if last is not None:
            found["last_seconds"] = last.seconds
            found["last_error"] = None if last.error is None else str(last.error)
        return found
