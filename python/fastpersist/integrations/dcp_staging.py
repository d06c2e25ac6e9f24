"""``dcp.async_save``'s staging for :class:`~fastpersist.integrations.dcp.FastPersistWriter`:
the state dict's tensors copied into one of the process's staging arenas.

DCP's own stager (``BlockingAsyncStager``) makes fresh CPU memory per save (pageable unless
``cache_staged_state_dict=True``, which pins a copy of its own) and copies tensor by tensor.
:func:`stage_state_dict` copies every tensor into an arena that fastpersist's saves share
(:mod:`fastpersist.gpu.snapshots`): made and pinned once, bounded by ``Config.pinned_bytes``,
the device copies queued at once and waited for once. The staged dict has DCP's shape: dicts,
lists and tuples rebuilt, tensors replaced by their copies, a ``DTensor`` by one of the same
spec over the copy of its local shard (DCP's stager moves the shard to the CPU, then copies it
again into new memory),
other values kept.

A state holding a ``ShardedTensor`` (its shards' metadata would need rebuilding), another tensor
subclass, a sparse or quantized tensor, or a non-contiguous device tensor is left to DCP's
stager; so is one the arena bound cannot hold at once.

Example:
    >>> import torch
    >>> staged = stage_state_dict({"w": torch.ones(2), "step": 3}, pinned_bytes="auto", what="doc")
    >>> staged[1], staged[0].copies[0].tolist()
    ({'w': tensor([1., 1.]), 'step': 3}, [1.0, 1.0])
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.tensor import DTensor

from ..config import Config
from ..gpu.snapshots import ArenaSnapshot, snapshot_tensors

__all__ = ["ArenaStaging", "stage_state_dict"]

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


class _NotPlain(Exception):
    """The state holds something only DCP's stager copies."""


def stage_state_dict(
    state_dict: dict[str, Any], *, pinned_bytes: int | str, what: str, into: ArenaSnapshot | None = None
) -> tuple[ArenaSnapshot, dict[str, Any]] | None:
    """`state_dict` with every tensor replaced by its copy in an arena, and the snapshot that
    holds the copies (release it once the save has written them); None where DCP's stager must
    copy it (see the module docs). `into`: a held snapshot to copy into again where the tensors
    are alike (``cache_staged_state_dict=True``)."""
    tensors: dict[int, torch.Tensor] = {}
    try:
        _collect(state_dict, tensors)
    except _NotPlain:
        return None
    order = list(tensors.values())
    snapshot = snapshot_tensors(order, pinned_bytes=pinned_bytes, what=what, into=into)
    if snapshot is None:
        return None
    copies = {id(t): c for t, c in zip(order, snapshot.copies, strict=True)}
    return snapshot, _rebuild(state_dict, copies)


def _collect(obj: object, tensors: dict[int, torch.Tensor]) -> None:
    if isinstance(obj, DTensor):
        _collect(obj._local_tensor, tensors)  # its shard on this rank; the spec is kept as it is
    elif isinstance(obj, torch.Tensor):
        if type(obj) not in _PLAIN_TENSORS or obj.layout is not torch.strided or obj.is_quantized or obj.is_meta:
            raise _NotPlain
        tensors.setdefault(id(obj), obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _collect(value, tensors)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _collect(value, tensors)
    elif type(obj).__name__ == "ShardedTensor":  # not a torch.Tensor: its shards need rebuilding
        raise _NotPlain


def _rebuild(obj: Any, copies: dict[int, torch.Tensor]) -> Any:
    """As DCP's stager shapes its copy: dicts as dicts, lists as lists, tuples as tuples, a
    DTensor as a DTensor of the same spec over the copy of its local tensor."""
    if isinstance(obj, DTensor):
        return DTensor(copies[id(obj._local_tensor)], obj._spec, requires_grad=False)
    if isinstance(obj, torch.Tensor):
        return copies[id(obj)]
    if isinstance(obj, dict):
        return {key: _rebuild(value, copies) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(value, copies) for value in obj]
    if isinstance(obj, tuple):
        return tuple(_rebuild(value, copies) for value in obj)
    return obj


class ArenaStaging(BlockingAsyncStager):
    """``FastPersistWriter``'s ``stage`` (``dcp.async_save``) and the hand-back of its arenas
    once written; DCP's ``BlockingAsyncStager`` takes what it does not."""

    config: Config
    path: str

    def __init__(self) -> None:
        #: Arena copies `stage` made that `write_data` has not yet written.
        self._staged: list[ArenaSnapshot] = []
        #: The arena copy kept between saves (``cache_staged_state_dict=True``).
        self._cached_snapshot: ArenaSnapshot | None = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``dcp.async_save``'s staging: a CPU copy of the state in one of the staging arenas the
        process's saves share (made and pinned once, bounded by ``Config.pinned_bytes``; the
        device copies queued at once, waited for once). The arena is held until this writer has
        written the copy, or, with ``cache_staged_state_dict=True``, kept and copied into again
        by the next save. A state that holds ShardedTensors or tensor subclasses other than DTensor,
        or that the bound cannot hold at once, is copied by DCP's own stager instead
        (integrations/dcp_staging.py)."""
        held = self._cached_snapshot if self.cache_staged_state_dict else None
        staged = stage_state_dict(state_dict, pinned_bytes=self.config.pinned_bytes, what=self.path, into=held)
        if staged is not None:
            snapshot, copy = staged
            if self.cache_staged_state_dict:
                if held is not None and snapshot is not held:
                    held.release()
                if snapshot is not held:  # else copied into again: the cache is that copy
                    self.state_dict_cache = copy
                self._cached_snapshot = snapshot
            else:
                self._staged.append(snapshot)
            return copy
        if not self.cache_staged_state_dict:
            return super().stage(state_dict)
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        if self.state_dict_cache is None or held is not None:
            # BlockingAsyncStager always pins, which fails on a machine without a CUDA driver
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
        if held is not None:
            held.release()
            self._cached_snapshot = None
        return _copy_state_dict(state_dict, self.state_dict_cache)

    def _release_written(self, sources: list[np.ndarray | torch.Tensor]) -> None:
        """Hands back the arena of the staged copy these sources came from (written, or failed).
        A rank with no tensor bytes to write (its items all deduplicated to other ranks) hands
        back its oldest: a writer serves one save at a time, so that is this save's."""
        addresses = [s.ctypes.data for s in sources if isinstance(s, np.ndarray) and s.size]
        done = [snap for snap in self._staged if any(snap.holds_address(a) for a in addresses)]
        if not done and self._staged and not any(isinstance(s, torch.Tensor) or s.size for s in sources):
            done = self._staged[:1]
        for snapshot in done:
            snapshot.release()
            self._staged.remove(snapshot)
