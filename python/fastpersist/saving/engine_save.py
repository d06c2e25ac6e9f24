"""`EngineSave`: what every save whose sources an engine write reads has in common, written once.

A :class:`~fastpersist.saving.job.SaveJob` (a checkpoint directory) and ``torch_save_async``'s
:class:`~fastpersist.interop.torchasync.ArchiveSaveJob` (one torch.save file) each hand their
sources to an engine write (a ``_core.WriteHandle``) and keep a :class:`Verdict`. Whether the
sources are staged, waiting until they are, cancelling, and stopping the engine for a save that
will not commit are the same for both, and so is the moment the job lets go of the caller's
tensors: once the engine no longer reads them.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..errors import SaveCancelledError
from .verdict import Verdict

__all__ = ["EngineSave"]


class EngineSave:
    """The staged, wait and cancel part of a save written by the engine (see the module docstring).

    A subclass sets `path`, `verdict` and `handle` (None until the engine started, or for a
    save with nothing to write), and says in :meth:`drop_sources` which references to the
    caller's tensors it lets go of."""

    path: str
    verdict: Verdict
    handle: Any
    #: What a cancelled save left, for its message.
    cancelled_leaves = "nothing was committed"

    def drop_sources(self) -> None:
        """Lets go of the caller's tensors (the engine no longer reads them)."""

    def drop_sources_if_staged(self) -> None:
        if self.handle is None or self.handle.staged():
            self.drop_sources()

    def staged(self) -> bool:
        """Whether the engine no longer reads the sources (never blocks)."""
        return self.handle is None or bool(self.handle.staged())

    def wait_staged(self, timeout: float | None = None) -> None:
        """Returns when the sources may be modified; raises if the save was cancelled (a source
        changed before it was staged, or someone cancelled it)."""
        if self.handle is not None:
            self.handle.wait_staged(timeout)
        self.drop_sources_if_staged()
        if isinstance(self.verdict.error, SaveCancelledError):
            raise self.verdict.error

    def cancel(self) -> bool:
        """Stops the save unless it already committed or failed; returns whether it did."""
        if not self.verdict.cancel(
            SaveCancelledError(f"the save of {self.path} was cancelled; {self.cancelled_leaves}")
        ):
            return False
        if self.handle is not None:
            self.handle.cancel()
        return True

    def stop_engine(self) -> None:
        """Stops the engine's write and waits for it (its error, if any, is the verdict already)."""
        handle = self.handle
        if handle is not None and not handle.done():
            handle.cancel()
            with contextlib.suppress(Exception):
                handle.wait()
