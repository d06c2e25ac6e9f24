"""What a level sees of the :class:`~fastpersist.Checkpointer` it is attached to, and what the
Checkpointer asks of its levels: typed protocols, so that neither reads the other's privates.

* :class:`LevelHost`: the Checkpointer as its levels see it (its root, rank, group and config,
  the step paths and steps, the index, the saves in flight, the last result, the run id).
* :class:`RootLevel`: the level that keeps the root's own steps: the local level
  (:class:`~fastpersist.levels.local_level.LocalLevel`), or the partner level
  (:class:`~fastpersist.levels.partner_level.PartnerLevel`), which also keeps copies of other
  nodes' shares there. Exactly one per Checkpointer: it cleans the root, commits the index and
  retires old steps, says which step to restore and restores it.
* :class:`CommittedStepCopies`: a level that copies committed steps elsewhere in the background
  (the remote drain, the Hugging Face export); :class:`RestoringCopies` one that can also be
  restored from (the remote level).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from ..advisor.history import SaveHistory
from ..advisor.multilevel import Failures
from ..config import Config
from ..distributed.control import control_for
from ..futures import SaveResult
from ..saving.in_flight import InFlight
from .local_steps import LocalSteps
from .run_identity import LocalIdentity

__all__ = ["CommittedStepCopies", "LevelHost", "RestoringCopies", "RootLevel", "gathered"]


class LevelHost(Protocol):
    """The Checkpointer, as its levels see it."""

    root: str
    rank: int
    group: object
    config: Config | None
    #: Copies of each rank's share kept on other nodes (0: no partner level).
    replicas: int
    failures: Failures | None
    history: SaveHistory
    #: The root's committed steps, its index, the newest step that verifies.
    local: LocalSteps
    #: The saves started and not yet seen through (the newest one: ``in_flight.newest()``).
    in_flight: InFlight
    #: What cleaning the root removed (a refill cleans it too).
    removed_leftovers: list[str]
    #: This root's run id (:mod:`fastpersist.levels.run_identity`), set at the first commit or
    #: taken over from the remote level by a restore.
    run: str | None
    #: The result of the newest committed save (None before one).
    last_result: SaveResult | None

    @property
    def every(self) -> int: ...

    @property
    def timeout_s(self) -> float:
        """The group's agreement timeout (the config's)."""
        ...

    def path(self, step: int) -> str: ...

    def steps(self) -> list[int]: ...

    def write_index(self, step: int) -> None:
        """Replaces the root's index (``latest.json``) with one naming `step`, durably."""
        ...


class RootLevel(Protocol):
    """The level that keeps the root's own steps (see the module docstring)."""

    #: Whether each rank downloads its own shares in a refill (the partner level), or the
    #: committer all of them (the local level).
    per_rank_shares: bool

    def clean(self) -> list[str]:
        """Removes this rank's part of what interrupted saves left (every rank calls it)."""
        ...

    def committer(self) -> bool:
        """Whether this rank writes the root's index and commits a refill."""
        ...

    def after_commit(self, step: int, result: SaveResult, candidates: list[str]) -> None:
        """Once `step` committed on every rank: the index, then retiring `candidates`."""
        ...

    def latest(self) -> int | None:
        """The newest step this level restores (collective in a group)."""
        ...

    def holds(self, step: int) -> bool:
        """Whether this level can restore `step` (collective in a group)."""
        ...

    def load(self, step: int | None, out: object, map_location: Any, namedtuple_types: Iterable[type]) -> Any:
        """Restores `step` (None: :meth:`latest`)."""
        ...

    def levels(self) -> dict[str, Any]:
        """What this rank's node holds here: ``{"local": {...}}`` (and ``"partner"``)."""
        ...


class CommittedStepCopies(Protocol):
    """A level that copies committed steps elsewhere in the background; the Checkpointer calls
    these in this order: :meth:`before_save` as a due step's save starts, :meth:`pinned` when
    retention chooses what to retire, :meth:`after_commit` once a step committed (after the root
    level holds it), :meth:`levels` from ``Checkpointer.levels()``, :meth:`close` from
    ``Checkpointer.close()``."""

    def before_save(self) -> None: ...

    def pinned(self) -> set[int]:
        """Local steps this level still reads (retention keeps them)."""
        ...

    def after_commit(self, step: int) -> None: ...

    def levels(self) -> dict[str, Any]:
        """What this level holds, under its name (empty: nothing to report)."""
        ...

    def close(self) -> None:
        """Waits for the copy in flight; raises the newest failure nobody has seen."""
        ...


@runtime_checkable
class RestoringCopies(CommittedStepCopies, Protocol):
    """A level of copies that a restore can take a step from (the remote level)."""

    def choose(self, local: LocalIdentity, above: int | None = None) -> Any:
        """The step to restore from here, newer than `above`, or None (collective)."""
        ...

    def holds(self, step: int) -> bool: ...

    def refill(self, step: int, root: RootLevel) -> None:
        """Brings `step` into the root level's roots, where it then loads as a local step."""
        ...


def gathered(host: LevelHost, mine: Any) -> list[Any]:
    """`mine` from every rank of `host`'s group, by rank (one process: ``[mine]``)."""
    if host.group is None:
        return [mine]

    return control_for(host.group, host.timeout_s).all_gather(mine)
