"""Where one process's share of a save goes (:class:`Layout`: alone, or a rank of a group), the
plan's parts it writes (:class:`PlanPart`), and the state flattened as a save flattens it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import NamedTuple

from ..format.flatten import FlatState, flatten
from ..format.layout import tmp_dir_for
from ..gpu.copiers import DEVICE_COPIERS

__all__ = ["Layout", "PlanPart", "flatten_to_save", "single_layout"]


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Where this process's share of a save goes.

    Attributes:
        checkpoint_id: the save's random id (the same on every rank of a group).
        tmp_dir: the temporary checkpoint directory, renamed to the target at commit.
        data_dir: where this process's data files go when there are no stripes.
        writer: this process's writer index, or None when it writes no data.
        writer_count: writers in the plan.
        owner: this process creates `tmp_dir` and commits it.
        tag: distinguishes this process's stripe directories from other ranks' ("" alone).
        also_writers: other writers' parts this process also writes after its own (a partner's copy).
    """

    checkpoint_id: str
    tmp_dir: str
    data_dir: str
    writer: int | None
    writer_count: int
    owner: bool
    tag: str = ""
    also_writers: tuple[int, ...] = ()


def single_layout(path: str) -> Layout:
    checkpoint_id = uuid.uuid4().hex
    tmp = tmp_dir_for(path, checkpoint_id)
    return Layout(checkpoint_id=checkpoint_id, tmp_dir=tmp, data_dir=tmp, writer=0, writer_count=1, owner=True)


class PlanPart(NamedTuple):
    """One part of the plan: a file's range of the stream (``_core.Plan.parts`` entries)."""

    writer: int
    stripe: int
    stream_offset_bytes: int
    len_bytes: int


def flatten_to_save(state: object) -> FlatState:
    """`state` flattened as a save flattens it (device tensors staged from their device). A caller
    that must know the state's size before the save (a Checkpointer sizing its pool) flattens it
    once with this and hands the result to the save in place of the state."""
    return flatten(state, copiers=DEVICE_COPIERS)
