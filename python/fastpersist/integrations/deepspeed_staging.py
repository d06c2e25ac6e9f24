"""A re-saved DeepSpeed tag's staging directory (:mod:`fastpersist.integrations.deepspeed`).

A tag saved again (``save_checkpoint(dir, tag="last")`` each time) is never overwritten in place
while ``latest`` may name it: when its directory exists at the save's start, the ranks agree
(:func:`open_staging`) on a staging directory beside it, a hidden fastpersist temporary directory
held under ``flock`` by the rank that made it; the engine saves the tag's files there
(:meth:`TagStaging.redirect`), and its commit, once every rank's files are durable and the ranks
agreed, exchanges it with the tag's directory atomically (:meth:`TagStaging.swap_in`). A dead
one (its save killed) is removed by the next save (:func:`remove_dead_stagings`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import uuid

import fastpersist._core as _core

from ..distributed.control import ControlGroup, agree, collective
from ..errors import GroupSaveError
from ..format.layout import tmp_dir_for
from ..format.ownership import DirLock, cleaning, make_locked_dir
from ..saving.leftovers import RootView, find_dead_tmp_dirs
from ..saving.remover import run_later

__all__ = ["TagStaging", "open_staging", "remove_dead_stagings"]

log = logging.getLogger("fastpersist")


@dataclasses.dataclass
class TagStaging:
    """Where a re-saved tag's new files go until the commit: `path`, named as the tag, inside
    `holder`, a hidden temporary directory beside the tag's, whose `lock` (not `path`'s: a file
    written in `path` takes a shared lock on it) the rank of a filesystem view that made it holds."""

    tag_dir: str
    holder: str
    lock: DirLock | None = None
    #: Why this rank could not make the staging directory of its view: raised by the commit.
    error: OSError | None = None

    @property
    def path(self) -> str:
        return os.path.join(self.holder, os.path.basename(self.tag_dir))

    def make(self) -> None:
        """Makes `holder`, locked, and `path` in it; FileExistsError if another rank of this view did."""
        self.lock = make_locked_dir(self.holder)
        try:
            os.mkdir(self.path)
        except OSError:
            self.discard()
            raise

    def redirect(self, path: str) -> str:
        """`path` under the staging directory if it lies in the tag's directory, else `path`."""
        rel = os.path.relpath(os.path.abspath(path), self.tag_dir)
        if rel == os.curdir:
            return self.path
        if rel == os.pardir or rel.startswith(os.pardir + os.sep):
            return path
        return os.path.join(self.path, rel)

    def swap_in(self, *, durable: bool) -> None:
        """Puts the staging directory at the tag's place in one atomic exchange (this view's swapper only)."""
        lock, self.lock = self.lock, None
        if lock is None:
            return
        try:
            _core.replace_atomically(self.path, self.tag_dir)  # the old tree, if any, is now at `path`
            if durable:
                _core.fsync_dir(os.path.dirname(self.tag_dir))
        except BaseException:
            _remove_tree(self.holder, lock)
            raise
        run_later(_remove_tree, self.holder, lock)  # held until deleted: a cleaner elsewhere sees a live save

    def discard(self) -> None:
        """Removes the staging directory (its maker only): the tag keeps its old files."""
        lock, self.lock = self.lock, None
        if lock is not None:
            _remove_tree(self.holder, lock)


def _remove_tree(path: str, lock: DirLock | None) -> None:
    try:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        if lock is not None:
            lock.release()


def remove_dead_stagings(parent: str) -> None:
    """Removes the staging directories in `parent` that no live process holds (a killed save's)."""
    if not os.path.isdir(parent):
        return
    view = RootView(root=parent, real_root=os.path.realpath(parent))
    try:
        with cleaning(parent):
            find_dead_tmp_dirs(view)
    except OSError as e:
        log.warning("could not look for dead staging directories in %s: %s", parent, e)
        return
    for path in view.dead_tmp.values():
        log.info("removing %s, the staging directory of a DeepSpeed save that did not finish", path)
        shutil.rmtree(path, ignore_errors=True)


def open_staging(control: ControlGroup, save_dir: str, tag: str) -> TagStaging | None:
    """On every rank, at a save's start: a staging directory for tag `tag` if any rank sees its
    directory in `save_dir` already (a re-save), else None. Rank 0 makes it first; a rank that
    then cannot see it (another node's own storage) makes one for its view. Raises an error on
    every rank if rank 0 could not make it.

    Ranks that name different tags get None: each writes its own tag's files in place, as
    DeepSpeed does. Its ``checkpoint.tag_validation``, checked next, decides whether the save
    goes on ("Warn", its default, and "Ignore") or fails ("Fail": an AssertionError on every rank)."""
    tag_dir = os.path.abspath(os.path.join(save_dir, tag))
    parent, consequence = os.path.dirname(tag_dir), f"; tag {tag!r} was not saved"
    if control.rank == 0:
        remove_dead_stagings(parent)
    mine = (uuid.uuid4().hex, tag, os.path.isdir(tag_dir))
    what = f"agree whether tag {tag!r} is saved again"
    seen = collective(control, what, lambda: control.all_gather(mine), GroupSaveError, consequence)
    if len({t for _, t, _ in seen}) > 1:
        if control.rank == 0:
            msg = "the ranks save different tags at once (%s): not staged; %r will name rank 0's"
            log.warning(msg, [t for _, t, _ in seen], "latest")
        return None
    if not any(exists for _, _, exists in seen):
        return None
    staging = TagStaging(tag_dir, tmp_dir_for(tag_dir, seen[0][0]))
    error: OSError | None = None
    if control.rank == 0:
        try:
            staging.make()
        except OSError as e:
            error = e
    agree(control, f"make tag {tag!r}'s staging directory {staging.holder}", error, consequence)
    if control.rank != 0 and not os.path.isdir(staging.holder):  # not rank 0's filesystem
        remove_dead_stagings(parent)
        try:
            staging.make()
        except FileExistsError:
            pass  # made by another rank of this view, which swaps it in
        except OSError as e:
            staging.error = e
    return staging
