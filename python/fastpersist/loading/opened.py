"""A checkpoint opened once: everything one load, verify or inspect reads is inside one directory.

A save replaces a checkpoint by exchanging a fresh directory with the target (``renameat2``)
and then deletes the old tree. A reader that read the manifest and then opened the data files
by path could get the manifest of one save and the data files of the next: false checksum
mismatches, or with ``verify=False`` the step of one save with the tensors of the other.

So a reader opens the checkpoint directory once (``O_DIRECTORY``; a symbolic link naming a
checkpoint is followed at that moment and never again) and reaches the manifest and the data
files through that handle, as ``/proc/self/fd/N/NAME``: however the path is renamed, exchanged
or deleted afterwards, every later open resolves inside the same directory. Stripe directories
need no handle: their names carry the checkpoint id, so they cannot hold another save's files.

On a memory root (tmpfs) retention does not free a retired step's data files: it recycles
them, and the next save overwrites them in place (:mod:`fastpersist.memory_level.recycle`). A handle
alone does not protect a reader there (it keeps the inodes, whose bytes are then rewritten), so
a reader also holds a shared ``flock`` on every file of the directory for as long as the
directory is open, taken before it reads anything, and then checks that the directory still
holds its manifest; a save takes a recycled file only under an exclusive ``flock`` it gets
without waiting. Retirement removes the manifest before any file is taken, so either the check
fails (the step was retired before the reader held its files: :class:`CheckpointNotFoundError`)
or every file stays out of reach of the recycling until the read is done.

Errors keep naming the path the caller gave (:func:`real_paths` rewrites the handle's name in
messages and ``filename``), and a failure while the checkpoint at that path was deleted or
replaced (a file vanished as the old tree was removed) becomes :class:`CheckpointNotFoundError`:
the load saw only its own checkpoint, and returns nothing of it.

Example:
    >>> import fastpersist as fp, torch
    >>> _ = fp.save({"w": torch.ones(2)}, "/tmp/fp-doc-opened")
    >>> with opened_checkpoint("/tmp/fp-doc-opened") as ck:
    ...     ck.at.startswith("/proc/self/fd/"), ck.root
    (True, '/tmp/fp-doc-opened')
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..format.confine import check_shard_dir
from ..memory_level.reader_locks import hold_against_recycling

__all__ = ["OpenedCheckpoint", "opened_checkpoint", "opened_shard", "real_paths"]

_FD_DIR = "/proc/self/fd"
#: Handle paths of the checkpoints open in this process -> the paths their callers named.
_open_paths: dict[str, str] = {}
_open_paths_lock = threading.Lock()
_HANDLE_PATH = re.compile(re.escape(_FD_DIR) + r"/(\d+)(?![0-9])")


@dataclass(frozen=True)
class OpenedCheckpoint:
    """A checkpoint directory held open for one read.

    Attributes:
        root: the absolute path the caller named (what messages say).
        fd: the directory's file descriptor, open until the read is done.
        at: the directory through its handle (``/proc/self/fd/N``): give this to everything
            that opens the manifest or data files.
    """

    root: str
    fd: int
    at: str


def real_paths(text: str) -> str:
    """`text` with the handle path of every checkpoint open in this process replaced by the
    path its caller named (for messages and ``filename`` attributes)."""
    if _FD_DIR not in text:
        return text
    with _open_paths_lock:
        known = dict(_open_paths)
    return _HANDLE_PATH.sub(lambda match: known.get(match.group(0), match.group(0)), text)


def _open_directory(root: str, dir_fd: int | None = None, name: str | None = None) -> int:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    try:
        if dir_fd is None:
            return os.open(root, flags)
        return os.open(name or "", flags | os.O_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        if os.path.islink(root):
            raise CheckpointNotFoundError(
                errno.ENOENT,
                f"no checkpoint here: a symbolic link to {os.readlink(root)!r}, which does not exist",
                root,
            ) from None
        raise CheckpointNotFoundError(errno.ENOENT, "no checkpoint here", root) from None
    except NotADirectoryError:
        raise CorruptCheckpointError(f"{root} is not a fastpersist checkpoint (not a directory)") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorruptCheckpointError(f"{root} is a symbolic link where a plain directory is expected") from None
        raise


def _replaced(ck: OpenedCheckpoint) -> bool:
    """Whether `ck.root` no longer names the directory held open (deleted, or replaced by a save)."""
    held = os.fstat(ck.fd)
    try:
        now = os.stat(ck.root)
    except OSError:
        return True
    return held.st_nlink == 0 or (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)


def _with_real_paths(error: Exception) -> Exception:
    """A copy of `error` whose message and path attributes name real paths (or `error` itself)."""
    values = [*error.args, *vars(error).values(), getattr(error, "filename", None)]
    texts = [v for v in values if isinstance(v, str)]
    if not any(_FD_DIR in text for text in texts):
        return error
    copy: Exception
    try:
        if isinstance(error, OSError) and error.errno is not None and len(error.args) >= 2:
            filename = real_paths(error.filename) if isinstance(error.filename, str) else error.filename
            copy = type(error)(error.errno, real_paths(str(error.strerror)), filename)
        else:
            copy = type(error)(*(real_paths(a) if isinstance(a, str) else a for a in error.args))
            for key, value in vars(error).items():
                setattr(copy, key, real_paths(value) if isinstance(value, str) else value)
    except Exception:
        return error
    return copy.with_traceback(error.__traceback__)


@contextlib.contextmanager
def _held(root: str, fd: int) -> Iterator[OpenedCheckpoint]:
    ck = OpenedCheckpoint(root, fd, f"{_FD_DIR}/{fd}")
    if not os.path.isdir(ck.at):  # no /proc: paths, as before (the exchange race stays open)
        os.close(fd)
        yield OpenedCheckpoint(root, -1, root)
        return
    try:
        files = hold_against_recycling(ck.fd, ck.at)
    except BaseException:
        os.close(fd)
        raise
    with _open_paths_lock:
        _open_paths[ck.at] = root
    try:
        yield ck
    except Exception as e:
        if isinstance(e, (CorruptCheckpointError, OSError)) and _replaced(ck):
            raise CheckpointNotFoundError(
                errno.ENOENT,
                "the checkpoint was deleted or replaced while it was being read "
                f"({type(e).__name__}: {real_paths(str(e))}); nothing of it was returned: read it again",
                root,
            ) from None
        shown = _with_real_paths(e)
        if shown is e:
            raise
        raise shown from None
    finally:
        with _open_paths_lock:
            _open_paths.pop(ck.at, None)
        for held in files:
            os.close(held)
        os.close(fd)


@contextlib.contextmanager
def opened_checkpoint(path: str | os.PathLike[str]) -> Iterator[OpenedCheckpoint]:
    """Opens the checkpoint directory `path` (following a symbolic link once) for one read.

    Raises:
        CheckpointNotFoundError: nothing at `path`, or the checkpoint was deleted or replaced
            while the body of the ``with`` read it.
        CorruptCheckpointError: `path` is not a directory.
    """
    root = os.path.abspath(os.fspath(path))
    with _held(root, _open_directory(root)) as ck:
        yield ck


@contextlib.contextmanager
def opened_shard(parent: OpenedCheckpoint, name: str) -> Iterator[OpenedCheckpoint]:
    """Opens the shard directory `name` of `parent` through the parent's handle (never a link).

    Raises:
        CorruptCheckpointError: the shard directory is missing or not a plain directory.
    """
    check_shard_dir(parent.at, name)
    root = os.path.join(parent.root, name)
    with _held(root, _open_directory(root, parent.fd if parent.fd >= 0 else None, name)) as ck:
        yield ck
