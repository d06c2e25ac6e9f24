"""Removes replaced checkpoint trees after the commit returns, on one background thread.

A replacing save exchanges the new tree with the old one (``renameat2``); the old tree is then
at the save's temporary name ``.NAME.fptmp-ID``, with no live lock, and its stripe directories
are owned by the checkpoint path. Deleting it took a third of a small save's time inside the
commit, so :func:`remove_later` queues it instead and returns. The thread deletes exactly what
the commit deleted before (:func:`~fastpersist.saving.target.remove_checkpoint_tree`); a crash
before it finishes leaves the state a crash just after the exchange always left, which
``fastpersist clean`` and the next save's recovery remove. The next save does not wait on it.

Example:
    >>> fp.save(state, "/ckpt/latest"); fp.save(state, "/ckpt/latest")   # doctest: +SKIP
    >>> wait_removed()   # the first tree is gone now                        # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from collections.abc import Sequence

from .target import remove_checkpoint_tree

__all__ = ["remove_later", "wait_removed"]

log = logging.getLogger("fastpersist")

_Job = tuple[str, tuple[str, ...] | None, str | None]
_queue: queue.Queue[_Job] = queue.Queue()
_lock = threading.Lock()
_thread: threading.Thread | None = None


def _run() -> None:
    while True:
        root, stripes, owner_path = _queue.get()
        try:
            remove_checkpoint_tree(root, stripes, owner_path=owner_path)
        except Exception as e:  # a leftover for `clean`, never a failed save: it committed
            log.warning("could not remove the replaced checkpoint tree %s: %s", root, e)
        finally:
            _queue.task_done()


def remove_later(root: str, stripe_roots: Sequence[str | os.PathLike[str]] | None, *, owner_path: str | None) -> None:
    """Queues the removal of the replaced tree `root` (and the stripe directories it owns)."""
    global _thread
    stripes = tuple(os.fspath(s) for s in stripe_roots) if stripe_roots else None
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="fastpersist-remover", daemon=True)
            _thread.start()
    _queue.put((root, stripes, owner_path))


def wait_removed() -> None:
    """Returns once every queued removal has finished (tests, and the interpreter's exit)."""
    if _thread is not None:
        _queue.join()


atexit.register(wait_removed)
