"""The directory protocol of an overlapped Hugging Face Trainer checkpoint (:mod:`.hf_trainer`):
files written into a staging directory that neither ``get_last_checkpoint`` nor rotation lists,
made durable on every rank, then ``trainer_state.json``, then one rename to ``checkpoint-N``.
Knows nothing of the Trainer: :class:`HFCheckpoint` gets its writes as futures and callables.

Example:
    >>> os.path.basename(staging_dir("/runs/exp1/checkpoint-40"))
    '.fastpersist-checkpoint-40'
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
from collections.abc import Callable, Iterable

import torch

import fastpersist._core as _core

from ..config import Config, snapshot_pool_bytes
from ..distributed.control import ControlGroup
from ..distributed.control import agree as agree_in_group
from ..format.layout import fsync_tree, write_small_file
from ..futures import SaveFuture
from ..saving.commit import Commit

__all__ = [
    "OLD_MARK",
    "STAGING_PREFIX",
    "TRAINER_STATE_NAME",
    "HFCheckpoint",
    "agree",
    "remove_leftovers",
    "snapshot_pool_config",
    "snapshot_state_dict",
    "staging_dir",
]

log = logging.getLogger("fastpersist")

#: Where a checkpoint is assembled before its rename: no ``checkpoint-*`` name, so Trainer never sees it.
STAGING_PREFIX = ".fastpersist-"
TRAINER_STATE_NAME = "trainer_state.json"
#: Marks a committed checkpoint moved aside while a new save of its step takes its name.
OLD_MARK = "old-"


def staging_dir(final: str) -> str:
    """Where the checkpoint `final` is assembled before its rename."""
    parent, name = os.path.split(final)
    return os.path.join(parent, STAGING_PREFIX + name)


def snapshot_pool_config(tensors: Iterable[object], where: str) -> Config:
    """A Config whose staging pool holds `tensors` whole (capped at a quarter of RAM, at least
    the default pool), so that staging them is a memory copy, not a wait for the disk (a
    Checkpointer's rule, docs/overlap.md). `where`: the target, whose drive sets the chunk size."""
    nbytes = sum(t.untyped_storage().nbytes() for t in tensors if isinstance(t, torch.Tensor))
    chunk = Config().resolved_for(where).resolved_chunk_bytes
    return Config(pool_bytes=snapshot_pool_bytes(nbytes, chunk))


def snapshot_state_dict(
    state: dict[str, torch.Tensor], into: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """A host-memory copy of `state`'s tensors (GPU weights too: the copy must not double the
    device's memory); entries that shared memory (tied weights) share the copy, so
    ``save_pretrained`` sees the same ties as in the model. The tensors of `into` (the previous
    snapshot, no longer read by anyone) are reused where name, dtype and shape match."""
    copies: dict[tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...], str], torch.Tensor] = {}
    reused: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), str(t.device))
        if key not in copies:
            old = None if into is None else into.get(name)
            if old is not None and old.dtype == t.dtype and old.shape == t.shape and id(old) not in reused:
                reused.add(id(old))
                copies[key] = old.copy_(t.detach())
            else:
                copies[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t.detach())
        out[name] = copies[key]
    return out


def agree(control: ControlGroup | None, what: str, error: BaseException | None, final: str) -> None:
    """:func:`~fastpersist.distributed.control.agree` on `what`, for the checkpoint `final`: a
    failure on any rank leaves the previous checkpoints as they were."""
    agree_in_group(control, what, error, f"; {final} was not committed and the previous checkpoints stay as they were")


@dataclasses.dataclass
class HFCheckpoint:
    """One Trainer checkpoint in flight: its files being written into `staging`, committed as
    `final` by :meth:`commit` (on the trainer's checkpoint thread).

    `renames`: this process writes trainer_state.json, renames and rotates (Trainer's
    ``should_save``); `control`: the ranks' private group, None for one process."""

    staging: str
    final: str
    futures: list[SaveFuture]
    trainer_state_json: str
    save_weights: Callable[[], None] | None  # Trainer._save into `staging`, from the copy of the weights
    rotate: Callable[[], None]  # the trainer's save_total_limit rotation
    renames: bool = True
    control: ControlGroup | None = None

    def wait_staged(self) -> None:
        """Returns once the optimizer state may be modified (the weights are a copy already)."""
        for fut in self.futures:
            fut.wait_staged()

    def staged(self) -> bool:
        """Whether the optimizer state may be modified (never blocks)."""
        return all(fut.staged() for fut in self.futures)

    def commit(self) -> str:
        """Writes the weights and waits for every file of every rank, then trainer_state.json,
        the rename and the rotation (:class:`~fastpersist.saving.commit.Commit`); returns
        `final`. A failure on any rank leaves `final` untouched and raises on every rank."""
        Commit(
            self.final,
            self.futures,
            self.control,
            kept="the previous checkpoints stay as they were",
            publishes=self.renames,
            prepare=self.save_weights,
            # what Trainer._save wrote without fsync (weights, config, args)
            durable=(lambda _: fsync_tree(self.staging)) if self.renames else None,
            publish=self._publish,
            retire=self.rotate,
        ).run()
        return self.final

    def _publish(self) -> None:
        write_small_file(os.path.join(self.staging, TRAINER_STATE_NAME), self.trainer_state_json.encode(), durable=True)
        self._rename_into_place()

    def _rename_into_place(self) -> None:
        parent = os.path.dirname(self.final)
        old = None
        if os.path.lexists(self.final):  # the same step saved again: the new one replaces it
            # A kill between these two renames leaves the old one under this name, which the
            # next save's remove_leftovers puts back.
            old = os.path.join(parent, f"{STAGING_PREFIX}{OLD_MARK}{os.path.basename(self.final)}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(self.final, old)
        os.replace(self.staging, self.final)
        _core.fsync_dir(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def remove_leftovers(run_dir: str) -> None:
    """Removes staging directories a killed save left (none is in flight: the caller waited),
    and puts back a committed checkpoint that a killed save of the same step had moved aside."""
    with contextlib.suppress(FileNotFoundError):
        for entry in sorted(os.scandir(run_dir), key=lambda e: e.name):
            if not entry.name.startswith(STAGING_PREFIX) or not entry.is_dir(follow_symlinks=False):
                continue
            name = entry.name[len(STAGING_PREFIX) :]
            if name.startswith(OLD_MARK) and not os.path.lexists(os.path.join(run_dir, name[len(OLD_MARK) :])):
                os.replace(entry.path, os.path.join(run_dir, name[len(OLD_MARK) :]))
                _core.fsync_dir(run_dir)
                continue
            log.info("removing %s: a checkpoint whose save did not finish", entry.path)
            shutil.rmtree(entry.path, ignore_errors=True)
