"""Deletes replaced checkpoint trees and retired steps after the commit returns, on one background thread.

A replacing save exchanges the new tree with the old one (``renameat2``), which leaves the old
tree at the save's hidden temporary name ``.NAME.fptmp-ID``; retention moves a retired step to
that same kind of name (:func:`remove_checkpoint_later`). Either rename is atomic, so from then
on no listing, ``latest()`` or new load sees the old checkpoint; deleting its bytes took a third
of a small save's time inside the commit, so it is queued here instead and the save returns.

The thread deletes exactly what the commit deleted before
(:func:`~fastpersist.saving.target.remove_checkpoint_tree`: the tree and the stripe directories
its owner markers prove it owns). What the hidden tree still holds until then:

* a load that opened the old checkpoint before the rename keeps reading it through its
  directory handle and returns that checkpoint whole (or raises CheckpointNotFoundError if the
  removal got there first): one checkpoint, never a mix;
* its disk space: :func:`wait_removed` returns once every queued removal is done, and
  ``Checkpointer.close()``, ``fastpersist.clean`` and the interpreter's exit call it;
* a crash before the removal leaves a hidden tree with no live lock, which ``fastpersist clean``
  (and its stripe scan) removes, as after a crash inside a save.

The next save does not wait on it, unless the filesystem it writes to has less free space than
it writes there while removals are queued (:func:`make_room`): then it waits for them first;
and a blocking ``fp.save`` of one process that still runs out of space waits and tries once more.

Example:
    >>> fp.save(state, "/ckpt/latest"); fp.save(state, "/ckpt/latest")   # doctest: +SKIP
    >>> fp.wait_removed()   # the first tree is gone now                    # doctest: +SKIP
    True
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..arguments import given_timeout
from ..errors import FastPersistError
from ..format.layout import tmp_dir_for
from ..format.manifest import read_manifest
from ..format.ownership import DirLock, try_lock
from .target import remove_checkpoint_tree

__all__ = [
    "held_for_removal",
    "make_room",
    "removals_pending",
    "remove_checkpoint_later",
    "remove_later",
    "run_later",
    "wait_removed",
]

log = logging.getLogger("fastpersist")

_Task = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class _Remover:
    """One daemon thread working through a queue of removals, oldest first."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.tasks: deque[_Task] = deque()
        self.busy = 0  # queued or running
        self.thread: threading.Thread | None = None
        self.exited: threading.Thread | None = None  # the last thread, once it found nothing left

    def put(self, task: _Task) -> None:
        with self.cond:
            self.tasks.append(task)
            self.busy += 1
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="fastpersist-remover", daemon=True)
                self.thread.start()

    def _run(self) -> None:
        while True:
            with self.cond:
                if not self.tasks:
                    self.exited, self.thread = self.thread, None
                    self.cond.notify_all()
                    return
                fn, args, kwargs = self.tasks.popleft()
            try:
                fn(*args, **kwargs)
            except Exception as e:  # a leftover for `clean`, never a failed save: it committed
                log.warning("a background removal failed (fastpersist clean removes what is left): %s", e)
            finally:
                with self.cond:
                    self.busy -= 1
                    self.cond.notify_all()

    def wait(self, timeout: float | None) -> bool:
        if threading.current_thread() is self.thread:
            raise RuntimeError("a background removal cannot wait for the removals (itself among them)")
        with self.cond:
            if not self.cond.wait_for(lambda: self.busy == 0 and self.thread is None, timeout):
                return False
            exited = self.exited
        if exited is not None and exited is not threading.current_thread():
            exited.join()  # it holds nothing more: it is only returning
        return True


_remover = _Remover()


def _forget_in_child() -> None:
    """A forked child has no remover thread; its parent's queue is the parent's to finish."""
    global _remover
    _remover = _Remover()


os.register_at_fork(after_in_child=_forget_in_child)


def run_later(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Queues `fn(*args, **kwargs)`, a removal whose failure only leaves work for ``clean``."""
    _remover.put((fn, args, kwargs))


def _remove_held(lock: DirLock | None, root: str, stripes: tuple[str, ...] | None, *, owner_path: str | None) -> None:
    try:
        remove_checkpoint_tree(root, stripes, owner_path=owner_path)
    finally:
        if lock is not None:
            lock.release()


def remove_later(
    root: str,
    stripe_roots: Sequence[str | os.PathLike[str]] | None,
    *,
    owner_path: str | None,
    lock: DirLock | None = None,
) -> None:
    """Queues the removal of the hidden tree `root` (and the stripe directories it owns) of the
    checkpoint `owner_path`; `lock` (held on `root`) is released once it is gone, so that until
    then a cleaner in another process leaves the tree to this one."""
    stripes = tuple(os.fspath(s) for s in stripe_roots) if stripe_roots else None
    run_later(_remove_held, lock, root, stripes, owner_path=owner_path)


class _Held:
    """The lock of a checkpoint a commit is about to replace, until its removal takes it over."""

    def __init__(self, path: str, hold: bool) -> None:
        self.path, self.hold = path, hold
        self.lock = try_lock(path) if hold else None

    def remove_later(
        self, hidden: str, stripe_roots: Sequence[str | os.PathLike[str]] | None, *, exchanged: bool
    ) -> None:
        """If a tree was `exchanged` out to `hidden`, queues its removal, with its lock if it is the
        one held; else only lets go of the lock."""
        lock, self.lock = self.lock, None
        if not exchanged:
            if lock is not None:
                lock.release()
            return
        if lock is not None and not lock.holds(hidden):
            lock.release()  # another save's tree was exchanged out: lock that one
            lock = None
        remove_later(hidden, stripe_roots, owner_path=self.path, lock=lock or (try_lock(hidden) if self.hold else None))


@contextlib.contextmanager
def held_for_removal(path: str, *, hold: bool = True) -> Iterator[_Held]:
    """Holds the checkpoint at `path` (if any, and if `hold`) across a commit that may exchange
    it out; a tree not handed to :meth:`_Held.remove_later` is released at the end. A group's
    replacing save does not hold it: the other ranks remove their stripe directories of it once
    its temporary directory is not a live save's."""
    held = _Held(path, hold)
    try:
        yield held
    finally:
        if held.lock is not None:
            held.lock.release()


def remove_checkpoint_later(path: str, stripe_roots: Sequence[str | os.PathLike[str]] | None) -> None:
    """Moves the committed checkpoint `path` out of sight at once and queues its removal.

    It is renamed to its hidden temporary name, held locked until deleted (a crash leaves it
    unlocked, and ``clean`` removes it); a checkpoint whose manifest cannot be read, or that
    cannot be renamed, is removed here.
    """
    lock = try_lock(path)
    try:
        hidden = tmp_dir_for(path, read_manifest(path).checkpoint_id)
        os.rename(path, hidden)  # fails if `hidden` exists and is not empty: then remove in place
    except (FastPersistError, OSError):
        if lock is not None:
            lock.release()
        remove_checkpoint_tree(path, stripe_roots)
        return
    remove_later(hidden, stripe_roots, owner_path=path, lock=lock)


def wait_removed(timeout: float | None = None) -> bool:
    """Waits until this process's queued removals of replaced and retired checkpoints are done.

    Returns False if `timeout` seconds passed first (None: no limit). A save never needs this;
    call it before measuring free space or listing a checkpoint root's hidden entries.

    Example:
        >>> fp.wait_removed(timeout=60)   # doctest: +SKIP
        True
    """
    return _remover.wait(given_timeout(timeout, "fastpersist.wait_removed"))


def make_room(paths: Sequence[str], nbytes: Sequence[int]) -> None:
    """Waits for the queued removals when a file about to be written (`paths`, `nbytes` each)
    lies on a filesystem with less free space than the save writes there: the space it lacks
    may be a replaced tree's, still queued. One statvfs per file, only while removals are queued."""
    if not removals_pending():
        return
    need: dict[int, int] = {}
    free: dict[int, int] = {}
    for path, n in zip(paths, nbytes, strict=True):
        folder = os.path.dirname(path)
        device, fs = os.stat(folder).st_dev, os.statvfs(folder)
        need[device] = need.get(device, 0) + n
        free[device] = fs.f_bavail * fs.f_frsize
    if any(need[d] > free[d] for d in need):
        wait_removed()


def removals_pending() -> bool:
    """Whether this process has queued removals not yet done (their space not yet free)."""
    with _remover.cond:
        return _remover.busy > 0


atexit.register(wait_removed)
