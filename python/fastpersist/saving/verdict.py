"""`Verdict`: the one outcome of a save, decided once, seen the same by everyone.

A save can fail from several places at once: the staging check (a tensor changed before its
bytes were copied), the caller's ``cancel()``, an I/O error in the commit thread, another rank
of a group. Whoever fails it first decides the outcome; every later observer (``wait_staged``,
``wait``, the commit thread, a ``Checkpointer``) gets that same error, and the commit, which
runs under the same lock, refuses to rename anything into place once it is decided.

Example:
    >>> v = Verdict()
    >>> first = v.fail(ValueError("first"))
    >>> v.fail(ValueError("second")) is first
    True
    >>> v.commit(lambda: None)
    Traceback (most recent call last):
    ...
    ValueError: first
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Verdict"]


class Verdict:
    """Open until a save fails or commits; then final."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._sealed = False
        self._committed = False

    @property
    def error(self) -> BaseException | None:
        """The error that decided the save, if it failed."""
        return self._error

    @property
    def committed(self) -> bool:
        """True once the checkpoint is in place."""
        return self._committed

    def fail(self, error: BaseException) -> BaseException | None:
        """Fails the save with `error` unless it is already decided.

        Returns the error that stands (an earlier one wins), or None if the save committed.
        """
        with self._lock:
            if self._committed:
                return None
            if self._error is None:
                self._error = error
            return self._error

    def cancel(self, error: BaseException) -> bool:
        """Fails the save with `error` only while it is still open (not sealed, failed or
        committed). Returns whether it did."""
        with self._lock:
            if self._committed or self._sealed or self._error is not None:
                return False
            self._error = error
            return True

    def seal(self) -> None:
        """Closes the save to :meth:`cancel` (a rank that reported success to its group).

        Raises the standing error if it already failed."""
        with self._lock:
            if self._error is not None:
                raise self._error
            self._sealed = True

    def commit(self, put_in_place: Callable[[], None]) -> None:
        """Runs `put_in_place` (the atomic rename) unless the save failed, and records the commit.

        Raises the standing error instead if the save already failed. Holding the lock across
        the rename means no failure can slip in between the check and the rename.
        """
        with self._lock:
            if self._error is not None:
                raise self._error
            put_in_place()
            self._committed = True

    def mark_committed(self) -> None:
        """Records a commit done elsewhere (by rank 0 of a group)."""
        with self._lock:
            self._committed = True
