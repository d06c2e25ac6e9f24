"""The background drain of committed steps to the remote level (:mod:`fastpersist.levels.remote_steps`).

One thread per Checkpointer (per rank). :meth:`Drainer.submit` hands it a committed step that
is due; at most one drain runs at a time, and a newer due step replaces one still waiting (the
remote needs the newest, not every one). A drain copies this rank's share from the committed
local copy (never from the training tensors), throttled to ``bytes_per_s``, pausing while a
save is staging (the part of a save that training waits for) and yielding to a save that is
writing: after each piece it then waits as long as the piece took, so it takes at most half of
the drive and the cores from a running save and all of them between saves. First rank 0 clears
the step number if another checkpoint holds it on the remote (a step a rollback abandoned,
another run's: WARNING); then every rank uploads its share; then rank 0 commits the remote step
and retires old ones. In a group the ranks' drain threads tell each other how each phase went
(:mod:`fastpersist.levels.remote_drain_peers`), so every rank knows the outcome at once, and a rank's
failure is every rank's, with its real error. A failed drain is logged at WARNING and retried
with backoff (a newer step supersedes it, on every rank alike); :meth:`close` waits for the
drain in flight and raises if the newest submitted step could not be drained.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..format.manifest import read_manifest
from .remote_drain_peers import DrainPeers
from .remote_steps import RemoteSteps

__all__ = ["DrainResult", "Drainer"]

log = logging.getLogger("fastpersist")

#: Attempts per step before it is given up, and the first backoff (doubled each time).
ATTEMPTS = 4
BACKOFF_S = 0.5
#: The longest a drain waits after one piece while a save is writing (a piece on a stalled remote
#: can take long; the wait is only there to share the drive).
YIELD_MAX_S = 1.0


@dataclass
class DrainResult:
    """The outcome of one step's drain on this rank."""

    step: int
    nbytes: int = 0
    seconds: float = 0.0
    error: BaseException | None = None
    #: CPU seconds the drain's thread used: what it takes from the training process's cores.
    cpu_s: float = 0.0


class Drainer:
    """Drains committed steps to `remote` in the background (see the module docstring)."""

    def __init__(
        self,
        remote: RemoteSteps,
        local_path: Callable[[int], str],
        *,
        rank: int,
        size: int,
        keep: int,
        timeout_s: float,
        bytes_per_s: float | None = None,
        staging: Callable[[], bool] = lambda: False,
        writing: Callable[[], bool] = lambda: False,
        peers: DrainPeers | None = None,
        run: Callable[[], str | None] = lambda: None,
        on_drained: Callable[[DrainResult], None] | None = None,
    ) -> None:
        self.remote, self.local_path = remote, local_path
        self.rank, self.size, self.keep, self.timeout_s = rank, size, keep, timeout_s
        self.bytes_per_s = bytes_per_s
        self.staging = staging  # whether a save is staging now (the drain pauses meanwhile)
        self.writing = writing  # whether a save is writing now (the drain yields half its time)
        #: In a group: the other ranks' drain threads. They agree on the step they all drain (the
        #: newest proposed: each rank replaced waiting steps on its own timing, but a step one
        #: rank committed, every rank committed) and share each phase's outcome.
        self.peers = peers
        self.run = run  # the Checkpointer's run id, recorded in the remote index
        self.on_drained = on_drained  # called on the drain's thread after each step it drained
        self._cond = threading.Condition()
        self._pending: int | None = None
        self._busy = False
        self._draining: int | None = None
        self._closed = False
        self.last: DrainResult | None = None
        self._thread = threading.Thread(target=self._run, name="fastpersist-drain", daemon=True)
        self._thread.start()

    def submit(self, step: int) -> None:
        """Drains `step` (committed locally) when the drain in flight is done."""
        with self._cond:
            self._pending = step
            self._cond.notify_all()

    def pinned(self) -> set[int]:
        """The steps waiting for or in the drain: local retention must leave them alone."""
        with self._cond:
            return {s for s in (self._pending, self._draining) if s is not None}

    def _throttle(self, started: float, done: list[int]) -> Callable[[int], None]:
        piece_started = [started]

        def throttle(n: int) -> None:
            done[0] += n
            paused = time.monotonic()
            piece_s = paused - piece_started[0]
            while self.staging() and time.monotonic() - paused < self.timeout_s:
                time.sleep(0.005)
            if self.writing():
                time.sleep(min(piece_s, YIELD_MAX_S))
            if self.bytes_per_s:
                ahead = done[0] / self.bytes_per_s - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
            piece_started[0] = time.monotonic()

        return throttle

    def _outcome(self, what: str, step: int, error: BaseException | None) -> None:
        if self.peers is not None:
            self.peers.outcome(what, step, error)
        elif error is not None:
            raise error

    def drain(self, step: int) -> DrainResult:
        """Drains one step now (on the calling thread; in a group every rank's drain thread at
        once); raises on failure, on every rank alike."""
        started, cpu_started = time.monotonic(), time.thread_time()
        local = self.local_path(step)
        error: BaseException | None = None
        try:
            m = read_manifest(local)
            if self.rank == 0:
                replaced = self.remote.clear_for(step, m.checkpoint_id)
                if replaced is not None:
                    log.warning(
                        "%s held another checkpoint (id %s: a step a rollback abandoned, or another run's); it is "
                        "removed, and step %d of this run takes its place",
                        self.remote.path(step),
                        replaced[:12],
                        step,
                    )
        except Exception as e:
            error = e
        self._outcome("prepare the drain", step, error)
        nbytes = 0
        try:
            done = [0]
            nbytes = self.remote.drain_share(step, local, m, self.rank, self._throttle(started, done))
        except Exception as e:
            error = e
        self._outcome("upload its share", step, error)
        if self.rank == 0:
            try:
                kept = self.remote.commit(step, local, m, self.timeout_s, run=self.run(), keep=self.keep)
                gone = self.remote.retire(step, kept)
                log.info(
                    "step %d is on the remote level %s (%d bytes from rank 0); retired %s",
                    step,
                    self.remote.root,
                    nbytes,
                    gone,
                )
            except Exception as e:
                error = e
        self._outcome("commit the step", step, error)
        return DrainResult(step, nbytes, time.monotonic() - started, cpu_s=time.thread_time() - cpu_started)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                step, self._pending, self._busy = self._pending, None, True
                self._draining = step
            try:
                step = self.peers.agree(step) if self.peers is not None else step
            except Exception as e:  # the group stopped answering: this drain is lost (and the next)
                log.warning("the ranks could not agree on the step to drain to %s: %s", self.remote.root, e)
                self.last = DrainResult(step, error=e)
            else:
                with self._cond:
                    self._draining = step
                    if self._pending is not None and self._pending <= step:
                        self._pending = None
                self.last = self._attempts(step)
                if self.last.error is None and self.on_drained is not None:
                    try:
                        self.on_drained(self.last)
                    except Exception as e:  # advice is optional: the drains go on without it
                        log.warning("after the drain of step %d to %s: %s", step, self.remote.root, e)
            with self._cond:
                self._busy = False
                self._draining = None
                self._cond.notify_all()

    def _superseded(self) -> bool:
        """Whether a newer step is waiting (in a group: on any rank, so that all give up alike)."""
        with self._cond:
            newer = self._pending is not None
        if self.peers is None:
            return newer
        return self.peers.any(newer, "learn whether a newer step supersedes a failed drain")

    def _attempts(self, step: int) -> DrainResult:
        backoff = BACKOFF_S
        for attempt in range(1, ATTEMPTS + 1):
            try:
                return self.drain(step)
            except Exception as e:
                log.warning(
                    "drain of step %d to %s failed (attempt %d of %d): %s", step, self.remote.root, attempt, ATTEMPTS, e
                )
                failure = DrainResult(step, error=e)
                if self.peers is not None and self.peers.broken is not None:
                    return failure  # the ranks no longer answer each other: no retry can commit
                try:
                    if attempt == ATTEMPTS or self._superseded():
                        return failure
                except Exception as broken:
                    log.warning("the ranks' drains of %s stopped answering each other: %s", self.remote.root, broken)
                    return failure
                with self._cond:
                    self._cond.wait(backoff)
                backoff *= 2
        return failure

    def wait(self, timeout: float | None = None) -> DrainResult | None:
        """Waits until nothing is pending or in flight; returns the last drain's result."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"the drain to {self.remote.root} is still running after {timeout} s")
                self._cond.wait(left)
        return self.last

    def close(self) -> None:
        """Waits for the pending drains and stops the thread; raises the newest step's failure if
        it could not be drained."""
        last = self.wait()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(5)
        if last is not None and last.error is not None:
            raise last.error
        if self.peers is not None and self.peers.broken is not None:
            raise self.peers.broken
