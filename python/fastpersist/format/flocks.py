"""The ``flock`` primitives the on-disk liveness rules rest on.

A live save or write holds an exclusive ``flock`` on its temporary directory or file (the kernel
drops it when the process dies), so whoever can take that lock knows its writer is gone. Such a
temporary is created under a shared lock on its parent directory, and a cleaner decides under an
exclusive one, so no cleaner sees a temporary between its creation and its lock. Where the
filesystem has no locks (some network filesystems), nothing can be proven dead: a temporary
there counts as live.

:mod:`fastpersist.format.ownership` (temporary directories, stripe directories) and
:mod:`fastpersist.format.layout` (temporary files) build on these.

Example:
    >>> with locked_dir("/tmp", fcntl.LOCK_SH):
    ...     lock_state("/tmp/fp-doc-no-such-temporary")
    'gone'
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
from collections.abc import Iterator

__all__ = ["flock", "locked_dir", "lock_state"]

log = logging.getLogger("fastpersist")

#: errnos of a file system without flock support (some network file systems).
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_warned_no_locks = False


def flock(fd: int, operation: int, path: str) -> bool:
    """``flock`` that returns False, warning once, where the file system has no locks.

    Raises:
        BlockingIOError: with ``LOCK_NB``, another open file holds the lock.
    """
    global _warned_no_locks
    try:
        fcntl.flock(fd, operation)
    except OSError as e:
        if e.errno not in _NO_LOCKS:
            raise
        if not _warned_no_locks:
            _warned_no_locks = True
            log.warning(
                "%s: this file system does not support flock (%s); saves there cannot be told live from dead, "
                "so fastpersist.clean keeps every temporary directory and file on it",
                path,
                e.strerror,
            )
        return False
    return True


@contextlib.contextmanager
def locked_dir(path: str, operation: int) -> Iterator[None]:
    """Holds a ``flock`` (`operation`) on the directory `path` for the body of the ``with``."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        flock(fd, operation, path)
        yield
    finally:
        os.close(fd)


def lock_state(path: str) -> str:
    """``"live"`` (a writer holds it), ``"dead"`` (its writer is gone) or ``"gone"`` (nothing
    there) for the temporary directory or file `path`; call it under an exclusive
    :func:`locked_dir` of its parent.

    ``"dead"`` only while the lock taken is the lock of the directory or file still at `path`: a
    writer that committed (renamed it away) between the look and the lock makes it ``"gone"``.
    Anything else at `path` (a link, a FIFO, a device) is nobody's temporary: ``"live"``, kept.
    """
    try:
        # O_NONBLOCK: opening a FIFO planted under a temporary's name must not wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return "gone"
        if e.errno == errno.ELOOP:
            return "live"
        raise
    try:
        held = os.fstat(fd)
        if not (stat.S_ISDIR(held.st_mode) or stat.S_ISREG(held.st_mode)):
            return "live"
        try:
            locked = flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, path)
        except BlockingIOError:
            locked = False
        if not locked:
            return "live"
        try:
            now = os.lstat(path)
        except FileNotFoundError:
            return "gone"
    finally:
        os.close(fd)
    return "dead" if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino) else "gone"
