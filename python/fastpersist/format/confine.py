"""Confinement: fastpersist reads, writes and deletes only inside a checkpoint and its stripes.

A manifest is hostile input. The paths it can make fastpersist touch are:

* data files named ``[A-Za-z0-9][A-Za-z0-9._-]*`` directly inside the checkpoint directory, or
  inside one of its stripe directories (``manifest.py`` checks the names);
* stripe directories: absolute, normalised paths (no ``..``, no ``//``, no NUL) whose last
  component is ``{name}.{id}[.rN|.wN].fpstripe`` where ``id`` is the first 12 hex digits of the
  manifest's own ``checkpoint_id`` (:func:`fastpersist.format.layout.check_stripe_dirs`).

On top of those name rules, at use time (:func:`check_data_files`): every data file must be a
regular file, not a symbolic link, of exactly its recorded length; every stripe directory and
shard directory a real directory, not a link; and when the caller configured stripe roots
(``Config(stripes=...)``), every stripe directory must sit directly in one of them. Deletion
(:func:`remove_checkpoint_tree`) is stricter still: a stripe directory named by a manifest is
deleted only when it sits directly in a stripe root the caller configured and its owner marker
names that checkpoint, so a damaged or hostile manifest, or a copy of a checkpoint, can never make
fastpersist delete anything else.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Sequence

from ..errors import CorruptCheckpointError, FastPersistError
from .layout import stripe_dir_id
from .manifest import Manifest, read_manifest
from .ownership import Owner, checkpoint_key, read_owner, remove_owned_dir
from .quote import shown

__all__ = [
    "check_data_files",
    "check_shard_dir",
    "data_file_problem",
    "real_roots",
    "remove_checkpoint_tree",
    "under_roots",
]

log = logging.getLogger("fastpersist")


def real_roots(stripe_roots: Sequence[str | os.PathLike[str]] | None) -> set[str] | None:
    """The real paths of the configured stripe roots, or None when none are configured."""
    if not stripe_roots:
        return None
    return {os.path.realpath(os.fspath(r)) for r in stripe_roots}


def under_roots(directory: str, roots: set[str]) -> bool:
    """Whether `directory` sits directly in one of `roots` (real paths, from :func:`real_roots`)."""
    return os.path.realpath(os.path.dirname(directory)) in roots


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def check_shard_dir(root: str, name: str) -> str:
    """``root/name`` if it is a real directory (a shard), not a link out of the checkpoint."""
    path = os.path.join(root, name)
    st = _lstat(path)
    if st is None:
        raise CorruptCheckpointError(f"shard directory {path} named in {root}/manifest.json is missing")
    if not stat.S_ISDIR(st.st_mode):
        raise CorruptCheckpointError(f"{path} is not a directory (a link?); a shard is a plain directory")
    return path


def check_data_files(root: str, m: Manifest, stripe_roots: Sequence[str | os.PathLike[str]] | None = None) -> int:
    """Checks every data file before anything is read or allocated; returns their total bytes.

    Each file must be a regular file (not a link) of exactly its recorded length, so appended
    garbage and truncation are caught here, and no buffer larger than the files on disk is
    ever allocated. Stripe directories must be real directories, and inside the configured
    stripe roots when `stripe_roots` is given.

    Raises:
        CorruptCheckpointError: naming the file and what is wrong with it.
    """
    roots = real_roots(stripe_roots)
    for d in m.stripes:
        st = _lstat(d)
        if st is None:
            continue  # its files are reported missing below
        if not stat.S_ISDIR(st.st_mode):
            raise CorruptCheckpointError(
                f"stripe directory {shown(d, 300)} of {root} is not a plain directory (a link?)"
            )
        if roots is not None and not under_roots(d, roots):
            raise CorruptCheckpointError(
                f"stripe directory {shown(d, 300)} of {root} is outside the configured stripe roots "
                f"{shown(sorted(roots), 300)}"
            )
    total = 0
    for f in m.files:
        problem = data_file_problem(root, m.file_path(root, f), f.len_bytes)
        if problem:
            raise CorruptCheckpointError(problem)
        total += f.len_bytes
    return total


def data_file_problem(root: str, path: str, len_bytes: int) -> str | None:
    """What is wrong with the data file `path` of the checkpoint at `root` (missing, not a regular
    file, not exactly `len_bytes` long), or None when nothing is."""
    st = _lstat(path)
    if st is None:
        return f"data file {shown(path, 300)} named in {root}/manifest.json is missing"
    if not stat.S_ISREG(st.st_mode):
        return f"data file {shown(path, 300)} is not a regular file (a link?)"
    if st.st_size != len_bytes:
        how = "truncated" if st.st_size < len_bytes else "bytes appended"
        return f"{shown(path, 300)} has the wrong size ({how}?): expected {len_bytes} bytes, found {st.st_size}"
    return None


def remove_checkpoint_tree(
    root: str, stripe_roots: Sequence[str | os.PathLike[str]] | None, *, owner_path: str | None = None
) -> None:
    """Deletes the checkpoint directory `root` and those of its stripe directories that are provably its own.

    A stripe directory named by the manifest (or its shards' manifests) is deleted only if it is a
    real directory directly inside a configured stripe root, carries the stripe naming, and its
    owner marker (:mod:`fastpersist.format.ownership`) names this checkpoint and the manifest's
    checkpoint id: a ``cp -r`` copy of a checkpoint, or a damaged or hostile manifest, can never
    make fastpersist delete another checkpoint's data. `owner_path` is the checkpoint's own path
    when `root` is a temporary name it was moved to (the old tree after an atomic exchange).
    ``shutil.rmtree`` never follows links.
    """
    roots = real_roots(stripe_roots) or set()
    key = checkpoint_key(owner_path or root)
    for d, checkpoint_id in _named_stripe_dirs(root):
        st = _lstat(d)
        if st is None or not under_roots(d, roots):
            continue  # another rank's drive, or outside what this caller may delete
        owner = read_owner(d)
        if (
            stat.S_ISDIR(st.st_mode)
            and stripe_dir_id(os.path.basename(d))
            and owner == Owner(checkpoint=key, checkpoint_id=checkpoint_id)
        ):
            remove_owned_dir(d)
        else:
            log.warning(
                "not deleting %s (named by %s): its owner marker does not name that checkpoint", shown(d, 300), key
            )
    st = _lstat(root)
    if st is not None and stat.S_ISDIR(st.st_mode):
        shutil.rmtree(root, ignore_errors=True)
    elif st is not None and stat.S_ISLNK(st.st_mode):
        os.unlink(root)  # a step that was a link: the link goes, never what it names


def _named_stripe_dirs(root: str) -> list[tuple[str, str]]:
    """(stripe directory, checkpoint id) for every stripe directory the manifests of `root` name."""
    try:
        manifest = read_manifest(root)
    except (FastPersistError, OSError):
        return []
    named = [(d, manifest.checkpoint_id) for d in manifest.stripes]
    for shard in manifest.shards:
        try:
            named.extend((d, manifest.checkpoint_id) for d in read_manifest(os.path.join(root, shard)).stripes)
        except (FastPersistError, OSError):
            pass
    return named
