"""NVIDIA Resiliency Extension local checkpoints, each rank's stored by fastpersist.

NVRx's local checkpointing (what Megatron-LM uses for its node-local level) drives a
``BaseCheckpointManager``: ``save(state_dict, iteration)`` on every rank, ``find_latest()``
(the newest iteration every rank holds), ``load()``. Its stock ``LocalCheckpointManager``
writes each rank's ``TensorAwareStateDict`` with one ``torch.save``: no checksum, so a damaged
file on a node's SSD is loaded as if it were good. :class:`FastPersistLocalCheckpointManager`
implements the same five methods with fastpersist underneath, and tags each checkpoint with
the job run that wrote it:

* ``_save``: the state dict's tensors (``pop_tensors``) go through the engine (aligned writes,
  crc32c per chunk, fsync, manifest last, atomic rename), beside the pickled hollow state
  (its non-tensor values and tensor placeholders) and the run's tag; the tensors are put back
  before returning. A checkpoint appears under its name only once complete and durable, so
  ``find_latest`` never counts a half-written one (the stock manager renames a ``.dirty`` file
  for this). An existing checkpoint of the same id (a stale one, left by a rank that died
  ahead of the others) is replaced atomically, as the stock manager renames over its file: a
  kill during the save leaves the old one or the new one, whole.
* ``_load``: every byte read is checked; a damaged checkpoint raises NVRx's
  ``CheckpointingException`` (what its ``load`` expects of a failed ``_load``) naming the
  file and byte range, with fastpersist's ``ChecksumMismatchError`` as its ``__cause__``.
* ``_my_ckpt_ids`` lists the committed checkpoints of this rank's directory (replicas of
  other ranks' included, as NVRx's replication stores them there);
* ``_cleanup`` removes those older than the iteration just saved, ``_cleanup_failed_save``
  those of the failed iteration; both also remove what interrupted saves left
  (``fastpersist.clean``), so the next save's finalize cleans a killed save's leftovers.

``save`` and ``find_latest`` are NVRx's with one addition: the ranks agree on a random run tag
at the manager's first ``save`` (one all-gather), and ``find_latest`` counts an iteration only
where a single run wrote every rank's checkpoint (:func:`complete_iterations`). The stock
manager counts any iteration every rank holds, so after ranks died at different iterations
(twice) it can load one rank's state from one run and another rank's from the next.

The layout is the stock manager's, ``ROOT/SESSION_ID/RANK/iter_0000042_RANK_local.fp``, each a
fastpersist checkpoint directory.

Example:
    >>> from fastpersist.integrations.nvrx import FastPersistLocalCheckpointManager
    >>> manager = FastPersistLocalCheckpointManager("/local_ssd/ckpt", session_id="run1")  # doctest: +SKIP
    >>> manager.save(tensor_aware_state_dict, iteration=100)                           # doctest: +SKIP
    >>> if manager.find_latest() != -1:                                                # doctest: +SKIP
    ...     state, ckpt_id = manager.load()
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

try:
    from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager import (
        BaseCheckpointManager,
        CheckpointingException,
        CkptID,
        SameMachineReplicationException,
    )
    from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import GroupWrapper
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import ReplicationStrategy
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fastpersist.integrations.nvrx needs the NVIDIA Resiliency Extension: pip install nvidia-resiliency-ext"
    ) from e

from ..api import load, save
from ..cleanup import clean
from ..config import Config
from ..errors import FastPersistError
from ..format.layout import MANIFEST_NAME
from ..format.manifest import read_manifest
from ..saving.incremental import Incremental
from ..saving.remover import remove_checkpoint_later

__all__ = ["FastPersistLocalCheckpointManager"]

#: Iterations are written with this many digits, as NVRx's stock manager writes them.
ITERATION_DIGITS = 7
_NAME = re.compile(rf"^iter_(\d{{{ITERATION_DIGITS},}})_(\d+)_local\.fp$")


def checkpoint_name(iteration: int, rank: int) -> str:
    """The directory name of `rank`'s local checkpoint of `iteration`.

    Example:
        >>> checkpoint_name(42, 3)
        'iter_0000042_3_local.fp'
    """
    return f"iter_{iteration:0{ITERATION_DIGITS}d}_{rank}_local.fp"


def parse_checkpoint_name(name: str) -> tuple[int, int] | None:
    """``(iteration, rank)`` from a name :func:`checkpoint_name` made, else ``None``.

    Example:
        >>> parse_checkpoint_name("iter_0000042_3_local.fp"), parse_checkpoint_name("iter_7_local.pt")
        ((42, 3), None)
    """
    match = _NAME.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def checkpoint_run(path: str | os.PathLike[str]) -> str:
    """The run tag stored in the local checkpoint at `path`: which job run wrote it (``""`` for a
    checkpoint written before runs were tagged, or one whose manifest cannot be read)."""
    try:
        root = read_manifest(os.fspath(path)).tree.get("root", {})
    except (FastPersistError, OSError):
        return ""
    if root.get("t") != "dict" or "run" not in root.get("k", []):
        return ""
    tag = root["v"][root["k"].index("run")]
    return tag if isinstance(tag, str) else ""


def complete_iterations(held: Sequence[Iterable[tuple[CkptID, str]]], ranks: Iterable[int]) -> dict[int, str]:
    """``{iteration: run}`` for each iteration whose checkpoints written by one run cover every
    rank in `ranks`; `held` lists, per rank, the ``(checkpoint id, run)`` pairs it holds.

    Shards of one iteration written by different runs (a rank that died ahead of the others
    left a stale one) never make it complete. If several runs cover every rank (replicas), the
    same one is picked on every rank.

    Example:
        >>> rank0 = [((1, 0, "s"), "run-a"), ((2, 0, "s"), "run-b")]
        >>> rank1 = [((1, 1, "s"), "run-a"), ((2, 1, "s"), "run-a")]   # its iteration 2: stale
        >>> complete_iterations([rank0, rank1], ranks=[0, 1])
        {1: 'run-a'}
    """
    covered: dict[tuple[int, str], set[int]] = {}
    for ids in held:
        for (iteration, rank, _), run in ids:
            covered.setdefault((iteration, run), set()).add(rank)
    everyone = set(ranks)
    complete: dict[int, str] = {}
    for (iteration, run), have in sorted(covered.items()):
        if have == everyone and iteration not in complete:
            complete[iteration] = run
    return complete


class FastPersistLocalCheckpointManager(BaseCheckpointManager):  # type: ignore[misc]  # (NVRx ships no types)
    """NVRx's ``BaseCheckpointManager`` storing each rank's local checkpoint with fastpersist.

    Takes the stock ``LocalCheckpointManager``'s arguments, plus the engine's knobs.

    Args:
        root_local_ckpt_dir: root directory on node-local storage (an SSD, a RAM disk);
            checkpoints go to ``root/session_id/rank/``.
        session_id: tells apart the local checkpoints of different jobs under one root.
        repl_strategy: NVRx's ``ReplicationStrategy`` (``None``: no replication).
        config: fastpersist's engine knobs for every save and load (``None``: the defaults);
            ``durable=False`` skips the fsyncs (a RAM disk).
        incremental: a :class:`fastpersist.Incremental` without a base: each checkpoint writes
            only the blocks that differ from the newest older one of the same rank id here, and
            links the rest (docs/incremental.md); the cleanup's removals never break a kept one.

    All ranks call ``save``, ``find_latest`` and ``load`` together, as with any NVRx manager.
    ``save(..., is_async=True)`` is NVRx's own machinery (it forks a process that calls
    ``_save``, and it needs CUDA: ``torch.cuda.synchronize``); ``_save`` itself returns once
    the checkpoint is durable, which NVRx requires: its ``finalize_fn`` calls ``find_latest``
    on every rank right after.

    Example:
        >>> m = FastPersistLocalCheckpointManager("/tmp/fp-nvrx-doc", session_id="doc")
        >>> m.session_id, m.config.durable
        ('doc', True)
    """

    latest_iteration: int  # NVRx's cache of find_latest (-1: unknown), set by its __init__ and save
    globally_available_ids: list[list[CkptID]]  # per rank, what load may fetch; set by find_latest

    def __init__(
        self,
        root_local_ckpt_dir: str | os.PathLike[str],
        session_id: str = "",
        repl_strategy: ReplicationStrategy | None = None,
        config: Config | None = None,
        incremental: Incremental | None = None,
    ) -> None:
        if incremental is not None and incremental.base is not None:
            raise ValueError(
                "FastPersistLocalCheckpointManager(incremental=...): each checkpoint builds on the previous one of its "
                "rank id here, so give no base"
            )
        if config is not None and not isinstance(config, Config):
            raise TypeError(
                f"config must be a fastpersist.Config, got {type(config).__name__}; "
                "pass FastPersistLocalCheckpointManager(root, config=fastpersist.Config(...))"
            )
        super().__init__(session_id, repl_strategy)
        self.root_local_ckpt_dir = os.fspath(root_local_ckpt_dir)
        self.config = config if config is not None else Config()
        self._run: str | None = None  # agreed by every rank at the first save (see _agree_on_run)
        self.incremental = incremental

    @property
    def local_ckpt_dir(self) -> Path:
        """This rank's directory: ``root/session_id/rank``."""
        return Path(self.root_local_ckpt_dir, str(self.session_id), str(self.rank))

    def _path(self, ckpt_id: CkptID) -> Path:
        iteration, rank, session_id = ckpt_id
        if session_id != self.session_id:
            raise CheckpointingException(
                f"checkpoint id {ckpt_id} belongs to session {session_id!r}, this manager to "
                f"{self.session_id!r}: build the manager with session_id={session_id!r} to read it"
            )
        return self.local_ckpt_dir / checkpoint_name(iteration, rank)

    def save(self, state_dict: TensorAwareStateDict, iteration: int, is_async: bool = False) -> Any:
        """NVRx's ``save`` (every rank at once), its checkpoints tagged with this job run's tag."""
        self._agree_on_run()
        return super().save(state_dict, iteration, is_async)

    def find_latest(self) -> int:
        """NVRx's ``find_latest`` (every rank at once), counting an iteration only where one run
        wrote every rank's checkpoint: a stale shard left by a rank that died ahead of the others
        is never combined with another run's (:func:`complete_iterations`)."""
        if self.latest_iteration != -1:
            return self.latest_iteration  # NVRx's cache, valid until the next save
        held = self._my_ckpt_runs()
        if self.repl_strategy is None:  # other ranks' shards cannot be sent without replication
            held = [(ckpt_id, run) for ckpt_id, run in held if ckpt_id[1] == self.rank]
        group = GroupWrapper()
        gathered = group.all_gather_object(held)
        complete = complete_iterations(gathered, group.ranks)
        self.globally_available_ids = [
            [ckpt_id for ckpt_id, run in ids if complete.get(ckpt_id[0]) == run] for ids in gathered
        ]
        self.latest_iteration = max(complete, default=-1)
        return self.latest_iteration

    def _agree_on_run(self) -> None:
        """Every rank takes rank 0's fresh random tag, once per manager (a collective)."""
        if self._run is None:
            proposal = secrets.token_hex(8)
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
            self._run = GroupWrapper().all_gather_object(proposal)[0] if distributed else proposal

    def _my_ckpt_runs(self) -> list[tuple[CkptID, str]]:
        """The committed checkpoints in this rank's directory (its own and replicas), each with
        the run that wrote it."""
        os.makedirs(self.local_ckpt_dir, exist_ok=True)
        held = []
        for entry in os.scandir(self.local_ckpt_dir):
            parsed = parse_checkpoint_name(entry.name)
            if parsed is not None and os.path.exists(os.path.join(entry.path, MANIFEST_NAME)):
                held.append(((parsed[0], parsed[1], self.session_id), checkpoint_run(entry.path)))
        return held

    def _my_ckpt_ids(self) -> Iterable[CkptID]:
        """The committed checkpoints in this rank's directory (its own and replicas)."""
        return [ckpt_id for ckpt_id, _ in self._my_ckpt_runs()]

    def _save(self, state_dict: TensorAwareStateDict, ckpt_id: CkptID) -> None:
        """Writes `state_dict` as the checkpoint `ckpt_id`; durable when this returns.

        An existing checkpoint of that id (a stale one, left by a rank that died ahead of the
        others) is replaced atomically, as the stock manager renames over its file: a kill
        during the save leaves the old one or the new one, whole. Raises
        ``SameMachineReplicationException`` only if something that is not a checkpoint holds
        its name.
        """
        path = self._path(ckpt_id)
        os.makedirs(path.parent, exist_ok=True)
        tensors = list(state_dict.pop_tensors())
        try:
            hollow = pickle.dumps(state_dict, protocol=pickle.HIGHEST_PROTOCOL)
            state = {"tensors": tensors, "hollow": hollow, "run": self._run or ""}
            save(state, path, config=self.config, incremental=self._increment_on(ckpt_id))
        except FileExistsError as e:  # fastpersist replaces only a checkpoint of its own
            raise SameMachineReplicationException(ckpt_id) from e
        finally:
            state_dict.insert_tensors(tensors)

    def _increment_on(self, ckpt_id: CkptID) -> Incremental | None:
        """The Incremental of `ckpt_id`'s save: built on the newest older checkpoint of its rank here."""
        if self.incremental is None:
            return None
        older = [held for held in self._my_ckpt_ids() if held[1] == ckpt_id[1] and held[0] < ckpt_id[0]]
        base = str(self._path(max(older))) if older else None
        return dataclasses.replace(self.incremental, base=base)

    def _load(self, ckpt_id: CkptID) -> TensorAwareStateDict:
        """Reads the checkpoint `ckpt_id`, every byte checked against its crc32c.

        The hollow state is unpickled: only load local checkpoints this job wrote (the same
        trust the stock manager's ``torch.load(weights_only=False)`` asks for).
        """
        path = self._path(ckpt_id)
        if not os.path.exists(path):
            raise CheckpointingException(
                f"local checkpoint {path} does not exist (this rank's directory holds "
                f"{sorted(os.listdir(path.parent)) if path.parent.exists() else 'nothing'})"
            )
        try:
            stored = load(path, config=self.config, verify=True)
        except FastPersistError as e:
            raise CheckpointingException(
                f"local checkpoint {path} cannot be loaded: {e}. Remove it (or the whole "
                f"iteration {ckpt_id[0]}) and resume from an older local or the global checkpoint"
            ) from e
        state_dict: Any = pickle.loads(stored["hollow"])  # this job's own file (see above)
        state_dict.insert_tensors(stored["tensors"])
        return state_dict

    def _remove(self, keep: Any) -> None:
        """Removes the committed checkpoints whose iteration `keep` rejects, then leftovers."""
        directory = self.local_ckpt_dir
        if not directory.exists():
            return
        for entry in os.scandir(directory):
            parsed = parse_checkpoint_name(entry.name)
            if parsed is not None and not keep(parsed[0]):
                remove_checkpoint_later(entry.path, self.config.stripes)
        clean(directory, stripes=self.config.stripes)

    def _cleanup(self, iteration: int) -> None:
        """After `iteration` was saved on every rank: removes the older checkpoints here."""
        self._remove(lambda it: it >= iteration)

    def _cleanup_failed_save(self, iteration: int) -> None:
        """After `iteration` failed on some rank: removes its checkpoints here."""
        self._remove(lambda it: it != iteration)
