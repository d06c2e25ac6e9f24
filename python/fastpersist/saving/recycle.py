"""The in-memory level's page reuse: on a memory root (tmpfs, e.g. under /dev/shm) a retired
step's data files are recycled instead of freed, and the next save overwrites them in place.

Freeing a 1 GiB step and faulting in (allocating and zeroing) 1 GiB of fresh tmpfs pages for the
next one costs more than copying the bytes. So retention on a memory root
(:func:`recycle_checkpoint`) moves the retired checkpoint directory into the root's recycle
directory (``.fprecycle/``, named by :mod:`fastpersist.format.layout`) with one atomic rename
and then removes its manifest; a save (:func:`take_recycled`) renames a recycled data file of
the same name into its fresh temporary directory before the engine starts, and the engine
(``job/memory.rs``) opens it without truncating, sets its length and overwrites it through a
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
from collections.abc import Sequence
from typing import Any

import fastpersist._core as _core

from ..errors import FastPersistError
from ..format.layout import MANIFEST_NAME, RECYCLE_DIR, SHARD_DIR, recycle_entry_name
from ..format.manifest import read_manifest

__all__ = [
    "file_to_stage_in",
    "free_recycled",
    "is_memory_root",
    "recycle_checkpoint",
    "recycled_entries",
    "take_recycled",
]

log = logging.getLogger("fastpersist")


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


def _single_file(path: str) -> bool:
    """Whether `path` is (without following links) a regular file with no other hard link."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def _data_files(path: str) -> list[str] | None:
    """The manifests and data files of the checkpoint at `path`, or None if it may not be recycled
    (unreadable, striped, or a data file that is not a single plain file)."""
    try:
        top = read_manifest(path)
        manifests = [(path, top)] + [(os.path.join(path, s), read_manifest(os.path.join(path, s))) for s in top.shards]
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
    if not is_memory_root(root) or _data_files(path) is None:
        return False
    bin_dir = os.path.join(root, RECYCLE_DIR)
    try:
        manifest_id = read_manifest(path).checkpoint_id
        os.makedirs(bin_dir, exist_ok=True)
        free_recycled(root)
        entry = os.path.join(bin_dir, recycle_entry_name(os.path.basename(path), manifest_id))
        os.rename(path, entry)  # atomic: from here `path` is no checkpoint of the root
    except (FastPersistError, OSError) as e:
        log.info("not recycling %s (%s); deleting it", path, e)
        return False
    # Without its manifests the entry is plainly no checkpoint, even to fp.load or fp.verify.
    shards = [os.path.join(entry, s) for s in sorted(os.listdir(entry)) if SHARD_DIR.match(s)]
    for where in [entry, *shards]:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            os.unlink(os.path.join(where, MANIFEST_NAME))
    return True


def recycled_entries(root: str) -> list[str]:
    """The entries of `root`'s recycle directory (none if it has none)."""
    bin_dir = os.path.join(root, RECYCLE_DIR)
    try:
        return [os.path.join(bin_dir, name) for name in sorted(os.listdir(bin_dir))]
    except (FileNotFoundError, NotADirectoryError):
        return []


def free_recycled(root: str) -> list[str]:
    """Deletes every entry of `root`'s recycle directory (garbage by construction); returns them."""
    removed = recycled_entries(root)
    for p in removed:
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
    return removed


def take_recycled(root: str, tmp_dir: str, paths: list[str]) -> int:
    """Moves recycled files of `root` to `paths` (data files about to be written inside the save's
    temporary directory `tmp_dir`, which do not exist yet); returns how many were taken.

    A file is taken from a recycle entry at the same path relative to its checkpoint (so a rank
    of a sharded save takes its own shard's file). A path with nothing to take stays absent and
    the engine creates it; so does a path outside `tmp_dir` (a stripe's), which is never taken.
    """
    bin_dir = os.path.join(root, RECYCLE_DIR)
    try:
        entries = sorted(os.listdir(bin_dir))
    except (FileNotFoundError, NotADirectoryError):
        return 0
    taken = 0
    for dest in paths:
        rel = os.path.relpath(dest, tmp_dir)
        if rel.startswith(os.pardir):
            continue
        for entry in entries:
            if _take(os.path.join(bin_dir, entry, rel), dest):
                taken += 1
                break
    return taken


def _take(src: str, dest: str) -> bool:
    """Renames the recycled file `src` to `dest` if no reader holds it; whether it was taken.

    The exclusive lock is held across the rename, so no reader's shared lock falls between the
    look and the move; a reader that locks the file afterwards finds its step's manifest gone.
    """
    try:
        fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # absent, a link, or taken or freed by someone else since the listing
    try:
        held = os.fstat(fd)
        if not stat.S_ISREG(held.st_mode) or held.st_nlink != 1:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.debug("not recycling %s: a reader still holds it", src)
            return False
        try:
            os.rename(src, dest)
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
