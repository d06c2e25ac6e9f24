"""`SaveFuture`: the handle `save_async` returns, shaped like `concurrent.futures.Future`."""

from __future__ import annotations

import threading
from collections.abc import Callable

from .config import SaveResult
from .saving import SaveJob

__all__ = ["SaveFuture"]


class SaveFuture:
    """A save running in the background.

    Two moments matter: :meth:`wait_staged` returns once the state's tensors may be modified
    again (call it before ``optimizer.step()``); :meth:`wait` returns once the checkpoint is
    durable and committed. A commit thread finishes the save even if nobody waits, and the
    interpreter waits for it at exit, so a started save either commits whole or not at all.

    Example:
        >>> fut = fp.save_async(state, "ckpt/step-10")      # doctest: +SKIP
        >>> loss.backward()                                  # doctest: +SKIP
        >>> fut.wait_staged(); optimizer.step()              # doctest: +SKIP
        >>> fut.wait().gb_per_s                              # doctest: +SKIP
    """

    def __init__(self, job: SaveJob, on_commit: Callable[[SaveResult], object] | None = None) -> None:
        self._job = job
        self._on_commit = on_commit
        self._finished = threading.Event()
        self._lock = threading.Lock()
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[SaveFuture], object]] = []
        self._thread = threading.Thread(target=self._run, name="fastpersist-commit", daemon=False)
        self._thread.start()

    def _run(self) -> None:
        try:
            result = self._job.finish()
        except BaseException as e:
            error: BaseException | None = e
            result = None
        else:
            error = None
            if self._on_commit is not None and result is not None:
                # Bookkeeping after the commit (retention, index) must not turn a committed
                # save into a failed one: log instead.
                try:
                    self._on_commit(result)
                except Exception:
                    import logging

                    logging.getLogger("fastpersist").exception("after-commit step failed for %s", self.path)
        with self._lock:
            self._result, self._error = result, error
            self._finished.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            self._call(fn)

    def _call(self, fn: Callable[[SaveFuture], object]) -> None:
        try:
            fn(self)
        except Exception:
            import logging

            logging.getLogger("fastpersist").exception("exception in a SaveFuture done-callback")

    @property
    def path(self) -> str:
        """The checkpoint directory being written."""
        return self._job.path

    def wait_staged(self, timeout: float | None = None) -> None:
        """Blocks until the source tensors may be modified.

        Raises:
            TimeoutError: staging did not finish within `timeout` seconds.
            SaveCancelledError: a source tensor was modified in place before staging finished
                (the save will not commit).
        """
        self._job.wait_staged(timeout)

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Blocks until the checkpoint is committed and returns its :class:`SaveResult`.

        Raises the save's error (``OSError``, :class:`SaveCancelledError`, ...) if it failed, or
        ``TimeoutError`` if `timeout` seconds pass first.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the save of {self.path} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def result(self, timeout: float | None = None) -> SaveResult:
        """Same as :meth:`wait` (``concurrent.futures`` spelling)."""
        return self.wait(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error, or None if it committed. Waits like :meth:`wait`."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the save of {self.path} did not finish within {timeout} s")
        return self._error

    def done(self) -> bool:
        """True once the save committed or failed."""
        return self._finished.is_set()

    def add_done_callback(self, fn: Callable[[SaveFuture], object]) -> None:
        """Calls ``fn(self)`` when the save finishes (at once if it already has)."""
        with self._lock:
            if not self._finished.is_set():
                self._callbacks.append(fn)
                return
        self._call(fn)

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "committed")
        return f"<SaveFuture {self.path} {state}>"
