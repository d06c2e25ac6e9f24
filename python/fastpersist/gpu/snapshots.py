"""Copies of a set of tensors in one leased arena, for a caller that hands the copies on
instead of writing them (``dcp.async_save`` through ``FastPersistWriter.stage``).

:func:`snapshot_tensors` leases an arena from the process's arenas (:mod:`fastpersist.gpu.arenas`:
made and pinned once, reused by every save), queues the device-to-host copies of every device
tensor at once through their copiers and waits for them once, as a save's staging does
(:mod:`fastpersist.gpu.device_side`), and copies the host tensors into the same arena. Each copy is
a CPU tensor of the source's dtype and shape viewing the arena, so a warm arena takes no page
faults and no pinning. The arena stays leased until :meth:`ArenaSnapshot.release` (or until the
snapshot is dropped): the copies must not be read after that. Given ``into=`` a snapshot of
tensors of the same dtypes, shapes and devices, it copies into that snapshot's copies again.

Example:
    >>> import torch
    >>> snap = snapshot_tensors([torch.arange(4.0)], pinned_bytes="auto", what="doc")
    >>> snap.copies[0].tolist(), snap.holds(snap.copies[0])
    ([0.0, 1.0, 2.0, 3.0], True)
    >>> snap.release()
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import fastpersist._core as _core

from ..format.blobs import Blob
from .arenas import ArenasBusy, granules, pinned_cap_bytes
from .copiers import copier_for
from .device_side import start_device_staging

__all__ = ["SNAPSHOT_ALIGN_BYTES", "ArenaSnapshot", "snapshot_tensors"]

#: Where each copy starts in the arena: a multiple of this (any dtype's alignment, a cache line).
SNAPSHOT_ALIGN_BYTES = 64

#: What a copy is made for: (dtype, shape, device) of its source.
_Kind = tuple[torch.dtype, torch.Size, torch.device]


class ArenaSnapshot:
    """The copies of :func:`snapshot_tensors`, in the order of its tensors, and the lease that
    keeps their arena from the next save."""

    def __init__(
        self, copies: list[torch.Tensor], kinds: list[_Kind], lease: _core.ArenaLease, host: torch.Tensor
    ) -> None:
        #: One CPU tensor per source tensor: same dtype and shape, contiguous, viewing the arena.
        self.copies = copies
        self.kinds = kinds
        self.lease: _core.ArenaLease | None = lease
        self.host = host

    @property
    def released(self) -> bool:
        """True once the arena went back to the process's arenas."""
        return self.lease is None

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s bytes lie in this snapshot's arena (it is, or views, a copy)."""
        return tensor.is_cpu and tensor.numel() > 0 and self.holds_address(tensor.data_ptr())

    def holds_address(self, address: int) -> bool:
        """Whether the byte at `address` lies in this snapshot's arena."""
        start = self.host.data_ptr()
        return start <= address < start + self.host.numel()

    def release(self) -> None:
        """Hands the arena back: a later save may overwrite the copies."""
        self.lease = None


def snapshot_tensors(
    tensors: Sequence[torch.Tensor], *, pinned_bytes: int | str, what: str, into: ArenaSnapshot | None = None
) -> ArenaSnapshot | None:
    """Copies `tensors` (plain strided tensors; device ones contiguous) into one leased arena.

    Returns None, having copied nothing, where the arena cannot hold them at once
    (``Config.pinned_bytes`` bounds the arenas), every arena the bound allows is held by saves
    still writing, or a device tensor is not contiguous (its copy
    would need a device-side copy first); the caller then copies them its own way. `what`
    names the copies in messages (a device tensor resized under the copy fails it, naming
    ``what`` and its index). `into`: a snapshot still held, of tensors of the same dtypes,
    shapes and devices, to copy into again (else, or if they differ, a new one is made and
    `into` is left as it is).
    """
    kinds = [(t.dtype, t.shape, t.device) for t in tensors]
    offsets: list[int] = []
    end = 0
    device: list[int] = []
    for i, t in enumerate(tensors):
        offsets.append(end)
        end += -(-t.nbytes // SNAPSHOT_ALIGN_BYTES) * SNAPSHOT_ALIGN_BYTES
        if t.nbytes and copier_for(t) is not None:
            if not t.is_contiguous():
                return None
            device.append(i)
    held = (into.lease, into.host) if into is not None and into.lease is not None and into.kinds == kinds else None
    if held is None and granules(end) > pinned_cap_bytes(pinned_bytes):
        return None
    blobs = [Blob(None, tensors[i], None, tensors[i].nbytes, copier_for(tensors[i])) for i in device]
    try:
        staging = start_device_staging(
            blobs,
            max(end, 1),
            pinned_bytes=pinned_bytes,
            min_bytes=max(end, 1),
            key_path=lambda k: f"{what}: tensor {device[k]}",
            fail=lambda e: None,
            leased=held,
            wait=False,  # the caller has its own way to copy: better than waiting for a save to finish
        )
    except ArenasBusy:
        return None
    if staging.lease.arena.len_bytes < end:
        return None  # the lease goes with `staging`
    host = staging.host
    if blobs:
        try:
            staging.copy([(k, 0, offsets[i], blobs[k].nbytes) for k, i in enumerate(device)])
        except BaseException:
            staging.settle()  # copies queued before the failure may still land in the arena
            raise
    copies = []
    for i, t in enumerate(tensors):
        if not t.nbytes:
            copies.append(torch.empty(t.shape, dtype=t.dtype))
            continue
        copy = host[offsets[i] : offsets[i] + t.nbytes].view(t.dtype).view(t.shape)
        if t.is_cpu:
            copy.copy_(t.detach())
        copies.append(copy)
    if blobs:
        try:
            staging.wait()
        except BaseException:
            staging.settle()
            raise
    if held is not None and into is not None:
        into.copies = [old if old.nbytes else new for old, new in zip(into.copies, copies, strict=True)]
        return into
    return ArenaSnapshot(copies, kinds, staging.lease, host)
