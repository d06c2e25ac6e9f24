"""The device-resident blobs of a save: the early copy of small ones on their device, and one
copier per device for the rest (:mod:`fastpersist.device`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import _core
from ..device import CopierFactory, DeviceCopier, device_bytes
from ..format.blobs import Blob

__all__ = ["EARLY_COPY_BUDGET_BYTES", "EARLY_COPY_MAX_BYTES", "copier_key", "prepare_device_blobs", "source_bytes"]

#: The early copy: watched tensors of at most EARLY_COPY_MAX_BYTES are copied before the save
#: call returns, smallest first and up to EARLY_COPY_BUDGET_BYTES in all, so that nothing the
#: next forward pass updates in place (BatchNorm statistics, step counters, other small
#: buffers) can race their staging (docs/overlap.md).
EARLY_COPY_MAX_BYTES = 1 << 20
EARLY_COPY_BUDGET_BYTES = 64 << 20


def prepare_device_blobs(blobs: list[Blob], pool: _core.Pool) -> dict[tuple[CopierFactory, torch.device], DeviceCopier]:
    """Makes the early copy of small device-resident blobs on their device (stream-ordered, no
    host sync), so that buffers the next forward pass updates cannot race them, and starts one copier per
    device for the rest, copying into the slots of `pool`. Returns the copiers by (factory, device)."""
    on_device = [b for b in blobs if b.copier_factory is not None]
    budget = EARLY_COPY_BUDGET_BYTES
    for blob in sorted(on_device, key=lambda b: b.nbytes):
        if blob.version is None or blob.nbytes > EARLY_COPY_MAX_BYTES or blob.nbytes > budget:
            continue
        blob.source = blob.source_tensor.clone()
        blob.version, blob.members = None, ()
        budget -= blob.nbytes
    copiers: dict[tuple[CopierFactory, torch.device], DeviceCopier] = {}
    for blob in on_device:
        key = copier_key(blob)
        if key not in copiers:
            factory, device = key
            copiers[key] = factory(device)
            copiers[key].begin(pool)
    return copiers


def copier_key(blob: Blob) -> tuple[CopierFactory, torch.device]:
    """Which copier stages the device-resident `blob`: one per (factory, device)."""
    factory = blob.copier_factory
    assert factory is not None, "a blob staged from the host has no copier"
    return factory, blob.source_tensor.device


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
