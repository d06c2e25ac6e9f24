"""A Checkpointer's Hugging Face exports: committed steps copied out in another format, in the background.

``Checkpointer(..., levels=[HFExport(D, every=N)])`` hands every committed step that crossed a
multiple of N since the last export (the first committed step too) to one thread of its own,
which runs :func:`~fastpersist.interop.hfexport.export_checkpoint` from the committed checkpoint on
disk into D (never from the training tensors, so the loop is never blocked; one export at a
time, and a newer due step replaces one still waiting). It pauses between tensors while a save
is staging (what ``wait_staged`` waits for), up to :data:`STAGING_WAIT_MAX_S` at a time. Retention keeps the step being
exported. A failed export is logged at WARNING; :meth:`HfExports.close` (``ck.close()``) waits
for the export in flight and raises if the newest one failed, as the remote drain does.

With a group, rank 0 exports (reading every shard of a sharded checkpoint: the root must be
on a filesystem rank 0 sees whole); the other ranks do nothing.

Example:
    >>> import fastpersist as fp, torch
    >>> ck = fp.Checkpointer("/tmp/fp-doc-hfbg", levels=[fp.HFExport("/tmp/fp-doc-hfbg-out", every=1)])
    >>> _ = ck.save(1, {"w": torch.ones(2)}); ck.close()
    >>> import os; os.listdir("/tmp/fp-doc-hfbg-out")
    ['model.safetensors']
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import FastPersistError
from ..interop.hfexport import ExportResult, export_checkpoint
from .host import LevelHost

__all__ = ["STAGING_WAIT_MAX_S", "HfExports", "hf_exports_for"]

log = logging.getLogger("fastpersist")

#: The longest an export waits at once for a staging save (a stuck save must not stop exports).
STAGING_WAIT_MAX_S = 60.0


def hf_exports_for(
    host: LevelHost, every: int, export_dir: str | os.PathLike[str], key: str | None, prefix: str
) -> HfExports:
    """The exports of the Checkpointer `host` (its :class:`~fastpersist.HFExport` level, which
    checked the settings); in a group, only rank 0's export anything."""

    def staging() -> bool:
        future = host.in_flight.newest()
        return future is not None and not future.staged()

    return HfExports(host.path, every, export_dir, key=key, prefix=prefix, staging=staging, exporting=host.rank == 0)


class HfExports:
    """The background exports of one Checkpointer (see the module docstring)."""

    def __init__(
        self,
        step_path: Callable[[int], str],
        every: int,
        export_dir: str | os.PathLike[str],
        *,
        key: str | None = None,
        prefix: str = "",
        staging: Callable[[], bool] = lambda: False,
        exporting: bool = True,
    ) -> None:
        if type(every) is not int or every < 1:
            raise ValueError(f"HFExport(every={every!r}): expected an integer >= 1")
        self.step_path = step_path
        self.every = every
        self.export_dir = os.path.abspath(os.fspath(export_dir))
        self.key, self.prefix = key, prefix
        self.staging = staging  # whether a save is staging now (the export pauses meanwhile)
        self.exporting = exporting  # False: a group's rank other than 0, which exports nothing
        self.last: ExportResult | None = None
        self._last_submitted = -1
        self._cond = threading.Condition()
        self._pending: int | None = None
        self._exporting: int | None = None
        self._error: tuple[int, BaseException] | None = None  # the newest export's failure, unraised
        self._thread: threading.Thread | None = None

    def after_commit(self, step: int) -> None:
        """Hands `step` to the export thread if a multiple of `every` was crossed since the last."""
        if not self.exporting:
            return
        if step // self.every <= self._last_submitted // self.every:
            return
        self._last_submitted = step
        with self._cond:
            self._pending = step
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fastpersist-hf-export", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def before_save(self) -> None:
        """Nothing: an export reads committed steps only."""

    def pinned(self) -> set[int]:
        """Steps waiting for or in the export: retention must leave them alone."""
        with self._cond:
            return {s for s in (self._pending, self._exporting) if s is not None}

    def levels(self) -> dict[str, Any]:
        """Nothing: an export is not a level a restore reads (``Checkpointer.levels()`` leaves it out)."""
        return {}

    def pause(self) -> None:
        """Waits while a save is staging, at most :data:`STAGING_WAIT_MAX_S`."""
        started = time.monotonic()
        while self.staging() and time.monotonic() - started < STAGING_WAIT_MAX_S:
            time.sleep(0.005)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._pending is None:
                    self._thread = None  # the next after_commit starts another
                    self._cond.notify_all()
                    return
                step, self._pending = self._pending, None
                self._exporting = step
            try:
                result = export_checkpoint(
                    self.step_path(step),
                    self.export_dir,
                    key=self.key,
                    prefix=self.prefix,
                    pause=self.pause,
                )
            except Exception as e:
                log.warning("the Hugging Face export of step %d to %s failed: %s", step, self.export_dir, e)
                with self._cond:
                    self._error = (step, e)
            else:
                with self._cond:
                    self.last, self._error = result, None
            finally:
                with self._cond:
                    self._exporting = None

    def close(self) -> None:
        """Waits for the exports handed over; raises if the newest one failed (once)."""
        with self._cond:
            while self._thread is not None:
                self._cond.wait()
            error, self._error = self._error, None
        if error is not None:
            step, e = error
            raise FastPersistError(f"the Hugging Face export of step {step} to {self.export_dir} failed: {e}") from e
