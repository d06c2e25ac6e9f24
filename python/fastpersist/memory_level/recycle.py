"""The in-memory level's page reuse: on a memory root (tmpfs, e.g. under /dev/shm) a retired
step's data files are recycled instead of freed, and the next save overwrites them in place.

Freeing a 1 GiB step and faulting in (allocating and zeroing) 1 GiB of fresh tmpfs pages for the
next one costs more than copying the bytes. So retention on a memory root
(:func:`recycle_checkpoint`) moves the retired checkpoint directory into the root's recycle
directory (``.fprecycle/``, named by :mod:`fastpersist.format.layout`) with one atomic rename
and then removes its manifest; a save (:func:`take_recycled`) renames a recycled data file of
the same name into its fresh temporary directory before the engine starts, and the engine
(``job/memory/mod.rs``) opens it without truncating, sets its length and overwrites it through a
mapping.

Why it stays crash-safe:

* a recycled file is one that only a *retired* step named: retirement happens after a newer step
  committed and checked out (:mod:`fastpersist.retention`), and the retired step leaves its name
  (the rename) before anything of it is reused, so no committed step ever names a file being
  overwritten;
* an overwritten file sits in the save's temporary directory, which holds no manifest until
  every byte is written with its new checksums: a kill -9 leaves a leftover that
  :func:`fastpersist.clean` removes, never a checkpoint;
* the recycle directory is garbage by construction (retired steps without their manifests):
  :func:`fastpersist.clean` removes it, ``Checkpointer.steps()`` never lists it;
* only plain files with one link are recycled or taken (a hard-linked copy elsewhere would be
  overwritten with it), and only checkpoints without stripe directories are recycled;
* a file is taken only under an exclusive ``flock`` got without waiting: a reader (``fp.load``,
  ``fp.verify``, an export; :mod:`fastpersist.loading.opened`) holds a shared one on every file
  of the step it opened, taken before it checks that the step still has its manifest, so a file
  a reader may still be reading stays where it is (and is freed with its entry later) while the
  save writes a fresh one: a reader gets its step whole, or ``CheckpointNotFoundError``.

Memory stays bounded: the recycle directory holds at most one retired step (older entries are
freed before a new one goes in), and a save takes its files out again, so a root holds at most
``keep`` committed steps plus the one being written.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
from collections.abc import Iterator, Sequence
from typing import Any

import fastpersist._core as _core

from ..errors import FastPersistError
from ..format.confine import check_shard_dir
from ..format.layout import MANIFEST_NAME, RECYCLE_DIR, SHARD_DIR, recycle_entry_name
from ..format.manifest import read_manifest

__all__ = [
    "file_to_stage_in",
    "free_recycled",
    "is_memory_root",
    "open_dir_nofollow",
    "recyclable_files",
    "recycle_checkpoint",
    "recycle_dir",
    "recycled_entries",
    "take_recycled",
]

log = logging.getLogger("fastpersist")

#: Recycle directories found not to be plain directories, warned of once per process.
_WARNED: set[str] = set()


def is_memory_root(root: str) -> bool:
    """Whether `root` lies on a memory filesystem (tmpfs, ramfs); False if it cannot be told."""
    try:
        return _core.is_memory_fs(root)
    except OSError:
        return False


def file_to_stage_in(
    paths: Sequence[str], parts: Sequence[Any], tmp_dir: str, *, backend: str, direct_io: str
) -> tuple[str, int] | None:
    """``(path, length)`` of a save's one data file when its device bytes may be staged straight
    into that file's pages (``Arenas.lease_file``): the save writes one part (`parts`, each with
    ``len_bytes``; at `paths`), of at least one byte, inside its temporary directory (recycled
    files live there), and the engine writes it in memory (``_core.writes_in_memory``)."""
    if len(paths) != 1 or not parts[0].len_bytes or os.path.relpath(paths[0], tmp_dir).startswith(os.pardir):
        return None
    return (paths[0], parts[0].len_bytes) if _core.writes_in_memory(paths, backend, direct_io) else None


def open_dir_nofollow(name: str, *, dir_fd: int | None = None) -> int | None:
    """A descriptor of the directory `name` (relative to `dir_fd` when given), or None if it is
    absent, a symbolic link or not a directory: nothing here is reached through a link."""
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return None
        raise


@contextlib.contextmanager
def recycle_dir(root: str, *, create: bool = False) -> Iterator[int | None]:
    """The root's recycle directory, opened without following links (None when it has none).

    Everything in it is listed, moved and deleted relative to this descriptor, so a link
    planted as ``.fprecycle`` (or swapped in later) never takes a deletion outside the root: a
    name that is not a real directory is left alone, with a WARNING, and recycling is off.
    """
    path = os.path.join(root, RECYCLE_DIR)
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path)
    fd = open_dir_nofollow(path)
    if fd is None and os.path.lexists(path) and path not in _WARNED:
        _WARNED.add(path)
        log.warning(
            "%s is not a plain directory (a link?); fastpersist neither recycles into it nor deletes through "
            "it: remove it yourself",
            path,
        )
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def _single_file(path: str) -> bool:
    """Whether `path` is (without following links) a regular file with no other hard link."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def recyclable_files(path: str) -> list[str] | None:
    """The manifests and data files of the checkpoint at `path`, or None if it may not be recycled
    (not a plain directory, unreadable, striped, a shard that is no plain directory, or a data
    file that is not a single plain file)."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return None  # a step that is a link: only the link is retired, never what it names
        top = read_manifest(path)
        shard_dirs = [check_shard_dir(path, s) for s in top.shards]
        manifests = [(path, top)] + [(d, read_manifest(d)) for d in shard_dirs]
    except (FastPersistError, OSError):
        return None
    files = [os.path.join(where, MANIFEST_NAME) for where, _ in manifests]
    for where, m in manifests:
        if m.stripes:
            return None
        for entry in m.files:
            file_path = m.file_path(where, entry)
            if not _single_file(file_path):
                return None
            files.append(file_path)
    return files


def recycle_checkpoint(root: str, path: str) -> bool:
    """Moves the retired checkpoint `path` of `root` into the recycle directory; False if it was not
    (not a memory root, or not recyclable): the caller then deletes it as usual.

    Older recycle entries are freed first, so at most one retired step's memory is held there.
    """
    if not is_memory_root(root) or recyclable_files(path) is None:
        return False
    try:
        manifest_id = read_manifest(path).checkpoint_id
        with recycle_dir(root, create=True) as bin_fd:
            if bin_fd is None:
                return False
            _free_entries(bin_fd)
            entry = recycle_entry_name(os.path.basename(path), manifest_id)
            os.rename(path, entry, dst_dir_fd=bin_fd)  # atomic: from here `path` is no checkpoint of the root
            _unlink_manifests(bin_fd, entry)
    except (FastPersistError, OSError) as e:
        log.info("not recycling %s (%s); deleting it", path, e)
        return False
    return True


def _unlink_manifests(bin_fd: int, entry: str) -> None:
    """Removes the manifests of a recycle entry (and of its shards), through descriptors: without
    them the entry is plainly no checkpoint, even to fp.load or fp.verify."""
    entry_fd = open_dir_nofollow(entry, dir_fd=bin_fd)
    if entry_fd is None:  # swapped for a link since the look: unlink the link itself
        os.unlink(entry, dir_fd=bin_fd)
        return
    try:
        shards = [s for s in sorted(os.listdir(entry_fd)) if SHARD_DIR.match(s)]
        for fd in [entry_fd, *(open_dir_nofollow(s, dir_fd=entry_fd) for s in shards)]:
            if fd is None:
                continue
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(MANIFEST_NAME, dir_fd=fd)
            finally:
                if fd != entry_fd:
                    os.close(fd)
    finally:
        os.close(entry_fd)


def recycled_entries(root: str) -> list[str]:
    """The entries of `root`'s recycle directory (none if it has none, or it is not a plain directory)."""
    with recycle_dir(root) as bin_fd:
        if bin_fd is None:
            return []
        return [os.path.join(root, RECYCLE_DIR, name) for name in sorted(os.listdir(bin_fd))]


def free_recycled(root: str) -> list[str]:
    """Deletes every entry of `root`'s recycle directory (garbage by construction); returns them."""
    with recycle_dir(root) as bin_fd:
        if bin_fd is None:
            return []
        return [os.path.join(root, RECYCLE_DIR, name) for name in _free_entries(bin_fd)]


def _free_entries(bin_fd: int) -> list[str]:
    """Deletes every entry of the recycle directory open at `bin_fd`; returns their names. A link
    is unlinked, never followed; ``shutil.rmtree`` follows none inside a directory either."""
    names = sorted(os.listdir(bin_fd))
    for name in names:
        try:
            is_dir = stat.S_ISDIR(os.stat(name, dir_fd=bin_fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            continue
        if is_dir:
            shutil.rmtree(name, dir_fd=bin_fd, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=bin_fd)
    return names


def take_recycled(root: str, tmp_dir: str, paths: list[str]) -> int:
    """Moves recycled files of `root` to `paths` (data files about to be written inside the save's
    temporary directory `tmp_dir`, which do not exist yet); returns how many were taken.

    A file is taken from a recycle entry at the same path relative to its checkpoint (so a rank
    of a sharded save takes its own shard's file). A path with nothing to take stays absent and
    the engine creates it; so does a path outside `tmp_dir` (a stripe's), which is never taken.
    """
    with recycle_dir(root) as bin_fd:
        if bin_fd is None:
            return 0
        # A dot-name is a spare still being made (spares.py): never taken half made.
        entries = sorted(e for e in os.listdir(bin_fd) if not e.startswith("."))
        taken = 0
        for dest in paths:
            rel = os.path.relpath(dest, tmp_dir)
            if rel.startswith(os.pardir):
                continue
            for entry in entries:
                if _take(bin_fd, [entry, *rel.split(os.sep)], dest):
                    taken += 1
                    break
        return taken


def _take(bin_fd: int, parts: list[str], dest: str) -> bool:
    """Renames the recycled file ``parts`` (its path in the recycle directory, one component an
    item) to `dest` if no reader holds it; whether it was taken. Each directory on the way is
    opened without following a link, so only a file that really lies in the recycle directory
    is ever moved.

    The exclusive lock is held across the rename, so no reader's shared lock falls between the
    look and the move; a reader that locks the file afterwards finds its step's manifest gone.
    """
    dirs: list[int] = []
    try:
        where = bin_fd
        for name in parts[:-1]:
            fd = open_dir_nofollow(name, dir_fd=where)
            if fd is None:
                return False
            dirs.append(fd)
            where = fd
        return _take_file(where, parts[-1], dest)
    finally:
        for fd in dirs:
            os.close(fd)


def _take_file(dir_fd: int, name: str, dest: str) -> bool:
    """:func:`_take` for the file `name` of the directory open at `dir_fd`."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return False  # absent, a link, or taken or freed by someone else since the listing
    try:
        held = os.fstat(fd)
        if not stat.S_ISREG(held.st_mode) or held.st_nlink != 1:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.debug("not recycling %s: a reader still holds it", name)
            return False
        try:
            os.rename(name, dest, src_dir_fd=dir_fd)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                return False  # taken or freed by someone else since the open
            raise
        try:
            moved = os.lstat(dest)
        except FileNotFoundError:
            return False
        if (moved.st_dev, moved.st_ino, moved.st_nlink) == (held.st_dev, held.st_ino, 1):
            return True
        os.unlink(dest)  # swapped for something else between the open and the rename
        return False
    finally:
        os.close(fd)
