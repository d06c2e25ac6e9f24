"""Where a :class:`~fastpersist.Checkpointer` resumes from, over its levels: the step
:meth:`~fastpersist.Checkpointer.latest` names, whether it comes from the remote level (then it
is refilled into the local roots before the load), and the run id the root's index carries
(:mod:`fastpersist.levels.run_identity`). Every function is collective in a group.
"""

from __future__ import annotations

import secrets
from typing import Any

from .host import LevelHost, RestoringCopies, RootLevel, gathered
from .remote_level import RemoteChoice
from .run_identity import LocalIdentity, read_local_index

__all__ = ["bring_in", "local_identity", "restore_point", "run_id"]


def run_id(host: LevelHost) -> str:
    """The run id of `host`'s root: the one an index names (the lowest rank's that has one),
    else a new one (drawn by rank 0)."""
    found = gathered(host, (read_local_index(host.root).run, secrets.token_hex(8)))
    named = [run for run, _ in found if run]
    return str(named[0] if named else found[0][1])


def local_identity(host: LevelHost) -> LocalIdentity:
    """The local level's identity over every rank's root."""
    return LocalIdentity.of(gathered(host, read_local_index(host.root)))


def restore_point(host: LevelHost, root: RootLevel, far: RestoringCopies | None) -> tuple[int | None, Any]:
    """(the step to restore, the :class:`~fastpersist.levels.remote_level.RemoteChoice` when it
    comes from the level of copies `far`, else None). `far` is not asked while the root level
    holds the step its index names: no remote step may be newer."""
    if host.group is not None:
        host.in_flight.finish_all()  # its commit thread's collectives (retention, the run id) come first
    local = root.latest()
    if far is None:
        return local, None
    identity = local_identity(host)
    if local is not None and identity.cap is not None and local >= identity.cap:
        return local, None
    chosen = far.choose(identity, above=local)
    return (local, None) if chosen is None else (chosen.step, chosen)


def bring_in(host: LevelHost, root: RootLevel, far: RestoringCopies, step: int | None) -> int | None:
    """The step :meth:`~fastpersist.Checkpointer.load` loads (`step`, or the restore point),
    refilled from `far` first when the root level cannot restore it. An explicit `step` is an
    explicit choice: taken from `far` whatever run drained it."""
    if step is None:
        step, chosen = restore_point(host, root, far)
    else:
        if host.group is not None:
            host.in_flight.finish_all()
        chosen = None if root.holds(step) or not far.holds(step) else RemoteChoice(step)
    if chosen is not None:
        if host.run is None and chosen.adopted_run is not None:
            host.run = chosen.adopted_run  # a root with no index takes over the remote's run
        far.refill(chosen.step, root)  # then loaded as a local step
    return step
