"""What checkpointing costs a running loop, measured by its ``Checkpointer``, and ``every="auto"``.

:class:`SaveHistory` is what a ``Checkpointer`` holds. It times what the loop waits for (inside
``ck.save`` and ``ck.wait_staged``), the training steps between saves (time between ``ck.save``
calls, less those waits, per step), each committed save's :class:`~fastpersist.SaveResult` and
each load; keeps the last :data:`WINDOW` of each; counts the bytes written per target directory
(:class:`~fastpersist.advisor.wear.WearLog`); and persists a summary to ``ROOT/history.json``
after each commit (no fsync: it is a statistic, losing the last update to a crash is harmless).

With ``every="auto"`` it also chooses ``every``: 1 at first, then every :data:`RETUNE_SAVES`
committed saves the model's :func:`~fastpersist.advisor.model.best_every` from the medians,
bounded to ``[1, max_every]`` and logged at INFO when it changes.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal

from ..errors import CorruptCheckpointError
from ..format.layout import HISTORY_NAME, read_small_file, write_small_file
from ..format.manifest import read_manifest
from ..futures import SaveResult
from .model import Costs, best_every
from .wear import WearLog

__all__ = ["SaveHistory", "read_history"]

log = logging.getLogger("fastpersist")

HISTORY_VERSION = 1
WINDOW = 64
RETUNE_SAVES = 4
DEFAULT_MAX_EVERY = 1000
#: Far above what a history of WINDOW samples takes; a larger file is no history of ours.
MAX_HISTORY_BYTES = 4 << 20


def _median(values: collections.deque[float]) -> float | None:
    return statistics.median(values) if values else None


class SaveHistory:
    """The measured costs of one ``Checkpointer``'s saves, its wear log, and its ``every`` policy.

    Args:
        root: the checkpoint root (``history.json`` goes there).
        every: an integer >= 1, or ``"auto"``.
        mtbf_s: the job's mean time between failures in seconds; required by ``"auto"``.
        max_every: the largest ``every`` that ``"auto"`` may choose.
        restart_overhead_s: seconds a restart costs besides loading the checkpoint (relaunch,
            initialisation); added to the measured load time for ``"auto"``.
        persist: write ``history.json`` after each commit (rank 0 of a group only).

    Example:
        >>> h = SaveHistory("/tmp/x", every="auto", mtbf_s=24 * 3600, persist=False)
        >>> h.every
        1
    """

    def __init__(
        self,
        root: str,
        *,
        every: int | Literal["auto"] = 1,
        mtbf_s: float | None = None,
        max_every: int = DEFAULT_MAX_EVERY,
        restart_overhead_s: float = 0.0,
        persist: bool = True,
    ) -> None:
        self.auto = every == "auto"
        if not self.auto and (type(every) is not int or every < 1):
            raise ValueError(f"every={every!r}: expected an integer >= 1 or 'auto'")
        if self.auto and not (isinstance(mtbf_s, (int, float)) and math.isfinite(mtbf_s) and mtbf_s > 0):
            raise ValueError(
                f'every="auto" needs mtbf_s=, the job\'s mean time between failures in seconds (got {mtbf_s!r}); '
                "e.g. mtbf_s=node_mtbf_s / nodes"
            )
        if type(max_every) is not int or max_every < 1:
            raise ValueError(f"max_every={max_every!r}: expected an integer >= 1")
        self.root = root
        self.every: int = 1 if self.auto else int(every)
        self.mtbf_s = float(mtbf_s) if mtbf_s is not None else None
        self.max_every = max_every
        self.restart_overhead_s = float(restart_overhead_s)
        self.persist = persist
        self._lock = threading.RLock()  # to_json() and costs() take it, also from inside committed()
        self.stall_s: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.commit_wait_s: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.step_s: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.write_s: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.staged_s: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.nbytes: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.load_s: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.wear = WearLog()
        self._loaded_file = False
        self._waited_s = 0.0  # loop time spent waiting since the current save started
        self._waits_total_s = 0.0  # all loop waits ever, to take them out of the step time
        self._last_call: tuple[float, int, float] | None = None  # (time, step, waits_total) at the last save()
        self._last_due: int | None = None
        self._saves_started = 0
        self._commits_since_tune = 0

    # -- the loop side -----------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Called at every ``ck.save(step, ...)``: measures the step time; True if `step` should be saved."""
        now = time.perf_counter()
        with self._lock:
            if self._last_call is not None and step > self._last_call[1]:
                then, last_step, waits_then = self._last_call
                compute = (now - then) - (self._waits_total_s - waits_then)
                self.step_s.append(max(compute, 0.0) / (step - last_step))
            self._last_call = (now, step, self._waits_total_s)
            if self.auto:
                self._retune()
                due = self._last_due is None or step - self._last_due >= self.every or step < self._last_due
            else:
                due = step % self.every == 0
            if due:
                self._last_due = step
            return due

    @contextlib.contextmanager
    def waiting(self, kind: Literal["commit", "start", "staged"]) -> Iterator[None]:
        """Times a wait of the loop: ``"commit"`` (for the previous save, inside ``ck.save``),
        ``"start"`` (the rest of ``ck.save``: on a clean exit a new save has started) or
        ``"staged"`` (``ck.wait_staged``)."""
        start = time.perf_counter()
        ok = False
        try:
            yield
            ok = True
        finally:
            seconds = time.perf_counter() - start
            with self._lock:
                self._waits_total_s += seconds
                if kind == "commit":
                    self.commit_wait_s.append(seconds)
                else:
                    self._waited_s += seconds
                if kind == "start" and ok:
                    # One save's stall: the previous save's staging waits plus this save's start.
                    # The first save has no staging wait before it, so it is not a sample.
                    if self._saves_started:
                        self.stall_s.append(self._waited_s)
                    self._saves_started += 1
                    self._waited_s = 0.0

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """Times a load (the restart cost)."""
        start = time.perf_counter()
        yield
        with self._lock:
            self.load_s.append(time.perf_counter() - start)

    # -- the commit side ---------------------------------------------------------------------

    def committed(
        self, result: SaveResult, *, stripes: Sequence[str | os.PathLike[str]] | None = None, group: bool = False
    ) -> None:
        """Records a committed save: its timings, and its bytes in the wear log.

        The bytes go to the root, or are split evenly over `stripes` as the plan does. In a
        `group`, ``result.nbytes`` is this rank's share, so the manifest's total is counted.
        """
        nbytes = result.nbytes
        if group:
            with contextlib.suppress(CorruptCheckpointError, OSError):
                nbytes = read_manifest(result.path).total_bytes
        targets = {self.root: nbytes} if not stripes else {os.fspath(s): nbytes // len(stripes) for s in stripes}
        now = time.time()
        with self._lock:
            self.write_s.append(result.seconds)
            self.staged_s.append(result.staged_seconds)
            self.nbytes.append(float(nbytes))
            self._commits_since_tune += 1
            if self.persist and not self._loaded_file:
                self._merge_file()
            for target, count in targets.items():
                self.wear.add(target, count, when_s=now)
            doc = self.to_json() if self.persist else None
        if doc is not None:
            self._write(doc)

    # -- the model ---------------------------------------------------------------------------

    def costs(self) -> Costs | None:
        """The medians of the window as model :class:`Costs`, or None before a step and a save were measured."""
        with self._lock:  # the commit thread appends while the loop or advise() reads
            stall, step = _median(self.stall_s), _median(self.step_s)
            write, nbytes = _median(self.write_s), _median(self.nbytes)
            load = _median(self.load_s) or 0.0
        if stall is None or step is None or write is None or step <= 0:
            return None
        return Costs(stall, write, step, load + self.restart_overhead_s, int(nbytes or 0))

    def _retune(self) -> None:
        """Re-chooses ``every`` (lock held) once RETUNE_SAVES more saves have committed."""
        if self._commits_since_tune < RETUNE_SAVES or self.mtbf_s is None:
            return
        costs = self.costs()
        if costs is None:
            return
        self._commits_since_tune = 0
        new = best_every(costs, self.mtbf_s, max_every=self.max_every)
        if new != self.every:
            log.info(
                "Checkpointer(every='auto'): every %d -> %d steps (stall %.3f s, write %.3f s, step %.3f s, "
                "restart %.1f s, MTBF %.0f s)",
                self.every,
                new,
                costs.stall_s,
                costs.write_s,
                costs.step_s,
                costs.restart_s,
                self.mtbf_s,
            )
            self.every = new

    # -- persistence -------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The summary written to ``history.json``."""

        def stat(values: collections.deque[float]) -> dict[str, Any] | None:
            return {"median": statistics.median(values), "samples": list(values)} if values else None

        with self._lock:
            return {
                "version": HISTORY_VERSION,
                "updated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "every": self.every,
                "auto": self.auto,
                "mtbf_s": self.mtbf_s,
                "restart_overhead_s": self.restart_overhead_s,
                "stall_s": stat(self.stall_s),
                "commit_wait_s": stat(self.commit_wait_s),
                "step_s": stat(self.step_s),
                "write_s": stat(self.write_s),
                "staged_s": stat(self.staged_s),
                "nbytes": stat(self.nbytes),
                "load_s": stat(self.load_s),
                "wear": self.wear.to_json(),
            }

    def _merge_file(self) -> None:
        """Continues the wear log and the load times of an earlier run on the same root (lock held)."""
        self._loaded_file = True
        doc = read_history(self.root)
        if doc is None:
            return
        try:
            earlier = WearLog.from_json(doc.get("wear"))
        except ValueError as e:
            log.warning("%s: ignoring an unreadable wear log: %s", os.path.join(self.root, HISTORY_NAME), e)
            return
        for target, buckets in earlier.targets.items():
            for hour, nbytes in buckets.items():
                self.wear.add(target, nbytes, when_s=float(hour))
        loads = (doc.get("load_s") or {}).get("samples") or []
        self.load_s.extendleft(float(x) for x in reversed(loads) if isinstance(x, (int, float)))

    def _write(self, doc: dict[str, Any]) -> None:
        path = os.path.join(self.root, HISTORY_NAME)
        try:
            write_small_file(path, (json.dumps(doc, indent=1) + "\n").encode(), durable=False)
        except OSError as e:  # a statistic: never fail a committed save over it
            log.warning("could not update %s: %s", path, e)


def read_history(root: str) -> dict[str, Any] | None:
    """``ROOT/history.json`` as a dict, or None if missing or unreadable (a warning says which)."""
    path = os.path.join(root, HISTORY_NAME)
    try:
        doc = json.loads(read_small_file(path, limit_bytes=MAX_HISTORY_BYTES))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("%s: unreadable, ignored: %s", path, e)
        return None
    if not isinstance(doc, dict) or doc.get("version") != HISTORY_VERSION:
        log.warning("%s: not a version-%d fastpersist history, ignored", path, HISTORY_VERSION)
        return None
    return doc
