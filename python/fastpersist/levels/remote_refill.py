"""Refilling the local level from the remote one: a step every node lost comes back from the
remote store into each node's root, committed there as a local step, and is then restored like
one (a node reads its own shares from its own root again).

Who downloads what: with ``replicas`` (each node its own root), every rank downloads the
shares it owns into its node's temporary directory, and the node's leader writes the manifest
last and commits (each node then holds its ranks' shares; the next save replicates again); one
process, or a plain group save, rank 0 downloads everything. Every chunk is checked on the way
(:meth:`fastpersist.levels.remote_steps.RemoteSteps.download`); a failure on any rank fails the refill on
every rank and leaves nothing committed.

A refill writes into the root, so, like a save, it first removes what interrupted saves and
refills left there (:func:`fastpersist.clean`: a refill killed midway leaves its temporary
directory, named after the remote step's id, which would otherwise block every later refill of
that step). It commits by an atomic exchange: a step directory of that number already there (a
node's incomplete or damaged copy) is replaced, never collided with. The root's index is
written only where it has none (the run taken over from the remote: docs/levels.md); a root
that has one keeps it.
"""

from __future__ import annotations

import os
import shutil

import fastpersist._core as _core

from ..cleanup import clean
from ..distributed.control import agree, control_for
from ..errors import FastPersistError, GroupLoadError
from ..format.layout import MANIFEST_NAME, tmp_dir_for, write_new_file
from ..format.ownership import make_locked_dir
from ..saving.target import replace_as_last_writer
from .host import LevelHost, RootLevel
from .remote_steps import RemoteSteps, of_writers, owned_shares
from .run_identity import read_local_index

__all__ = ["refill_step"]


def refill_step(host: LevelHost, root: RootLevel, remote: RemoteSteps, step: int) -> None:
    """Every rank of `host`'s group (or the one process): brings `step` from `remote` into the
    roots of its root level `root`."""
    found = remote.manifest(step)
    if found is None:
        raise FileNotFoundError(f"{remote.path(step)} is not committed")
    raw, m = found
    control = None
    if host.group is not None:
        control = control_for(host.group, host.timeout_s)
    committer = root.committer()
    if root.per_rank_shares:
        downloads: list[int] | None = owned_shares(m, host.rank)
    else:
        downloads = None if committer else []
    tmp = tmp_dir_for(host.path(step), m.checkpoint_id)  # the same on every rank of a node
    lock = None
    error: BaseException | None = None
    try:
        if committer:
            host.removed_leftovers.extend(clean(host.root))  # a killed refill's temporary directory among them
            lock = make_locked_dir(tmp)
    except OSError as e:
        error = e
    agree(control, "make the temporary directories of a refill from the remote", error, raises=GroupLoadError)
    try:
        if downloads is None or downloads:
            files = remote.files(step, m, downloads if m.shards else None)
            if not m.shards and downloads is not None:
                files = of_writers(files, m, downloads)
            remote.download(step, tmp, files)
    except (FastPersistError, OSError) as e:
        error = e
    try:
        agree(control, "download every share of a refill from the remote", error, raises=GroupLoadError)
        error = None
        if committer:
            try:
                write_new_file(os.path.join(tmp, MANIFEST_NAME), raw, durable=True)
                _core.fsync_dir(tmp)
                replace_as_last_writer(tmp, host.path(step))  # a copy there before is now at `tmp`
                _core.fsync_dir(host.root)
                if read_local_index(host.root).step is None:
                    host.write_index(step)
            except OSError as e:
                error = e
        agree(control, "commit a step refilled from the remote", error, raises=GroupLoadError)
    finally:
        if lock is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            lock.release()
