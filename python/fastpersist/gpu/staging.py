"""The device side of one save: its copiers, the arena lease its job stages into, and the two
calls the engine makes per window of the arena (``copy`` with every piece, then ``wait``).

:func:`start_device_staging` runs on the caller's thread at the save call, after the early
copy (:mod:`fastpersist.gpu.early`): it leases an arena (:mod:`fastpersist.gpu.arenas`) and
begins one copier per (copier, device), which orders the copies after the work the caller has
queued. The engine then calls :meth:`DeviceStaging.copy` from the save's thread, for the first
window before ``save_async`` returns, and :meth:`DeviceStaging.wait` once per window before it
reads the window's bytes: two calls into Python per window however many chunks it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
import torch

import fastpersist._core as _core

from ..format.blobs import Blob
from .arenas import ARENAS, pinned_cap_bytes
from .copiers import CopierFactory, DeviceCopier, copier_for, device_bytes
from .early import clone_on_device

__all__ = [
    "DeviceStaging",
    "has_device_blobs",
    "share_bytes",
    "source_bytes",
    "stage_from_devices",
    "start_device_staging",
]


def has_device_blobs(blobs: Sequence[Blob]) -> bool:
    """Whether a save of `blobs` stages some of them from a device."""
    return any(b.device_copier is not None for b in blobs)


class DeviceStaging:
    """What the engine's ``device`` hook is: ``lease`` (taken by ``_core.start_write``),
    ``copy(pieces)`` and ``wait()``. An exception from either is handed to `fail` (the save's
    verdict) before it propagates into the engine, which then fails the job."""

    def __init__(
        self,
        blobs: Sequence[Blob],
        lease: _core.ArenaLease,
        host: torch.Tensor,
        copiers: dict[tuple[CopierFactory, torch.device], DeviceCopier],
        key_path: Callable[[int], str],
        fail: Callable[[BaseException], object],
        early: frozenset[int] = frozenset(),
    ) -> None:
        self.lease = lease
        #: Device blobs copied early: their copies are ordered before the caller's later work.
        self.early = early
        self._blobs = blobs
        self._host = host
        self._copiers = copiers
        self._key_path = key_path
        self._fail = fail
        #: The extents whose copies were asked for since the last wait.
        self._in_flight: list[int] = []

    def copy(self, pieces: list[tuple[int, int, int, int]]) -> None:
        """Queues the copies of `pieces`, ``(extent, extent_offset_bytes, arena_offset_bytes,
        len_bytes)`` each, grouped by copier (called by the engine's thread)."""
        try:
            pairs: dict[tuple[CopierFactory, torch.device, bool], list[tuple[torch.Tensor, torch.Tensor]]] = {}
            host = self._host
            for extent, extent_offset, arena_offset, nbytes in pieces:
                self._in_flight.append(extent)
                blob = self._blobs[extent]
                src = source_bytes(blob, lambda e=extent: self._key_path(e))  # type: ignore[misc]
                if nbytes != blob.nbytes:  # a window holds part of it
                    src = src[extent_offset : extent_offset + nbytes]
                key = (*copier_key(blob), extent in self.early)
                pairs.setdefault(key, []).append((src, host[arena_offset : arena_offset + nbytes]))
            for (factory, device, early), batch in sorted(pairs.items(), key=lambda kv: not kv[0][2]):
                self._copiers[factory, device].copy(batch, early=early)
        except BaseException as e:
            self._fail(e)
            raise

    def wait(self) -> None:
        """Returns once every copy asked for has completed (called by the engine's thread).
        Raises if a source was resized, or its storage shrunk or freed, since the save call:
        its copy, queued then, may have read memory handed on to someone else."""
        try:
            for copier in self._copiers.values():
                copier.wait()
            in_flight, self._in_flight = self._in_flight, []
            for extent in in_flight:
                source_bytes(self._blobs[extent], lambda e=extent: self._key_path(e))  # type: ignore[misc]
        except BaseException as e:
            self._fail(e)
            raise


def start_device_staging(
    blobs: Sequence[Blob],
    need_bytes: int,
    *,
    pinned_bytes: int | str,
    min_bytes: int,
    key_path: Callable[[int], str],
    fail: Callable[[BaseException], object],
    early: Sequence[int] = (),
) -> DeviceStaging:
    """Leases an arena for a save whose share of the stream takes `need_bytes` and begins a
    copier per (copier, device) of its device-resident blobs (on the caller's thread).

    `early` names device blobs of the early copy (fastpersist.gpu.early). When the arena holds
    the whole share, their copies go into the arena in the first window's call, ordered before
    the caller's later work (``copy(..., early=True)``): no device memory, one copy each. Else
    (the save goes in windows) they are cloned on their device now, as the early copy was."""
    copiers: dict[tuple[CopierFactory, torch.device], DeviceCopier] = {}
    for blob in blobs:
        if blob.device_copier is not None:
            key = copier_key(blob)
            if key not in copiers:
                copiers[key] = key[0](key[1])
    pin = any(type(c).needs_pinned_memory for c in copiers.values())
    lease, host = ARENAS.lease(need_bytes, cap_bytes=pinned_cap_bytes(pinned_bytes), min_bytes=min_bytes, pin=pin)
    in_one_window = lease.arena.len_bytes >= need_bytes
    if not in_one_window:
        clone_on_device(blobs, early)
    else:
        for i in early:  # ordered before the caller's later work: nothing can race them
            blobs[i].version, blobs[i].members = None, ()
    for copier in copiers.values():
        copier.begin()
    return DeviceStaging(
        blobs, lease, host, copiers, key_path, fail, frozenset(early) if in_one_window else frozenset()
    )


def share_bytes(plan: _core.Plan, writers: Sequence[int], chunk_bytes: int) -> int:
    """The arena bytes that hold the parts of `writers` at once: each part in whole chunks."""
    return sum(-(-p[3] // chunk_bytes) * chunk_bytes for p in plan.parts if p[0] in writers)


def stage_from_devices(
    extents: Sequence[np.ndarray | torch.Tensor],
    plan: _core.Plan,
    *,
    pinned_bytes: int | str,
    what: str,
) -> tuple[list[object | None], DeviceStaging | None]:
    """The sources of a one-writer write of `extents` (host byte arrays, or 1-D uint8 tensors
    on a device): host ones as they are, device ones (None) staged through an arena by the
    :class:`DeviceStaging` returned with them (None when every extent is on the host). The
    path ``fp.torch_save`` and the DCP writer take for device tensors; `what` names the file
    in messages."""
    blobs = [
        Blob(None, e, None, e.nbytes, copier_for(e))
        if isinstance(e, torch.Tensor) and copier_for(e) is not None
        else Blob(e if isinstance(e, np.ndarray) else e.numpy(), e, None)
        for e in extents
    ]
    if not has_device_blobs(blobs):
        return [b.data for b in blobs], None
    device = start_device_staging(
        blobs,
        share_bytes(plan, [0], plan.chunk_bytes),
        pinned_bytes=pinned_bytes,
        min_bytes=plan.chunk_bytes,
        key_path=lambda i: f"{what}: extent {i}",
        fail=lambda e: None,
    )
    return [None if b.device_copier is not None else b.data for b in blobs], device


def copier_key(blob: Blob) -> tuple[CopierFactory, torch.device]:
    """Which copier stages the device-resident `blob`: one per (factory, device)."""
    factory = blob.device_copier
    assert factory is not None, "a blob staged from the host has no copier"
    return cast(CopierFactory, factory), blob.source_tensor.device


def source_bytes(blob: Blob, key_path: Callable[[], str]) -> torch.Tensor:
    """The bytes of the device-resident `blob` as they are now (1-D uint8 on its device),
    checked as a host blob's are: RuntimeError naming ``key_path()`` if its tensor was resized,
    or its storage shrunk or freed (as FSDP frees flat parameters), since flatten(); copying
    then would read past the storage's end."""
    src = device_bytes(blob.source_tensor)
    storage_bytes = src.untyped_storage().nbytes()
    if src.numel() != blob.nbytes or src.storage_offset() + src.numel() > storage_bytes:
        raise RuntimeError(
            f"tensor {key_path()!r} of {blob.nbytes} bytes was resized (now {src.numel()} bytes, in a storage "
            f"of {storage_bytes}) between the save call and its device-to-host copy; do not resize tensors or "
            "free their storage while a save is staging (wait_staged() first)"
        )
    return src
