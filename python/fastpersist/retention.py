"""Retention for a :class:`~fastpersist.Checkpointer`: which steps go, and when it is safe to remove them.

The rules (docs/failure-model.md, "Deletion"):

* After step *s* commits, the steps older than *s* beyond the newest ``keep - 1`` of them are
  retired. Steps newer than *s* (another run's, in a reused root) are never retired by it.
* Nothing is retired until *s* is verified loadable: its manifests readable and every data file
  present with its recorded size. In a group each rank checks the files on its own drives and
  rank 0 checks that every file was checked by someone.
* Rank 0 removes the retired checkpoint directories (moved out of sight at once, deleted after
  the commit returns by :mod:`fastpersist.saving.remover`) and their stripe directories on its drives
  (on a memory root it recycles the newest one's data files instead, for the next save to
  overwrite in place: :mod:`fastpersist.memory_level.recycle`);
  then every other rank removes its own stripe directories of those steps, found by their
  owner markers (so per-rank drives on other nodes are cleaned by the rank that has them).

A collective that fails here (a rank died after the commit) skips retention with a WARNING: the
old steps stay, nothing committed is lost.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .distributed.control import control_for, forget_control
from .errors import FastPersistError
from .format.confine import data_file_problem, real_roots, under_roots
from .format.manifest import Manifest, read_manifest
from .memory_level.recycle import recycle_checkpoint
from .saving.leftovers import stripe_leftovers
from .saving.remover import remove_checkpoint_later, run_later

__all__ = ["ShareCheck", "check_share", "retire", "retire_in_group", "retired_steps"]

log = logging.getLogger("fastpersist")


def retired_steps(steps: Sequence[int], step: int, keep: int) -> list[int]:
    """The committed `steps` to remove once `step` has committed, keeping `keep` in all.

    Example:
        >>> retired_steps([1, 2, 3, 4, 98, 99], 4, 2)
        [1, 2]
    """
    older = sorted(s for s in steps if s < step)
    return older[: max(0, len(older) - (keep - 1))]


@dataclass
class ShareCheck:
    """What one rank found checking the files of a new step it can see."""

    checked: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    expected: list[str] = field(default_factory=list)


def _manifests(path: str) -> list[tuple[str, Manifest]]:
    top = read_manifest(path)
    found = [(path, top)]
    for shard in top.shards:
        shard_dir = os.path.join(path, shard)
        found.append((shard_dir, read_manifest(shard_dir)))
    return found


def check_share(path: str, stripe_roots: Sequence[str | os.PathLike[str]] | None, *, checks_dir: bool) -> ShareCheck:
    """Checks the data files of the checkpoint at `path` that lie on this rank's drives.

    A file is this rank's to check when its stripe directory sits in one of `stripe_roots`, or,
    with `checks_dir`, when it lies in the checkpoint directory itself (rank 0).
    """
    roots = real_roots(stripe_roots) or set()
    result = ShareCheck()
    try:
        manifests = _manifests(path)
    except (FastPersistError, OSError) as e:
        result.problems.append(f"{path}: {e}")
        return result
    for where, m in manifests:
        for entry in m.files:
            file_path = m.file_path(where, entry)
            result.expected.append(file_path)
            mine = under_roots(os.path.dirname(file_path), roots) if entry.stripe is not None else checks_dir
            if not mine:
                continue
            result.checked.append(file_path)
            try:
                problem = data_file_problem(where, file_path, entry.len_bytes)
            except OSError as e:
                problem = f"{file_path}: {e.strerror}"
            if problem:
                result.problems.append(problem)
    return result


def _verdict(path: str, checks: Sequence[ShareCheck]) -> str:
    """Empty if the new step at `path` is loadable by what `checks` saw, else why not."""
    problems = [p for c in checks for p in c.problems]
    if problems:
        return "; ".join(problems[:3])
    unchecked = sorted(set(checks[0].expected) - {p for c in checks for p in c.checked})
    if unchecked:
        return f"{len(unchecked)} data files were checked by no rank (e.g. {unchecked[0]})"
    return ""


def retire(
    root: str,
    step_path: str,
    candidates: Sequence[str],
    stripe_roots: Sequence[str | os.PathLike[str]] | None,
    *,
    rank: int,
    all_gather: Callable[[Any], list[Any]] | None = None,
    broadcast: Callable[[Any], Any] | None = None,
) -> list[str]:
    """Removes the checkpoints `candidates` once the new one at `step_path` is verified; returns them.

    Every rank calls it with the same arguments but its own stripe roots; `all_gather` and
    `broadcast` (from rank 0) are the group's collectives, None alone.
    """
    check = check_share(step_path, stripe_roots, checks_dir=rank == 0)
    checks = all_gather(check) if all_gather is not None else [check]
    removed: list[str] = []
    ids: dict[str, str] = {}
    if rank == 0:
        why = _verdict(step_path, checks)
        if why and candidates:
            log.warning("keeping %s: the new checkpoint %s does not verify yet (%s)", list(candidates), step_path, why)
        else:
            removed = list(candidates)
        ids = _checkpoint_ids(removed)
        # On a memory root the newest retired step's files are recycled for the next save; the
        # older ones (and anything not recyclable) are deleted.
        recycled = bool(removed) and recycle_checkpoint(root, removed[-1])  # candidates: oldest first
        for path in removed[:-1] if recycled else removed:
            remove_checkpoint_later(path, stripe_roots)
    if broadcast is not None:
        removed, ids = broadcast((removed, ids))
        if rank != 0 and ids and stripe_roots:
            run_later(stripe_leftovers, root, stripe_roots, retired=ids)
    return removed


def _checkpoint_ids(paths: Sequence[str]) -> dict[str, str]:
    """Name -> checkpoint id of each of `paths` whose manifest reads (the others' stripe
    directories stay for ``clean``, which proves them leftovers once their tree is gone)."""
    ids = {}
    for path in paths:
        try:
            ids[os.path.basename(path)] = read_manifest(path).checkpoint_id
        except (FastPersistError, OSError):
            pass
    return ids


def retire_in_group(root: str, kept: str, candidates: list[str], config: Any, group: object, rank: int) -> None:
    """:func:`retire` on every rank of `group`, agreeing over its control group; if the group
    stops answering, this retention is skipped (logged) and the next commit's tries again."""

    control = control_for(group, config.timeout_s)
    try:
        retire(
            root,
            kept,
            candidates,
            config.stripes,
            rank=rank,
            all_gather=control.all_gather,
            broadcast=control.broadcast,
        )
    except Exception as e:
        forget_control(control)
        log.warning("retention after %s skipped on rank %d (the group stopped answering): %s", kept, rank, e)
