"""Removing the leftovers of interrupted saves: ``fastpersist.clean(root)`` / ``fastpersist clean ROOT``.

A save that dies (``kill -9``, power loss) before it commits leaves, beside its target (the
names are :mod:`fastpersist.format.layout`'s):

* ``.{name}.fptmp-{id}``: the temporary checkpoint directory (partial data, maybe a manifest), or,
  when it died just after an atomic exchange, the replaced old checkpoint;
* ``{name}.{id}[.rN|.wN].fpstripe`` directories under each stripe root;
* ``.{file}.fptmp-{id}``: a file being replaced atomically (a :class:`Checkpointer` index or
  cost history, an ``fp.torch_save`` file, a Hugging Face export's shards, a converted
  safetensors file; :func:`fastpersist.format.layout.atomic_file`), up to the full size of what
  was being written; and ``.latest.json.tmp-*`` / ``.history.json.tmp-*`` of older versions.

On a memory root, the recycle directory ``.fprecycle/`` holds retired steps' data files kept for
a later save to overwrite (:mod:`fastpersist.saving.recycle`). It is garbage by construction
(nothing committed names it) and is emptied too; a save racing with that merely allocates fresh
pages.

The deletion rule: nothing is removed that is not provably a leftover of `root`.

* A temporary directory is removed only when no live save holds its lock
  (:mod:`fastpersist.format.ownership`), so a save running in another process is never touched.
* A stripe directory is removed only when its owner marker names a checkpoint of *this* root
  whose committed manifest carries another id (or that no longer exists) and whose save is not
  alive; or, with no marker (its save died before writing it), when a dead temporary directory
  of this root carries its name and id. Stripe roots shared with other roots, and ``cp -r``
  copies of checkpoints, are therefore safe.
* A committed checkpoint whose manifest cannot be read (an I/O error, a newer format) keeps
  every stripe directory that names it, with a WARNING.
* A temporary file is removed only when no live writer holds its lock (an older version's
  index temporary file: when the process that wrote it is gone).
* A directory ``.fpremoving-*`` in a stripe root is a stripe directory whose owner had proven
  it and started removing it (a crash cut that short); it is removed.

``Checkpointer`` runs this for its root and stripes before its first save (never for a read-only
use such as ``latest()`` or ``load()``). Every rank of a group runs it for its own stripe roots.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field

from .errors import FastPersistError
from .format.layout import INDEX_TMP, MANIFEST_NAME, dead_tmp_files, parse_stripe_dir, parse_tmp_dir, tmp_dir_for
from .format.manifest import read_manifest
from .format.ownership import REMOVING, cleaning, is_live, lock_state, read_owner, remove_owned_dir
from .saving.recycle import free_recycled, recycled_entries
from .saving.remover import wait_removed

__all__ = ["clean", "stripe_leftovers"]

log = logging.getLogger("fastpersist")

_UNREADABLE = "unreadable"


@dataclass
class _RootView:
    """What one pass of the cleaner learnt about `root` (under its cleaning lock)."""

    root: str
    real_root: str
    dead_tmp: dict[tuple[str, str], str] = field(default_factory=dict)  # (name, id12) -> path
    retired: dict[str, str] = field(default_factory=dict)  # name -> id of a step the group retired
    committed: dict[str, str | None] = field(default_factory=dict)  # name -> checkpoint id

    def committed_id(self, name: str, *, fresh: bool = False) -> str | None:
        """The checkpoint id committed at ``root/name``, None if none, or ``_UNREADABLE``."""
        if fresh or name not in self.committed:
            path = os.path.join(self.root, name)
            if not os.path.isfile(os.path.join(path, MANIFEST_NAME)):
                self.committed[name] = None
            else:
                try:
                    self.committed[name] = read_manifest(path).checkpoint_id
                except (FastPersistError, OSError) as e:
                    log.warning("clean: %s is damaged (%s); keeping every stripe directory named after it", path, e)
                    self.committed[name] = _UNREADABLE
        return self.committed[name]


def _is(path: str, kind: int) -> bool:
    """Whether `path` is (without following links) of file type `kind`; False once it is gone."""
    try:
        return stat.S_IFMT(os.lstat(path).st_mode) == kind
    except FileNotFoundError:
        return False  # removed or renamed by its own save since the listing


def _dead_tmp_dirs(view: _RootView) -> None:
    for name in sorted(os.listdir(view.root)):
        parsed = parse_tmp_dir(name)
        path = os.path.join(view.root, name)
        if parsed and _is(path, stat.S_IFDIR) and lock_state(path) == "dead":
            view.dead_tmp[parsed] = path


def _is_leftover(view: _RootView, path: str, name: str, id12: str) -> bool:
    """Whether the stripe directory `path` (named for checkpoint `name`, id `id12`) is a leftover of view.root."""
    owner = read_owner(path)
    if owner is None:
        # Its save died between mkdir and the marker: provable only through that save's dead temporary directory.
        return (name, id12) in view.dead_tmp
    parent, owner_name = os.path.split(owner.checkpoint)
    if parent != view.real_root or owner.checkpoint_id[:12] != id12:
        return False  # another root's (a shared drive), or a marker that does not match its name
    if view.committed_id(owner_name) in (owner.checkpoint_id, _UNREADABLE):
        return False
    if view.retired.get(owner_name) == owner.checkpoint_id:
        return True  # retired by rank 0 (its tree, held until deleted, looks like a live save's)
    if is_live(tmp_dir_for(os.path.join(view.root, owner_name), id12)):
        return False
    # The save may have committed between the two looks above (its rename is atomic): look again.
    return view.committed_id(owner_name, fresh=True) not in (owner.checkpoint_id, _UNREADABLE)


def _scan_stripes(view: _RootView, stripes: Sequence[str | os.PathLike[str]], names: set[str] | None) -> list[str]:
    found = []
    for stripe_root in stripes:
        base = os.path.abspath(os.fspath(stripe_root))
        try:
            entries = sorted(os.listdir(base))
        except FileNotFoundError:
            continue
        for entry in entries:
            path = os.path.join(base, entry)
            if REMOVING.match(entry):
                if _is(path, stat.S_IFDIR):
                    found.append(path)  # a removal that a crash cut short: its owner had proven it
                continue
            parsed = parse_stripe_dir(entry)
            if parsed is None or (names is not None and parsed[0] not in names):
                continue
            if _is(path, stat.S_IFDIR) and _is_leftover(view, path, *parsed):
                found.append(path)
    return found


def stripe_leftovers(
    root: str | os.PathLike[str],
    stripes: Sequence[str | os.PathLike[str]],
    *,
    names: set[str] | None = None,
    retired: dict[str, str] | None = None,
) -> list[str]:
    """Removes the stripe directories under `stripes` that are provably leftovers of `root`; returns them.

    `names` limits the search to checkpoints of those names (the old tree of a replaced
    checkpoint); `retired` (name -> checkpoint id) names the steps a group's rank 0 retired,
    whose stripe directories go (and only those).
    """
    root = os.path.abspath(os.fspath(root))
    view = _RootView(root=root, real_root=os.path.realpath(root), retired=dict(retired or {}))
    if retired is not None:
        names = set(retired)
    with cleaning(root):
        found = _scan_stripes(view, stripes, names)
    for path in found:
        _remove_stripe_dir(path)
    return found


def _remove_stripe_dir(path: str) -> None:
    if REMOVING.match(os.path.basename(path)):
        shutil.rmtree(path, ignore_errors=True)
    else:
        remove_owned_dir(path)


def _index_tmp_orphans(root: str) -> list[str]:
    found = []
    for name in sorted(os.listdir(root)):
        match = INDEX_TMP.match(name)
        path = os.path.join(root, name)
        if match and _is(path, stat.S_IFREG) and not _pid_alive(int(match.group(1))):
            found.append(path)
    return found


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean(
    root: str | os.PathLike[str],
    *,
    stripes: Sequence[str | os.PathLike[str]] | None = None,
    dry_run: bool = False,
) -> list[str]:
    """Removes what interrupted saves left in `root` (and under `stripes`); returns the paths.

    Args:
        root: the directory that holds the checkpoints (the parent of each checkpoint path,
            e.g. a :class:`Checkpointer` root).
        stripes: the stripe roots the saves used (``Config.stripes``); stripe directories are
            looked for, and deleted, only there.
        dry_run: list what would be removed without removing it.

    Only provable leftovers are removed (see the module docstring): a save in progress in any
    process, other roots' data on shared stripe roots, and copies of checkpoints are left alone.

    Example:
        >>> fp.clean("/tmp/fp-doc-runs")  # doctest: +SKIP
        ['/tmp/fp-doc-runs/.step-00000007.fptmp-1f2e3d4c5b6a']
    """
    wait_removed()  # this process's own removals finish first: they are not leftovers
    root = os.path.abspath(os.fspath(root))
    view = _RootView(root=root, real_root=os.path.realpath(root))
    with cleaning(root):
        _dead_tmp_dirs(view)
        dead_stripes = _scan_stripes(view, stripes or [], None)
        dead_files = dead_tmp_files(root)
        if not dry_run:
            for path in dead_files:  # under the lock: a new temporary file cannot take the name
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
    index_tmp = _index_tmp_orphans(root)
    recycled = recycled_entries(root)
    removed = [*view.dead_tmp.values(), *dead_files, *index_tmp, *dead_stripes, *recycled]
    if not dry_run:
        free_recycled(root)
        for path in dead_stripes:
            _remove_stripe_dir(path)
        for path in view.dead_tmp.values():
            shutil.rmtree(path, ignore_errors=True)
        for path in index_tmp:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    for path in removed:
        log.info("clean: %s %s", "would remove" if dry_run else "removed", path)
    return removed
