"""Which stripe and temporary directories are provably leftovers of a checkpoint root, and
removing them: the deletion rule (docs/failure-model.md, "Deletion").

A group save removes a replaced checkpoint's stripe directories on its ranks' drives with it
(:mod:`.group`), retention a retired step's (:mod:`fastpersist.retention`), the
``Checkpointer`` every leftover of its root before its first save, and ``fastpersist.clean``
(:mod:`fastpersist.cleanup`) all that interrupted saves left. The rule, under the root's
cleaning lock (:func:`fastpersist.format.ownership.cleaning`):

* A temporary directory is a leftover only when no live save holds its lock
  (:mod:`fastpersist.format.ownership`), so a save running in another process is never touched.
* A stripe directory is a leftover only when its owner marker names a checkpoint of *this* root
  whose committed manifest carries another id (or that no longer exists) and whose save is not
  alive; or, with no marker (its save died before writing it), when a dead temporary directory
  of this root carries its name and id. Stripe roots shared with other roots, and ``cp -r``
  copies of checkpoints, are therefore safe.
* A committed checkpoint whose manifest cannot be read (an I/O error, a newer format) keeps
  every stripe directory that names it, with a WARNING.
* A directory ``.fpremoving-*`` in a stripe root is a stripe directory whose owner had proven
  it and started removing it (a crash cut that short); it is a leftover.

Example:
    >>> stripe_leftovers("/tmp/fp-doc-runs", ["/tmp/fp-doc-nvme0"])  # doctest: +SKIP
    ['/tmp/fp-doc-nvme0/step-00000007.1f2e3d4c5b6a.fpstripe']
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import FastPersistError
from ..format.layout import MANIFEST_NAME, parse_stripe_dir, parse_tmp_dir, tmp_dir_for
from ..format.manifest import read_manifest
from ..format.ownership import REMOVING, cleaning, is_live, lock_state, read_owner, remove_owned_dir

__all__ = [
    "RootView",
    "find_dead_tmp_dirs",
    "find_stripe_leftovers",
    "has_type",
    "remove_stripe_dir",
    "stripe_leftovers",
]

log = logging.getLogger("fastpersist")

_UNREADABLE = "unreadable"


@dataclass
class RootView:
    """What one look at `root` learnt under its cleaning lock: dead temporary directories and ids."""

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


def has_type(path: str, kind: int) -> bool:
    """Whether `path` is (without following links) of file type `kind`; False once it is gone."""
    try:
        return stat.S_IFMT(os.lstat(path).st_mode) == kind
    except FileNotFoundError:
        return False  # removed or renamed by its own save since the listing


def find_dead_tmp_dirs(view: RootView) -> None:
    """Records in `view` the temporary directories of its root that no live save holds."""
    for name in sorted(os.listdir(view.root)):
        parsed = parse_tmp_dir(name)
        path = os.path.join(view.root, name)
        if parsed and has_type(path, stat.S_IFDIR) and lock_state(path) == "dead":
            view.dead_tmp[parsed] = path


def _is_leftover(view: RootView, path: str, name: str, id12: str) -> bool:
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


def find_stripe_leftovers(
    view: RootView, stripes: Sequence[str | os.PathLike[str]], names: set[str] | None
) -> list[str]:
    """The stripe directories under `stripes` that are provably leftovers of view.root (of
    checkpoints named in `names`, when given), and the removals a crash cut short."""
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
                if has_type(path, stat.S_IFDIR):
                    found.append(path)  # a removal that a crash cut short: its owner had proven it
                continue
            parsed = parse_stripe_dir(entry)
            if parsed is None or (names is not None and parsed[0] not in names):
                continue
            if has_type(path, stat.S_IFDIR) and _is_leftover(view, path, *parsed):
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
    view = RootView(root=root, real_root=os.path.realpath(root), retired=dict(retired or {}))
    if retired is not None:
        names = set(retired)
    with cleaning(root):
        found = find_stripe_leftovers(view, stripes, names)
    for path in found:
        remove_stripe_dir(path)
    return found


def remove_stripe_dir(path: str) -> None:
    """Removes a stripe directory found a leftover: renamed out of the way first (see
    :func:`~fastpersist.format.ownership.remove_owned_dir`), or finished when it already was."""
    if REMOVING.match(os.path.basename(path)):
        shutil.rmtree(path, ignore_errors=True)
    else:
        remove_owned_dir(path)
