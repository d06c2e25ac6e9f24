"""Who owns a directory on disk: the owner marker of a stripe directory, the lock of a live save.

Stripe roots are drive mount points (``/nvme0``, ``/nvme1``) that several checkpoint roots share:
two experiments, a ``best`` and a ``latest`` root, a ``cp -r`` backup whose manifest still names
the original's stripe directories. A stripe directory's name alone therefore does not say whose it
is. Before any data goes in, a save writes :data:`OWNER_MARKER` into each stripe directory it
creates, naming the checkpoint it belongs to (the real path of its parent plus its name) and the
checkpoint id. Removal (retention, replacement, :func:`fastpersist.clean`) deletes a stripe
directory only when its marker names the checkpoint being removed, or, for a leftover, a
checkpoint of the root being cleaned whose save is provably dead.

A save holds an exclusive ``flock`` on its temporary directory from the moment it exists until the
save commits or is discarded; the kernel drops the lock when the process dies, so a temporary
directory whose lock can be taken belongs to a dead save. The directory is created under a shared
lock on its parent and a cleaner tests liveness under an exclusive one, so no cleaner ever sees a
temporary directory between its ``mkdir`` and its lock.

Example:
    >>> lock = make_locked_dir("/tmp/fp-doc/.ck.fptmp-0123456789ab")   # doctest: +SKIP
    >>> with cleaning("/tmp/fp-doc"):                                  # doctest: +SKIP
    ...     is_live("/tmp/fp-doc/.ck.fptmp-0123456789ab")
    True
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from .flocks import flock, lock_state, locked_dir
from .layout import write_new_file

__all__ = [
    "OWNER_MARKER",
    "REMOVING",
    "REMOVING_PREFIX",
    "DirLock",
    "Owner",
    "checkpoint_key",
    "cleaning",
    "is_live",
    "lock_state",
    "make_locked_dir",
    "read_owner",
    "remove_owned_dir",
    "try_lock",
    "write_owner",
]

#: The marker file inside each stripe directory. Data file names start with a letter or digit,
#: so it can never be mistaken for one.
log = logging.getLogger("fastpersist")

OWNER_MARKER = ".fpowner.json"
#: A stripe directory whose removal has started is renamed to a name this pattern matches
#: (see :func:`remove_owned_dir`); short, so it fits wherever the stripe directory's name did.
REMOVING_PREFIX = ".fpremoving-"
REMOVING = re.compile(r"^" + re.escape(REMOVING_PREFIX) + r"[0-9a-f]{16}$")
_MAX_MARKER_BYTES = 1 << 14


@dataclass(frozen=True)
class Owner:
    """What a stripe directory's marker says: the checkpoint it belongs to and that save's id."""

    checkpoint: str
    checkpoint_id: str


def checkpoint_key(path: str | os.PathLike[str]) -> str:
    """The name a marker records for the checkpoint at `path`: its parent's real path plus its name.

    The checkpoint itself need not exist (a save's target, a removed step): only the parent is
    resolved, so a root reached through a symbolic link still names the same checkpoint.
    """
    parent, name = os.path.split(os.path.abspath(os.fspath(path)))
    return os.path.join(os.path.realpath(parent), name)


def write_owner(stripe_dir: str, checkpoint_path: str, checkpoint_id: str, *, durable: bool) -> None:
    """Writes the owner marker into a freshly created, still empty stripe directory.

    Its directory entry is made durable with the data files' (a durable save fsyncs every
    stripe directory before it commits).
    """
    doc = {"fastpersist_owner": 1, "checkpoint": checkpoint_key(checkpoint_path), "checkpoint_id": checkpoint_id}
    write_new_file(os.path.join(stripe_dir, OWNER_MARKER), json.dumps(doc).encode(), durable=durable)


def read_owner(stripe_dir: str) -> Owner | None:
    """The owner a stripe directory's marker names, or None (no marker, or not a valid one)."""
    try:
        fd = os.open(os.path.join(stripe_dir, OWNER_MARKER), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        raw = os.read(fd, _MAX_MARKER_BYTES)
    finally:
        os.close(fd)
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    checkpoint, checkpoint_id = doc.get("checkpoint"), doc.get("checkpoint_id")
    if not isinstance(checkpoint, str) or not isinstance(checkpoint_id, str):
        return None
    return Owner(checkpoint=checkpoint, checkpoint_id=checkpoint_id)


def remove_owned_dir(stripe_dir: str) -> None:
    """Deletes a stripe directory its caller has proven to own.

    It is first renamed to a name no save creates (:data:`REMOVING`), so a removal cut short
    by a crash leaves a directory any later clean may finish removing, rather than a
    half-emptied one whose owner can no longer be proven.
    """
    doomed = os.path.join(os.path.dirname(stripe_dir), f"{REMOVING_PREFIX}{uuid.uuid4().hex[:16]}")
    try:
        os.rename(stripe_dir, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


class DirLock:
    """An exclusive ``flock`` held on a directory while a save is alive; :meth:`release` drops it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, path)
        except BaseException:
            self.release()
            raise

    def holds(self, path: str) -> bool:
        """Whether the directory now at `path` is the one this lock holds (it may have been renamed)."""
        if self._fd is None:
            return False
        try:
            held, now = os.fstat(self._fd), os.lstat(path)
        except FileNotFoundError:
            return False
        return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)

    def release(self) -> None:
        """Drops the lock (idempotent). The directory may have been renamed or removed meanwhile."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def try_lock(path: str) -> DirLock | None:
    """The lock of the directory at `path`, or None if it is gone, not a directory, or held.

    A checkpoint tree awaiting deletion is held this way, so that a cleaner in another process
    takes it for a live save's (not a crash's leftover) until its deletion is done.
    """
    try:
        return DirLock(path)
    except (BlockingIOError, FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return None
        raise


def make_locked_dir(path: str) -> DirLock:
    """Creates the directory `path` (a save's temporary directory) and returns its held lock.

    Raises:
        FileExistsError: `path` exists already.
    """
    with locked_dir(os.path.dirname(path) or ".", fcntl.LOCK_SH):
        os.mkdir(path)
        try:
            return DirLock(path)
        except BaseException:
            os.rmdir(path)
            raise


@contextlib.contextmanager
def cleaning(root: str) -> Iterator[None]:
    """Holds `root` against new temporary directories while a cleaner decides what is dead."""
    with locked_dir(root, fcntl.LOCK_EX):
        yield


def is_live(tmp_dir: str) -> bool:
    """Whether a live save holds `tmp_dir` (call inside :func:`cleaning` of its parent).

    A directory that is missing, or whose lock can be taken, belongs to no live save; one on a
    file system without locks counts as live (nothing proves it dead).
    """
    return lock_state(tmp_dir) == "live"
