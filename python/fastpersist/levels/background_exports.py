"""A Checkpointer's Hugging Face exports: committed steps copied out in another format, in the background.

``Checkpointer(..., export_hf_every=N, export_dir=D)`` hands every committed step that crossed a
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
    >>> ck = fp.Checkpointer("/tmp/fp-doc-hfbg", export_hf_every=1, export_dir="/tmp/fp-doc-hfbg-out")
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

from ..arguments import given_path
from ..errors import FastPersistError
from ..interop.hfexport import ExportResult, export_checkpoint

__all__ = ["STAGING_WAIT_MAX_S", "HfExports", "check_export_arguments", "hf_exports_for"]

log = logging.getLogger("fastpersist")

#: The longest an export waits at once for a staging save (a stuck save must not stop exports).
STAGING_WAIT_MAX_S = 60.0


def check_export_arguments(every: object, export_dir: object, key: object, prefix: object) -> None:
    """Refuses a Checkpointer's export settings that would be silently ignored (`key` or `prefix`
    without `every`) or export into the working directory, before the Checkpointer makes anything."""
    if (every is None) != (export_dir is None):
        raise ValueError(
            f"Checkpointer(export_hf_every={every!r}, export_dir={export_dir!r}): they go together, pass both "
            "(or neither)"
        )
    if every is None:
        for name, value, default in (("export_hf_key", key, None), ("export_hf_prefix", prefix, "")):
            if value != default:
                raise ValueError(
                    f"Checkpointer({name}={value!r}) applies to the Hugging Face export, but export_hf_every= is "
                    "None: pass export_hf_every= and export_dir= too"
                )
        return
    given_path(export_dir, "export_dir", "Checkpointer")


def hf_exports_for(
    ck: Any, every: int | None, export_dir: str | os.PathLike[str] | None, key: str | None, prefix: str
) -> HfExports | None:
    """The exports of the Checkpointer `ck` for its ``export_hf_*`` arguments (checked by
    :func:`check_export_arguments`), or None."""
    if every is None or export_dir is None:
        return None
    if ck.replicas:
        raise ValueError("export_hf_every= is not supported with replicas= yet")

    def staging() -> bool:
        future = ck._future
        return future is not None and not future.staged()

    return HfExports(ck.path, every, export_dir, key=key, prefix=prefix, staging=staging)


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
    ) -> None:
        if type(every) is not int or every < 1:
            raise ValueError(f"export_hf_every={every!r}: expected an integer >= 1")
        self.step_path = step_path
        self.every = every
        self.export_dir = os.path.abspath(os.fspath(export_dir))
        self.key, self.prefix = key, prefix
        self.staging = staging  # whether a save is staging now (the export pauses meanwhile)
        self.last: ExportResult | None = None
        self._last_submitted = -1
        self._cond = threading.Condition()
        self._pending: int | None = None
        self._exporting: int | None = None
        self._error: tuple[int, BaseException] | None = None  # the newest export's failure, unraised
        self._thread: threading.Thread | None = None

    def after_commit(self, step: int) -> None:
        """Hands `step` to the export thread if a multiple of `every` was crossed since the last."""
        if step // self.every <= self._last_submitted // self.every:
            return
        self._last_submitted = step
        with self._cond:
            self._pending = step
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fastpersist-hf-export", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def pinned(self) -> set[int]:
        """Steps waiting for or in the export: retention must leave them alone."""
        with self._cond:
            return {s for s in (self._pending, self._exporting) if s is not None}

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
