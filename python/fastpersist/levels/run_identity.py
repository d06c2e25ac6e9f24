"""Which run a step belongs to, on every level: a run never restores another run's steps, nor
the steps it abandoned by rolling back.

A :class:`~fastpersist.Checkpointer` root's index (``latest.json``) names the step its run last
committed and the run's id (``"run"``: drawn at the root's first commit and kept by every later
one; taken from the remote level when a root with no index is refilled from it). The remote
level's index names the step last drained there, the run that drained it and that run's
*lineage*: the remote steps, with their checkpoint ids, that its drains committed one after the
other. Each drain keeps, from the previous index of the same run, the lineage's steps below its
own; so after a rollback (the run loading step 3 and saving 4, 5, ... again) the first drain
starts a lineage below the abandoned steps, which are never part of it.

A restore takes a remote step only if

* it is in the remote index's lineage and committed there with the lineage's checkpoint id (a
  step number another checkpoint took since is not it);
* it is not above the step the local level's index names (the highest any node's index names):
  a step above it is another run's, or this run's abandoned future, as on the local level;
* the remote's run is this root's run. With no index on any node (every node lost, or a fresh
  root), the remote's run is taken over, and a WARNING says so and which run it is.

An index written before lineages (no ``"run"``) is followed as before: the remote steps up to
the step it names.

Example:
    >>> previous = RemoteIndex(step=7, checkpoint_id="a7", run="r", lineage={7: "a7", 6: "a6"})
    >>> lineage_for(previous, "r", 4, "b4", {6: "a6", 7: "a7"})   # a rollback to 3, then 4
    {4: 'b4'}
    >>> lineage_for(RemoteIndex(4, "b4", "r", {4: "b4"}), "r", 5, "b5", {4: "b4", 6: "a6", 7: "a7"})
    {5: 'b5', 4: 'b4'}
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from ..format.layout import INDEX_NAME, read_small_file, step_dir_name

__all__ = [
    "LocalIdentity",
    "LocalIndex",
    "RemoteIndex",
    "RemoteVerdict",
    "judge_remote",
    "lineage_for",
    "read_local_index",
    "remote_retention",
]

log = logging.getLogger("fastpersist")


@dataclass(frozen=True)
class LocalIndex:
    """What one root's index says: the step its run last committed and the run's id."""

    step: int | None
    run: str | None


def read_local_index(root: str) -> LocalIndex:
    """The index of the Checkpointer root `root` (an unreadable one is logged and counts as none)."""
    path = os.path.join(root, INDEX_NAME)
    try:
        doc = json.loads(read_small_file(path, limit_bytes=1 << 16))
    except FileNotFoundError:
        return LocalIndex(None, None)
    except (OSError, ValueError) as e:
        log.warning("ignoring the unreadable index %s: %s", path, e)
        return LocalIndex(None, None)
    if not isinstance(doc, dict):
        log.warning("ignoring the index %s: not a JSON object", path)
        return LocalIndex(None, None)
    step, run = doc.get("step"), doc.get("run")
    if type(step) is not int or step < 0:
        log.warning("ignoring the index %s: no valid step in it", path)
        return LocalIndex(None, None)
    return LocalIndex(step, run if isinstance(run, str) and run else None)


@dataclass(frozen=True)
class LocalIdentity:
    """The local level's identity over every rank's root: the highest step an index names (the
    cap) and the runs the indexes name."""

    cap: int | None
    runs: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def of(cls, indexes: list[LocalIndex]) -> LocalIdentity:
        steps = [i.step for i in indexes if i.step is not None]
        return cls(max(steps) if steps else None, frozenset(i.run for i in indexes if i.run))


@dataclass(frozen=True)
class RemoteIndex:
    """The remote level's index: the step last drained, its checkpoint id, the run that drained
    it and its lineage (step -> checkpoint id; None for an index written before lineages)."""

    step: int
    checkpoint_id: str | None
    run: str | None
    lineage: dict[int, str] | None

    @classmethod
    def parse(cls, raw: bytes | None) -> RemoteIndex | None:
        """The index from its bytes; None when there is none or it is not one (then no lineage)."""
        try:
            doc = json.loads(raw or b"null")
        except ValueError:
            return None
        if not isinstance(doc, dict) or type(doc.get("step")) is not int:
            return None
        lineage = doc.get("lineage")
        steps: dict[int, str] | None = None
        if isinstance(lineage, dict):
            steps = {int(k): v for k, v in lineage.items() if str(k).isdigit() and isinstance(v, str)}
        run, cid = doc.get("run"), doc.get("checkpoint_id")
        return cls(
            doc["step"], cid if isinstance(cid, str) else None, run if isinstance(run, str) and run else None, steps
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "path": step_dir_name(self.step),
            "checkpoint_id": self.checkpoint_id,
            "run": self.run,
            "lineage": {str(k): v for k, v in sorted((self.lineage or {}).items(), reverse=True)},
        }


def lineage_for(
    previous: RemoteIndex | None, run: str | None, step: int, checkpoint_id: str, committed: dict[int, str]
) -> dict[int, str]:
    """The lineage once `step` (`checkpoint_id`) of `run` is committed on the remote, newest
    first: the step, and the steps below it of the previous index's lineage if that index is the
    same run's, each still `committed` (step -> checkpoint id) with its recorded id. An index
    from before lineages hands on the committed steps below `step` up to the one it names."""
    found = {step: checkpoint_id}
    if previous is None:
        return found
    if previous.lineage is None:
        older = {s: cid for s, cid in committed.items() if s < step and s <= previous.step}
    elif previous.run == run:
        older = {s: cid for s, cid in previous.lineage.items() if s < step and committed.get(s) == cid}
    else:
        older = {}
    found.update(sorted(older.items(), reverse=True))
    return found


def remote_retention(
    lineage: dict[int, str], committed: list[int], step: int, keep: int
) -> tuple[dict[int, str], list[int]]:
    """After `step` committed with `lineage`: the lineage kept (its newest `keep` steps) and the
    committed remote steps to retire (those older than `step` that it does not keep: the
    lineage's oldest, abandoned ones, another run's). Steps above `step` are never retired."""
    kept = dict(sorted(lineage.items(), reverse=True)[:keep])
    return kept, [s for s in committed if s < step and s not in kept]


@dataclass
class RemoteVerdict:
    """What the rule allows a restore to take from the remote level."""

    #: (step, checkpoint id or None: an index before lineages), newest first, each above `above`.
    candidates: list[tuple[int, str | None]] = field(default_factory=list)
    #: The remote's run when it is not this root's (nothing is taken), else None.
    foreign_run: str | None = None
    #: The remote's run, taken over by a root that has none (no index anywhere).
    adopted_run: str | None = None
    #: Committed remote steps passed over because they are above the local index's step.
    above_cap: list[int] = field(default_factory=list)
    #: Every committed remote step, oldest first (for messages).
    committed: list[int] = field(default_factory=list)


def judge_remote(
    local: LocalIdentity, index: RemoteIndex | None, committed: list[int], above: int | None
) -> RemoteVerdict:
    """Applies the rule (module docstring) to the remote's index and committed steps."""
    verdict = RemoteVerdict(committed=sorted(committed))
    if index is None:
        return verdict
    if index.run is not None and local.runs and index.run not in local.runs:
        verdict.foreign_run = index.run
        return verdict
    if index.run is not None and not local.runs and local.cap is None:
        verdict.adopted_run = index.run
    if index.lineage is not None:
        steps: list[tuple[int, str | None]] = sorted(index.lineage.items(), reverse=True)
    else:
        steps = [(s, None) for s in sorted(committed, reverse=True) if s <= index.step]
    verdict.above_cap = [s for s in committed if local.cap is not None and s > local.cap]
    for s, cid in steps:
        if above is not None and s <= above:
            break
        if local.cap is not None and s > local.cap:
            continue
        if s in committed:
            verdict.candidates.append((s, cid))
    return verdict
