"""A reader's hold on a memory root's step: the shared ``flock``s that keep its files from being
recycled while it reads them (:mod:`fastpersist.memory_level.recycle` takes a file only under an
exclusive lock it gets without waiting; :mod:`fastpersist.loading.opened` holds these for as
long as a checkpoint is open)."""

from __future__ import annotations

import fcntl
import os
import stat

from ..format.layout import MANIFEST_NAME
from .recycle import is_memory_root

__all__ = ["hold_against_recycling"]


def hold_against_recycling(dir_fd: int, at: str) -> list[int]:
    """Shared ``flock``s on every plain file of the directory open as `dir_fd` (reachable as
    `at`) but its manifest; returns their descriptors, for the caller to close when its read is
    done. None on a filesystem other than memory (nothing is recycled there, and a network
    filesystem's locks may be slow or missing), and none once the directory has lost its
    manifest: the step was retired and its files may be recycled, and the caller's own read of
    the manifest, which comes next, fails as it should.
    """
    if not is_memory_root(at):
        return []
    held: list[int] = []
    try:
        with os.scandir(dir_fd) as entries:
            names = [e.name for e in entries if e.name != MANIFEST_NAME and e.is_file(follow_symlinks=False)]
        for name in names:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
            except OSError:
                continue  # gone since the listing: the step is being retired; the check below says so
            held.append(fd)
            if stat.S_ISREG(os.fstat(fd).st_mode):
                fcntl.flock(fd, fcntl.LOCK_SH)  # a save holds its exclusive lock for a rename only
        os.stat(MANIFEST_NAME, dir_fd=dir_fd, follow_symlinks=False)
    except BaseException as e:
        for fd in held:
            os.close(fd)
        if isinstance(e, FileNotFoundError):
            return []
        raise
    return held
