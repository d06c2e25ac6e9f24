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

from ..format.blobs import Blob, byte_view
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
        copier_keys: Sequence[tuple[CopierFactory, torch.device] | None],
        key_path: Callable[[int], str],
        fail: Callable[[BaseException], object],
        early: frozenset[int] = frozenset(),
    ) -> None:
        self.lease = lease
        #: Device blobs copied early: their copies are ordered before the caller's later work.
        self.early = early
        self._blobs = blobs
        #: A 1-D uint8 tensor over the whole arena.
        self.host = host
        self._copiers = copiers
        #: Per blob, the key of its copier in `copiers` (None for a host blob).
        self._keys = copier_keys
        self._key_path = key_path
        self._fail = fail
        #: The extents whose copies were asked for since the last wait, early ones left out.
        self._in_flight: list[int] = []
        #: Per blob, the address of its bytes at the save call (0 for a host blob): a storage
        #: freed and re-allocated keeps its size and version counter, but moves.
        self._addresses = [
            0 if k is None else b.source.data_ptr()  # type: ignore[union-attr]  # a device blob's source is a tensor
            for b, k in zip(blobs, copier_keys, strict=True)
        ]

    def copy(self, pieces: list[tuple[int, int, int, int]]) -> None:
        """Queues the copies of `pieces`, ``(extent, extent_offset_bytes, arena_offset_bytes,
        len_bytes)`` each, one batch per copier (called by the engine's thread). The early
        copies are queued first: the caller's later work waits for them, not for the bulk."""
        try:
            early = self.early
            if early:
                self._queue([p for p in pieces if p[0] in early], True)
                pieces = [p for p in pieces if p[0] not in early]
            self._queue(pieces, False)
        except BaseException as e:
            self._fail(e)
            raise

    def _queue(self, pieces: list[tuple[int, int, int, int]], early: bool) -> None:
        if not pieces:
            return
        batches: dict[tuple[CopierFactory, torch.device], tuple[list[torch.Tensor], list[int]]] = {}
        blobs, keys, key_path, addresses = self._blobs, self._keys, self._key_path, self._addresses
        for extent, extent_offset, arena_offset, nbytes in pieces:
            blob = blobs[extent]
            src = source_bytes(blob, extent, key_path, addresses[extent])
            if nbytes != blob.nbytes:  # a window holds part of it
                src = src[extent_offset : extent_offset + nbytes]
            key = keys[extent]
            assert key is not None, "a blob staged from the host has no copier"
            batch = batches.get(key)
            if batch is None:
                batch = batches[key] = ([], [])
            batch[0].append(src)
            batch[1].append(arena_offset)
        if not early:
            self._in_flight.extend(p[0] for p in pieces)
        for key, (srcs, offsets) in batches.items():
            dsts = arena_views(self.host, offsets, [s.numel() for s in srcs])
            self._copiers[key].copy(list(zip(srcs, dsts, strict=True)), early=early)

    def wait(self) -> None:
        """Returns once every copy asked for has completed (called by the engine's thread).
        Raises if a source was resized, or its storage resized, freed or re-allocated, since the
        save call: its copy, queued then, may have read memory handed on to someone else. (An
        early copy runs before the caller's later work, so nothing the caller does can race it.)"""
        try:
            for copier in self._copiers.values():
                copier.wait()
            in_flight, self._in_flight = self._in_flight, []
            blobs, addresses = self._blobs, self._addresses
            for extent in in_flight:
                check_source(blobs[extent], extent, self._key_path, addresses[extent])
        except BaseException as e:
            self._fail(e)
            raise

    def settle(self) -> None:
        """Waits for every copy asked for, whatever the copiers raise (a failing save's arena is
        let go only after this)."""
        for copier in self._copiers.values():
            try:
                copier.wait()
            except Exception:
                pass


def arena_views(host: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> list[torch.Tensor]:
    """Views of `host` at `offsets` with `lengths`: one ``split_with_sizes`` call where they come
    in order without overlapping (a window's pieces do), slices otherwise."""
    sizes: list[int] = []
    end = 0
    for offset, n in zip(offsets, lengths, strict=True):
        if offset < end:
            return [host[o : o + n] for o, n in zip(offsets, lengths, strict=True)]
        sizes.append(offset - end)
        sizes.append(n)
        end = offset + n
    sizes.append(host.numel() - end)
    return list(host.split_with_sizes(sizes)[1:-1:2])


def start_device_staging(
    blobs: Sequence[Blob],
    need_bytes: int,
    *,
    pinned_bytes: int | str,
    min_bytes: int,
    key_path: Callable[[int], str],
    fail: Callable[[BaseException], object],
    early: Sequence[int] = (),
    leased: tuple[_core.ArenaLease, torch.Tensor] | None = None,
    wait: bool = True,
    in_file: tuple[str, int] | None = None,
) -> DeviceStaging:
    """Leases an arena for a save whose share of the stream takes `need_bytes` and begins a
    copier per (copier, device) of its device-resident blobs (on the caller's thread).
    `leased`: an arena lease the caller holds already (and its tensor), used instead.
    `wait=False`: raise ``ArenasBusy`` where every arena is held, instead of waiting for one.
    `in_file`: ``(path, length)`` of the save's one data file on a memory filesystem, to stage
    into in place (``Arenas.lease_file``) if the bound allows.

    `early` names device blobs of the early copy (fastpersist.gpu.early). When the arena holds
    the whole share, their copies go into the arena in the first window's call, ordered before
    the caller's later work (``copy(..., early=True)``): no device memory, one copy each. Else
    (the save goes in windows) they are cloned on their device now, as the early copy was."""
    copiers: dict[tuple[CopierFactory, torch.device], DeviceCopier] = {}
    keys = [_key_or_none(b) for b in blobs]
    for key in keys:
        if key is not None and key not in copiers:
            copiers[key] = key[0](key[1])
    pin = any(type(c).needs_pinned_memory for c in copiers.values())
    cap_bytes = pinned_cap_bytes(pinned_bytes)
    if leased is None and in_file is not None:
        leased = ARENAS.lease_file(*in_file, cap_bytes=cap_bytes, pin=pin)
    if leased is None:
        leased = ARENAS.lease(need_bytes, cap_bytes=cap_bytes, min_bytes=min_bytes, pin=pin, wait=wait)
    lease, host = leased
    # A file's arena holds its whole part, though not whole chunks: one window.
    in_one_window = lease.arena.len_bytes >= need_bytes or lease.arena.over_a_file
    if not in_one_window:
        clone_on_device(blobs, early)
    else:
        for i in early:  # ordered before the caller's later work: nothing can race them
            blobs[i].version, blobs[i].members = None, ()
    for copier in copiers.values():
        copier.begin()
    return DeviceStaging(
        blobs, lease, host, copiers, keys, key_path, fail, frozenset(early) if in_one_window else frozenset()
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
        else Blob(e if isinstance(e, np.ndarray) else byte_view(e), e, None)
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


def _key_or_none(blob: Blob) -> tuple[CopierFactory, torch.device] | None:
    return None if blob.device_copier is None else copier_key(blob)


def check_source(blob: Blob, extent: int, key_path: Callable[[int], str], address: int) -> torch.Tensor:
    """The tensor of the device-resident `blob`, checked as a host blob's is: RuntimeError
    naming ``key_path(extent)`` if it was resized, or its storage resized, freed (as FSDP frees
    flat parameters) or re-allocated since the save call, when its bytes were at `address`; a
    copy then reads, or has read, memory that is no longer the tensor's."""
    t = blob.source_tensor
    item = t.element_size()
    nbytes = t.numel() * item
    storage_bytes = t.untyped_storage().nbytes()
    if nbytes != blob.nbytes or t.storage_offset() * item + nbytes > storage_bytes:
        raise RuntimeError(
            f"tensor {key_path(extent)!r} of {blob.nbytes} bytes was resized (now {nbytes} bytes, in a storage "
            f"of {storage_bytes}) between the save call and its device-to-host copy; do not resize tensors or "
            "free their storage while a save is staging (wait_staged() first)"
        )
    if t.data_ptr() != address:
        raise RuntimeError(
            f"tensor {key_path(extent)!r} of {blob.nbytes} bytes moved (from {address:#x} to {t.data_ptr():#x}): "
            "its storage was freed and re-allocated between the save call and its device-to-host copy, which "
            "may have read memory handed on to someone else; do not free a tensor's storage (FSDP's "
            "untyped_storage().resize_(0)) while a save is staging (wait_staged() first)"
        )
    return t


def source_bytes(blob: Blob, extent: int, key_path: Callable[[int], str], address: int) -> torch.Tensor:
    """The bytes of the device-resident `blob` as they are now (1-D uint8 on its device),
    checked by :func:`check_source` against their `address` at the save call."""
    return device_bytes(check_source(blob, extent, key_path, address))
