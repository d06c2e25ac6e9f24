"""Where a :class:`~fastpersist.Checkpointer` resumes from, over its levels: the step
:meth:`~fastpersist.Checkpointer.latest` names, whether it comes from the remote level (then it
is refilled into the local roots before the load), and the run id the root's index carries
(:mod:`fastpersist.levels.run_identity`). Every function is collective in a group.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from ..distributed.control import control_for
from ..format.layout import MANIFEST_NAME
from .remote_level import RemoteChoice
from .run_identity import LocalIdentity, read_local_index

__all__ = ["bring_in", "held_locally", "local_identity", "restore_point", "run_id"]


def _gathered(ck: Any, mine: Any) -> list[Any]:
    if ck.group is None:
        return [mine]

    return control_for(ck.group, ck._timeout_s()).all_gather(mine)


def run_id(ck: Any) -> str:
    """The run id of `ck`'s root: the one an index names (the lowest rank's that has one), else
    a new one (drawn by rank 0)."""
    found = _gathered(ck, (read_local_index(ck.root).run, secrets.token_hex(8)))
    named = [run for run, _ in found if run]
    return str(named[0] if named else found[0][1])


def local_identity(ck: Any) -> LocalIdentity:
    """The local level's identity over every rank's root."""
    return LocalIdentity.of(_gathered(ck, read_local_index(ck.root)))


def restore_point(ck: Any) -> tuple[int | None, Any]:
    """(the step to restore, the :class:`~fastpersist.levels.remote_level.RemoteChoice` when it
    comes from the remote level, else None). The remote is not asked while the local (or partner)
    level holds the step its index names: no remote step may be newer."""
    if ck.group is not None:
        ck._saves.finish_all()  # its commit thread's collectives (retention, the run id) come first
    local = ck._partner.latest() if ck._partner is not None else ck.local.latest()
    if ck._remote is None:
        return local, None
    identity = local_identity(ck)
    if local is not None and identity.cap is not None and local >= identity.cap:
        return local, None
    chosen = ck._remote.choose(identity, above=local)
    return (local, None) if chosen is None else (chosen.step, chosen)


def held_locally(ck: Any, step: int) -> bool:
    """Whether the local (and partner) level can restore `step`."""
    if ck.group is not None:
        ck._saves.finish_all()
    if ck._partner is not None:
        return bool(ck._partner.holds(step))
    return all(_gathered(ck, os.path.exists(os.path.join(ck.path(step), MANIFEST_NAME))))


def bring_in(ck: Any, step: int | None) -> int | None:
    """The step :meth:`~fastpersist.Checkpointer.load` loads (`step`, or the restore point),
    refilled from the remote level first when no local copy holds it. An explicit `step` is an
    explicit choice: taken from the remote whatever run drained it."""
    if step is None:
        step, chosen = restore_point(ck)
    else:
        chosen = None if held_locally(ck, step) or not ck._remote.holds(step) else RemoteChoice(step)
    if chosen is not None:
        if ck._run is None and chosen.adopted_run is not None:
            ck._run = chosen.adopted_run  # a root with no index takes over the remote's run
        ck._remote.refill(chosen.step)  # then loaded as a local step
    return step
