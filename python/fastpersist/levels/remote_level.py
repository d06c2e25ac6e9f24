"""A :class:`~fastpersist.Checkpointer`'s remote level: when a step is due for the remote, which
remote step a restore may take and how long it waits for the store, what ``levels()`` says of it
(the drain: :mod:`fastpersist.levels.remote_drain`; the store: :mod:`fastpersist.levels.remote_steps`; which
run a remote step belongs to: :mod:`fastpersist.levels.run_identity`)."""

from __future__ import annotations

import collections
import logging
import os
import statistics
from dataclasses import dataclass
from typing import Any

from ..advisor.multilevel import Failures, LevelCosts, best_remote_every
from ..distributed.control import ControlGroup, control_for, group_rank_and_size
from ..errors import FastPersistError
from .host import LevelHost, RootLevel
from .remote_claims import claim_remote
from .remote_drain import Drainer, DrainResult
from .remote_drain_peers import DrainPeers
from .remote_refill import refill_step
from .remote_steps import RemoteSteps
from .run_identity import LocalIdentity, RemoteVerdict, judge_remote

__all__ = ["RemoteChoice", "RemoteLevel"]


@dataclass(frozen=True)
class RemoteChoice:
    """A remote step a restore takes: its step, and the run a root with no index of its own takes over."""

    step: int
    adopted_run: str | None = None


log = logging.getLogger("fastpersist")


class RemoteLevel:
    """The remote level of one Checkpointer (one per rank): a
    :class:`~fastpersist.levels.host.RestoringCopies`."""

    def __init__(
        self,
        host: LevelHost,
        target: str | os.PathLike[str],
        every: int | None,
        keep: int,
        bytes_per_s: float | None,
        failures: Failures | None = None,
    ) -> None:
        self.host = host
        self.claim = claim_remote(host, target)  # refuses a remote that overlaps a root (ValueError)
        self.remote = RemoteSteps(target)
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
        self._peers: DrainPeers | None = None
        if host.group is not None:  # collective: every rank makes its Checkpointer
            self._peers = DrainPeers(ControlGroup(host.group, host.timeout_s), self.remote.root)
        self._verified: dict[int, tuple[Any, ...]] = {}
        self._unreachable_warned = False

    def before_save(self) -> None:
        """Holds the claim on the store again: given up at close(), another root may have taken it since."""
        self.claim.hold()

    def after_commit(self, step: int) -> None:
        """Hands `step` to the drain if a multiple of `every` was crossed since the last one."""
        if self.every is not None and step // self.every <= self.last_submitted // self.every:
            return
        self.last_submitted = step
        if self.drainer is None:
            size = group_rank_and_size(self.host.group)[1] if self.host.group is not None else 1
            self.drainer = Drainer(
                self.remote,
                self.host.path,
                rank=self.host.rank,
                size=size,
                keep=self.keep,
                timeout_s=self.host.timeout_s,
                bytes_per_s=self.bytes_per_s,
                staging=self._staging,
                writing=self._writing,
                peers=self._peers,
                run=lambda: self.host.run,
                on_drained=self._advise if self.failures is not None else None,
            )
            self.claim.hold()
        self.drainer.submit(step)

    def costs(self) -> LevelCosts | None:
        """The Checkpointer's measured costs with this level's drains (medians), for the advisor;
        None until a save and a drain were measured. A drain's cost to training is taken as the
        CPU time of its thread; a restart from the remote as one drain's time plus the local
        restart."""
        local = self.host.history.costs()
        if local is None or not self._drain_s:
            return None
        last = self.host.last_result
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
        new = best_remote_every(self.host.replicas, self.host.every, costs, self.failures)
        if new != self.every:
            log.info(
                "remote level %s: remote_every %s -> %d steps (drain %.2f s, drain CPU %.2f s, step %.3f s, every %d)",
                self.remote.root,
                self.every,
                new,
                costs.drain_s,
                costs.drain_overhead_s,
                costs.step_s,
                self.host.every,
            )
        self.advised_costs, self.every = costs, new

    def pinned(self) -> set[int]:
        """Local steps the drain still reads (kept by retention until it is done)."""
        return self.drainer.pinned() if self.drainer is not None else set()

    def _staging(self) -> bool:
        future = self.host.in_flight.newest()
        return future is not None and not future.staged()

    def _writing(self) -> bool:
        future = self.host.in_flight.newest()
        return future is not None and future.staged() and not future.done()

    def close(self) -> None:
        """Waits for the drain (its thread stops; a later save starts another); raises its failure."""
        drainer, self.drainer = self.drainer, None
        self.claim.release()
        if drainer is not None:
            try:
                drainer.close()
            finally:
                self.last = drainer.last

    def _verifies(self, step: int, checkpoint_id: str | None) -> bool:
        path = self.remote.path(step)
        try:
            found = self.remote.committed_id(step, self.remote.probe)
            if checkpoint_id is not None and found != checkpoint_id:
                log.warning("the remote step %s is no longer the checkpoint its index names, skipping it", path)
                return False
            if self._verified.get(step) == (found,):
                return True
            self.remote.verify(step)
        except (FastPersistError, OSError) as e:
            log.warning("the remote copy %s fails verification, skipping it: %s", path, e)
            return False
        self._verified[step] = (found,)
        return True

    def _choose_here(self, local: LocalIdentity, above: int | None) -> RemoteChoice | None:
        """Rank 0 (or the one process): the newest remote step the run identity rule allows
        (:mod:`fastpersist.levels.run_identity`) above `above` that verifies; a store that does not
        answer within the probe's bound is logged once at WARNING and counts as holding nothing."""
        try:
            index = self.remote.index(self.remote.probe)
            committed = self.remote.steps(self.remote.probe) if index is not None else []
        except Exception as e:  # any failure of the store (obstore raises its own classes)
            if not self._unreachable_warned:
                log.warning(
                    "the remote level %s did not answer (%s: %s); restoring from the local level only",
                    self.remote.root,
                    type(e).__name__,
                    str(e).splitlines()[0][:300] if str(e) else "",
                )
                self._unreachable_warned = True
            return None
        try:
            return self._take(judge_remote(local, index, committed, above), local, above)
        except Exception as e:  # the store stopped answering after the listing
            log.warning("the remote level %s failed during a restore's look at it: %s", self.remote.root, e)
            return None

    def _take(self, verdict: RemoteVerdict, local: LocalIdentity, above: int | None) -> RemoteChoice | None:
        """Logs what the rule passed over; the newest allowed step that verifies, or None."""
        committed = verdict.committed
        if verdict.foreign_run is not None:
            log.warning(
                "the remote level %s holds another run's steps %s (run %s; this root's run is %s): they are never "
                "restored by this run. To restore one anyway, pass its step: ck.load(step=N)",
                self.remote.root,
                committed[-10:],
                verdict.foreign_run,
                ", ".join(sorted(local.runs)),
            )
        if verdict.above_cap and (above is None or max(verdict.above_cap) > above):
            log.warning(
                "the remote level %s holds steps %s above step %d, the newest this root's index names (another "
                "run's, or steps a rollback abandoned): they are not restored",
                self.remote.root,
                verdict.above_cap[:10],
                local.cap,
            )
        for step, checkpoint_id in verdict.candidates:
            if self._verifies(step, checkpoint_id):
                if verdict.adopted_run is not None:
                    log.warning(
                        "no node holds an index under %s: restoring step %d of run %s from the remote level %s (if "
                        "this is a new run on a prefix another run used, give it a new remote prefix)",
                        self.host.root,
                        step,
                        verdict.adopted_run,
                        self.remote.root,
                    )
                return RemoteChoice(step, verdict.adopted_run)
        return None

    def choose(self, local: LocalIdentity, above: int | None = None) -> RemoteChoice | None:
        """The remote step to restore, if any, newer than `above` (the local level's newest: an
        older remote step is not worth reading); in a group rank 0 looks and the others follow.
        It never waits for the drain: a restore from the local level does not wait for a slower
        level's copy."""
        found = None
        if self.host.rank == 0 or self.host.group is None:
            found = self._choose_here(local, above)
        if self.host.group is not None:
            found = control_for(self.host.group, self.host.timeout_s).broadcast(found)
        return found

    def holds(self, step: int) -> bool:
        """Whether `step` is committed on the remote (rank 0 looks, within the probe's bound;
        the others follow)."""
        there = False
        if self.host.rank == 0 or self.host.group is None:
            try:
                there = self.remote.committed_id(step, self.remote.probe) is not None
            except Exception as e:
                log.warning("the remote level %s did not answer: %s", self.remote.root, e)
        if self.host.group is not None:
            there = control_for(self.host.group, self.host.timeout_s).broadcast(there)
        return there

    def refill(self, step: int, root: RootLevel) -> None:
        """Downloads `step` from the remote into the root level (every rank its shares), so it
        loads as a local step (:mod:`fastpersist.levels.remote_refill`)."""
        log.info("rank %d refills step %d from the remote level %s", self.host.rank, step, self.remote.root)
        refill_step(self.host, root, self.remote, step)

    def levels(self) -> dict[str, Any]:
        last = self.drainer.last if self.drainer is not None else self.last
        found: dict[str, Any] = {"root": self.remote.root, "steps": self.remote.steps()}
        if last is not None:
            found["last_seconds"] = last.seconds
            found["last_error"] = None if last.error is None else str(last.error)
        return {"remote": found}
