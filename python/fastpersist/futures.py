"""`SaveFuture`: the handle `save_async` returns, a real `concurrent.futures.Future`; and
`SaveResult`, what it holds once the save committed."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from .arguments import given_timeout

__all__ = ["SaveFuture", "SaveJobLike", "SaveResult"]

log = logging.getLogger("fastpersist")


@dataclass(frozen=True)
class SaveResult:
    """What a committed save did.

    Attributes:
        path: the checkpoint directory.
        nbytes: bytes of tensor data written (the logical stream, this rank's share in a group).
        seconds: wall time from the call until the checkpoint was committed.
        staged_seconds: time until the sources could be modified again.
        gb_per_s: ``nbytes / seconds / 1e9``.
        backend: ``"io_uring"`` or ``"threads"``.
        files: the data files written by this process.
        phases: where the time went, in seconds: ``flatten_plan`` (walk the state, lay out
            the stream), ``staging`` (from the engine's start until the save was staged:
            copy and crc32c, paced by the pool), ``write_fsync`` (from the engine's start until
            every data file was written and fsynced; overlaps ``staging``), ``commit``
            (manifest, fsync, atomic rename, directory fsync; in a group also the exchange).
    """

    path: str
    nbytes: int
    seconds: float
    staged_seconds: float
    gb_per_s: float
    backend: str
    files: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)


class SaveJobLike(Protocol):
    """What a :class:`SaveFuture` drives: one process's save, alone or as a rank of a group."""

    @property
    def path(self) -> str: ...

    def wait_staged(self, timeout: float | None = None) -> None: ...

    def staged(self) -> bool: ...

    def finish(self, timeout: float | None = None) -> SaveResult: ...

    def cancel(self) -> bool: ...


class SaveFuture(concurrent.futures.Future[SaveResult]):
    """A save running in the background.

    Two moments matter: :meth:`wait_staged` returns once the state's tensors may be modified
    again (call it before ``optimizer.step()``); :meth:`wait` returns once the checkpoint is
    durable and committed. A commit thread finishes the save even if nobody waits, and the
    interpreter waits for it at exit, so a started save either commits whole or not at all.

    It is a ``concurrent.futures.Future``: ``concurrent.futures.wait``, ``as_completed``,
    ``result``, ``exception``, ``add_done_callback``, ``running`` and ``cancelled`` behave as
    usual. A save has one verdict: once it failed for anyone (``wait_staged`` raised, or
    ``cancel()`` returned True), it never commits and ``wait()`` raises that same error. A failure
    that nobody observed is logged at ERROR on the ``fastpersist`` logger when the future is
    dropped.

    Example:
        >>> fut = fp.save_async(state, "ckpt/step-10")      # doctest: +SKIP
        >>> loss.backward()                                  # doctest: +SKIP
        >>> fut.wait_staged(); optimizer.step()              # doctest: +SKIP
        >>> fut.wait().gb_per_s                              # doctest: +SKIP
    """

    def __init__(self, job: SaveJobLike, on_commit: Callable[[SaveResult], object] | None = None) -> None:
        super().__init__()
        self._job = job
        self._on_commit = on_commit
        self._error_seen = False
        self._cancelled_by_caller = False
        self.set_running_or_notify_cancel()
        self._thread = threading.Thread(target=self._run, name="fastpersist-commit", daemon=False)
        self._thread.start()

    def _run(self) -> None:
        try:
            result = self._job.finish()
        except BaseException as e:
            self.set_exception(e)
            return
        if self._on_commit is not None:
            # Bookkeeping after the commit (retention, index) must not turn a committed save
            # into a failed one: log instead.
            try:
                self._on_commit(result)
            except Exception:
                log.exception("after-commit step failed for %s", self.path)
        self.set_result(result)

    @property
    def path(self) -> str:
        """The checkpoint directory being written."""
        return self._job.path

    @property
    def error_seen(self) -> bool:
        """True once the save's error has been raised to (or returned to) a caller."""
        return self._error_seen

    def staged(self) -> bool:
        """True once the save no longer reads the source tensors (staged, failed or done); never blocks."""
        return self.done() or self._job.staged()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Blocks until the source tensors may be modified.

        Raises:
            TimeoutError: staging did not finish within `timeout` seconds (None: no limit).
            TypeError: `timeout` is neither None nor a number.
            SaveCancelledError: a source tensor was modified in place before its bytes were
                staged, or the save was cancelled (it will not commit; ``wait()`` raises the
                same error).
        """
        timeout = given_timeout(timeout, "SaveFuture.wait_staged")
        try:
            self._job.wait_staged(timeout)
        except TimeoutError:
            raise
        except BaseException:
            self._error_seen = True
            raise

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Blocks until the checkpoint is committed and returns its :class:`SaveResult`.

        Raises the save's error (``OSError``, :class:`SaveCancelledError`, ...) if it failed, or
        ``TimeoutError`` if `timeout` seconds pass first (None: no limit; not a number: ``TypeError``).
        """
        timeout = given_timeout(timeout, "SaveFuture.wait")
        try:
            return self.result(timeout)
        except TimeoutError:
            if self.done():
                raise
            raise TimeoutError(f"the save of {self.path} did not finish within {timeout} s") from None

    def result(self, timeout: float | None = None) -> SaveResult:
        """Same as :meth:`wait` (``concurrent.futures`` spelling)."""
        timeout = given_timeout(timeout, "SaveFuture.result")
        try:
            return super().result(timeout)
        finally:
            if self.done():
                self._error_seen = True
                self._join_commit_thread()

    def _join_commit_thread(self) -> None:
        """Once the outcome is set, the commit thread only runs the done callbacks and ends: a
        caller of :meth:`wait` returns after it is gone, so that no thread of the save outlives
        the wait (a host's test harness may count leftover threads). Not from the thread itself
        (a done callback calling ``result()``)."""
        thread = self._thread
        if thread is not threading.current_thread():
            thread.join()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error, or None if it committed. Waits like :meth:`wait`."""
        error = super().exception(given_timeout(timeout, "SaveFuture.exception"))
        self._error_seen = True
        self._join_commit_thread()
        return error

    def cancel(self) -> bool:
        """Stops the save if it has not committed or failed yet.

        Returns True if it will not commit: the future then finishes (once its temporary files
        are removed) with :class:`SaveCancelledError`, and :meth:`cancelled` turns True.
        """
        if self.done() or not self._job.cancel():
            return False
        self._cancelled_by_caller = True
        return True

    def cancelled(self) -> bool:
        """True if :meth:`cancel` stopped the save and it has finished cleaning up."""
        return self._cancelled_by_caller and self.done()

    def __del__(self) -> None:
        if not self.done() or self._error_seen or self._cancelled_by_caller:
            return
        error = super().exception(0)
        if error is not None:
            log.error("the save of %s failed and nobody waited for its result: %s", self.path, error)

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if super().exception(0) else "committed")
        return f"<SaveFuture {self.path} {state}>"
