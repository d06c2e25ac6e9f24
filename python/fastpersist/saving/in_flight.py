"""A Checkpointer's saves in flight: at most one writing, and one snapshot waiting for the disk.

``Checkpointer(every=1)`` on a GPU must cost training one device-to-host copy per step, not a
disk write. When a step is due while the previous save is still writing, the Checkpointer stages
the new step at once into an arena (one copy; ``wait_staged()`` returns when it has landed) and
holds its writes back behind a write gate (``_core.WriteGate``); the gate opens when the writing
save ends, whatever its outcome. A newer step due while a snapshot still waits replaces it: the
waiting save is cancelled, commits nothing, and that step is simply not on the local level. So
the disk always writes the newest snapshot it can, and ``Checkpointer.levels()`` says which
steps it holds.

A group's saves commit together, so a snapshot held back on one rank would hold back all of
them, and which steps wait or are replaced would differ between ranks with their timing. So in a
group (:meth:`InFlight.skip_in_group`) the ranks agree at every due step, in one small
collective, whether any rank's previous save still writes; if so and the state is on a device on
every rank, the step is skipped on every rank (nothing staged, nothing to wait for), and the
disk takes the first due step after it is free.

Example:
    >>> queue = InFlight()
    >>> queue.disk_busy(), queue.newest()
    (False, None)
"""

from __future__ import annotations

import logging
import threading
import time

import fastpersist._core as _core

from ..distributed.control import collective, control_for
from ..errors import GroupSaveError
from ..futures import SaveFuture, SaveResult

log = logging.getLogger("fastpersist")

__all__ = ["InFlight"]


class InFlight:
    """The saves of one Checkpointer that have not ended (see the module docs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.writing: SaveFuture | None = None
        self.waiting: tuple[SaveFuture, _core.WriteGate] | None = None
        #: Snapshots replaced while they waited, until their cancelled jobs have cleaned up.
        self.replaced: list[SaveFuture] = []

    def disk_busy(self) -> bool:
        """Whether a save is writing now (a new step would wait behind it)."""
        with self._lock:
            return self.writing is not None and not self.writing.done()

    def skip_in_group(self, group: object, timeout_s: float, *, from_device: bool, step: int) -> bool:
        """Whether every rank of `group` skips due `step`: some rank's previous save still writes
        and every rank's state is on a device. One collective on a lane of its own (the writing
        save's commit runs collectives on the group's main lane meanwhile); every rank calls this
        at the same due steps."""
        lane = control_for(group, timeout_s, lane="steps")
        busy, host = collective(
            lane,
            f"agree whether step {step} is saved",
            lambda: lane.max_of([int(self.disk_busy()), int(not from_device)]),
            GroupSaveError,
            ". This step was not saved.",
        )
        return busy == 1 and host == 0

    def newest(self) -> SaveFuture | None:
        """The save started last (waiting or writing), or None."""
        with self._lock:
            return self.waiting[0] if self.waiting is not None else self.writing

    def all(self) -> list[SaveFuture]:
        """Every save in flight, oldest first."""
        with self._lock:
            found = [self.writing] if self.writing is not None else []
            if self.waiting is not None:
                found.append(self.waiting[0])
        return found

    def started(self, future: SaveFuture, gate: _core.WriteGate | None = None) -> None:
        """Records a save just started: writing (no `gate`), or a snapshot waiting behind the
        writing save, replacing (cancelling) the snapshot that waited before it."""
        with self._lock:
            if gate is None:
                self.writing, self.waiting = future, None
                return
            replaced, self.waiting = self.waiting, (future, gate)
            writing = self.writing
            self.replaced = [f for f in self.replaced if not f.done()]
            if replaced is not None:
                self.replaced.append(replaced[0])
        if replaced is not None:
            replaced[0].cancel()  # never written: a newer snapshot takes its place
        if writing is None:
            self._promote(future, gate)
        else:
            writing.add_done_callback(lambda _: self._promote(future, gate))  # at once if done already

    def _promote(self, future: SaveFuture, gate: _core.WriteGate) -> None:
        """The disk is free: the waiting snapshot (if it is still `future`) starts writing."""
        with self._lock:
            if self.waiting is None or self.waiting[0] is not future:
                return  # replaced meanwhile: cancelled, never written
            self.writing, self.waiting = future, None
        gate.open()

    def raise_unseen(self) -> None:
        """Raises the error of a save that failed and whose error nobody has seen yet (the
        step after it is then not saved, as when the Checkpointer waits for each save)."""
        for future in self.all():
            if future.done() and not future.error_seen:
                error = future.exception(0)
                if error is not None:
                    self.forget(future)
                    raise error

    def finish_all(self) -> None:
        """Waits for every save in flight, and for the replaced snapshots to have removed their
        temporary directories; raises the first error nobody has seen yet."""
        with self._lock:
            replaced, self.replaced = self.replaced, []
        for future in replaced:
            future.exception()  # cancelled on purpose: its outcome is nobody's error
        for future in self.all():
            seen = future.error_seen
            try:
                future.wait()
            except BaseException as e:
                if not seen:
                    raise
                log.info("not raising again the failure of %s, already raised to the caller: %s", future.path, e)
            finally:
                self.forget(future)

    def wait_staged(self, timeout: float | None = None) -> None:
        """Waits until the newest save no longer reads the state's tensors."""
        newest = self.newest()
        if newest is not None:
            newest.wait_staged(timeout)

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Waits until every save in flight has committed; returns the newest one's result."""
        deadline = None if timeout is None else time.monotonic() + timeout
        result = None
        for future in self.all():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                result = future.wait(left)
            finally:
                if future.done():
                    self.forget(future)
        return result

    def forget(self, future: SaveFuture) -> None:
        """Drops `future` once it has ended and its outcome was taken."""
        with self._lock:
            if self.writing is future:
                self.writing = None
            if self.waiting is not None and self.waiting[0] is future:
                self.waiting = None
