"""Which save job a save runs: one process's (:class:`~fastpersist.saving.job.SaveJob`) or a
process group's (:class:`~fastpersist.saving.group.GroupSaveJob`), started on its own thread.
``fp.save``, ``fp.save_async`` and the ``Checkpointer`` all start their saves here;
:func:`save_blocking` is ``fp.save``'s whole save (and ``convert``'s), waited for.

Example:
    >>> import fastpersist as fp, torch
    >>> start_save({"w": torch.ones(2)}, "/tmp/fp-doc-start", fp.Config()).finish().path
    '/tmp/fp-doc-start'
"""

from __future__ import annotations

import errno
import os

import fastpersist._core as _core

from ..config import Config
from ..futures import SaveResult
from ..memory_level.spares import stop_spares
from .group import GroupSaveJob
from .incremental import Incremental
from .job import SaveJob
from .partner_copies import PartnerSaveJob
from .remover import removals_pending, wait_removed
from .target import make_parents

__all__ = ["save_blocking", "start_save"]


def start_save(
    state: object,
    path: str | os.PathLike[str],
    config: Config,
    *,
    group: object = None,
    sharded: bool = False,
    pool: _core.Pool | None = None,
    replicas: int = 0,
    blocking: bool = False,
    write_gate: _core.WriteGate | None = None,
    incremental: Incremental | None = None,
) -> SaveJob | GroupSaveJob:
    """Starts saving `state` to `path`: alone, or with every rank of `group` (``sharded``: each
    rank its own shard; ``replicas``: each node commits its own copy, and each share is also kept
    on `replicas` other nodes). `pool`: a staging pool to reuse (a Checkpointer's); else one per config.
    `blocking`: the caller waits for the save before it touches the state again (``fp.save``), so
    the small tensors that ``save_async`` copies before returning (docs/overlap.md) need no copy.
    `write_gate`: stage at once, write once the gate is opened (one process only). `state` may
    come flattened already (:func:`~fastpersist.saving.share_layout.flatten_to_save`).
    `incremental`: write only what changed since its base (one process only).
    Missing directories above `path` are created first (``mkdir -p``)."""
    stop_spares()  # a spare being made for a memory root's next save yields the cores to this one
    make_parents(os.fspath(path), durable=config.durable)
    # The engine always runs on its own thread, so that waiting for it can be interrupted.
    job: SaveJob | GroupSaveJob
    if write_gate is not None and (group is not None or sharded):
        raise ValueError("a save held back by a write gate must be one process's (no group, not sharded)")
    if incremental is not None and (group is not None or sharded):
        raise ValueError(
            f"incremental save of {os.fspath(path)}: one process's save only (not yet with group= or sharded)"
        )
    early_copy = not blocking
    if group is None and not sharded:
        job = SaveJob(path, config, pool=pool, early_copy=early_copy, write_gate=write_gate, incremental=incremental)
    elif replicas:
        job = PartnerSaveJob(path, config, group, sharded=sharded, replicas=replicas, pool=pool, early_copy=early_copy)
    else:
        job = GroupSaveJob(path, config, group, sharded=sharded, pool=pool, early_copy=early_copy)
    return job.start(state)


def save_blocking(
    state: object,
    path: str | os.PathLike[str],
    config: Config,
    *,
    group: object = None,
    sharded: bool = False,
    incremental: Incremental | None = None,
) -> SaveResult:
    """Saves `state` to `path` and waits until it is committed (``fp.save``). A process that runs
    out of space while replaced trees are still queued for deletion waits for them and tries once more."""
    try:
        return start_save(
            state, path, config, group=group, sharded=sharded, blocking=True, incremental=incremental
        ).finish()
    except OSError as e:
        # Replaced trees are deleted after their commit, in the background: on a disk that holds
        # little more than two checkpoints, the space this save lacks may be one still queued.
        # A group's ranks cannot retry one by one, so only a single process does.
        if e.errno != errno.ENOSPC or group is not None or not removals_pending():
            raise
    wait_removed()
    return start_save(state, path, config, sharded=sharded, blocking=True, incremental=incremental).finish()
