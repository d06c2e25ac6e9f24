"""The ranks' drain threads keeping in step (:mod:`fastpersist.levels.remote_drain`), over a control
group of their own (the training thread's saves and loads use another).

Every rank's drain thread takes part in the same exchanges, in the same order: it agrees on the
step to drain, then tells the others how each phase of that drain went (its own preparation, its
upload, rank 0's commit), and whether to retry. So a rank that cannot upload its share (a full
disk, a path it may not write, the store unreachable from its node) makes every rank fail that
attempt at once, each with the real error (the failing rank its own; the others an
:class:`OSError` with the same errno, naming that rank, or a :class:`DrainError`), instead of
rank 0 waiting ``timeout_s`` for a marker that never comes. A killed rank is noticed as its
connections close (:mod:`fastpersist.distributed.watch`); once an exchange fails, this drain
thread's peers are broken for good (:attr:`DrainPeers.broken`): every later drain fails at once
with that error and :meth:`~fastpersist.Checkpointer.close` raises it.
"""

from __future__ import annotations

import errno as errno_codes
from typing import Any

from ..distributed.control import ControlGroup, collective, describe
from ..errors import FastPersistError

__all__ = ["DrainError", "DrainPeers"]


class DrainError(FastPersistError):
    """Another rank failed a step of the drain to the remote level (the message names it), or
    the ranks' drain threads stopped answering each other."""


class DrainPeers:
    """This rank's drain thread's side of the exchanges with the other ranks' (see the module docstring)."""

    def __init__(self, control: ControlGroup, where: str) -> None:
        self.control = control
        self.where = where  # the remote, for messages
        #: The error that broke the exchanges (a peer gone, no answer within timeout_s), or None.
        self.broken: BaseException | None = None

    def _gather(self, what: str, obj: Any) -> list[Any]:
        if self.broken is not None:
            raise self.broken
        try:
            return collective(self.control, what, lambda: self.control.all_gather(obj), DrainError)
        except DrainError as e:
            self.broken = e
            raise

    def agree(self, step: int) -> int:
        """The step every rank's drain takes now: the newest any rank proposes."""
        return max(int(s) for s in self._gather(f"agree on the step to drain to {self.where}", step))

    def outcome(self, what: str, step: int, error: BaseException | None) -> None:
        """Raises on every rank if any rank failed `what` for `step`: on the failing rank its own
        error, on the others the first failure, as an OSError of the same errno where it has one."""
        mine = None if error is None else (describe(error), getattr(error, "errno", None))
        failed = [
            (rank, found)
            for rank, found in enumerate(self._gather(f"learn whether every rank could {what}", mine))
            if found is not None
        ]
        if error is not None:
            raise error
        if not failed:
            return
        rank, (message, code) = failed[0]
        text = f"rank {rank} could not {what} for step {step} of the drain to {self.where}: {message}"
        if type(code) is int and code in errno_codes.errorcode:
            raise OSError(code, text)
        raise DrainError(text)

    def any(self, flag: bool, what: str) -> bool:
        """Whether `flag` holds on any rank."""
        return any(self._gather(what, flag))

    def close(self) -> None:
        """Closes the control group (the drain thread has stopped)."""
        self.control.close()
