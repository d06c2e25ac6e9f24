"""The early copy: which watched tensors a save copies before ``save_async`` returns.

The next forward pass updates some buffers in place (BatchNorm statistics, step counters and
other small tensors) before anyone calls ``wait_staged()``: such tensors would race their
staging. So watched tensors of at most :data:`EARLY_COPY_MAX_BYTES` are copied at the call,
smallest first, up to :data:`EARLY_COPY_BUDGET_BYTES` for host and device tensors together
(docs/overlap.md). A host tensor's copy is made by the engine into memory of its own before
``start_write`` returns. A device tensor's is its device-to-host copy into the arena, queued on
the caller's stream before the call returns, so it runs before the next forward's kernels (no
host sync, no device memory); a save that goes through the arena in windows clones it on its
device instead (:func:`clone_on_device`), as its copy may come in a later window.

An inference tensor (made under ``torch.inference_mode()``) keeps no version counter, so the
guard cannot see it modified: an overlapped save copies its bytes at the call, whatever their
size (:func:`copy_unversioned`), on the host or on its device.

Example:
    >>> import torch
    >>> from fastpersist.format.flatten import flatten
    >>> blobs = flatten({"stats": torch.zeros(4), "weight": torch.zeros(1 << 19)}).blobs
    >>> choose_early_copies(blobs)    # the 16-byte statistic, not the 2 MiB weight
    [0]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ..format.blobs import Blob
from ..format.records import TensorRecord

__all__ = [
    "EARLY_COPY_BUDGET_BYTES",
    "EARLY_COPY_MAX_BYTES",
    "choose_early_copies",
    "clone_on_device",
    "copy_unversioned",
    "split_by_side",
]

#: The largest tensor copied early.
EARLY_COPY_MAX_BYTES = 1 << 20
#: Bytes of early copies per save, host and device tensors together.
EARLY_COPY_BUDGET_BYTES = 64 << 20


def choose_early_copies(blobs: Sequence[Blob]) -> list[int]:
    """The watched blobs a save copies early: at most EARLY_COPY_MAX_BYTES each, smallest first,
    up to EARLY_COPY_BUDGET_BYTES in all; their indices in stream order."""
    small = sorted(
        (b.nbytes, i) for i, b in enumerate(blobs) if b.version is not None and 0 < b.nbytes <= EARLY_COPY_MAX_BYTES
    )
    chosen, budget = [], EARLY_COPY_BUDGET_BYTES
    for nbytes, i in small:
        if nbytes > budget:
            break
        chosen.append(i)
        budget -= nbytes
    return sorted(chosen)


def split_by_side(blobs: Sequence[Blob], chosen: Iterable[int]) -> tuple[list[int], list[int]]:
    """`chosen` split into host blobs (the engine copies them) and device-resident ones."""
    host: list[int] = []
    device: list[int] = []
    for i in chosen:
        (host if blobs[i].device_copier is None else device).append(i)
    return host, device


def clone_on_device(blobs: Sequence[Blob], indices: Iterable[int]) -> None:
    """Replaces each device blob of `indices` by a clone on its device (queued on the caller's
    stream, no host sync), no longer watched."""
    for i in indices:
        blob = blobs[i]
        blob.source = blob.source_tensor.clone()
        blob.version, blob.members = None, ()


def copy_unversioned(blobs: list[Blob], records: Sequence[TensorRecord], leaves: Sequence[object]) -> int:
    """Replaces each blob that holds an inference tensor's bytes by a copy made now (a host copy,
    or a clone on the tensor's device for a device-resident blob); returns the bytes copied.

    `records` and `leaves`: the flattened state's tensor records and the objects behind them.
    """
    copied = 0
    done: set[int] = set()
    for record, leaf in zip(records, leaves, strict=True):
        index = record.blob
        if index in done or not (isinstance(leaf, torch.Tensor) and leaf.is_inference()):
            continue
        done.add(index)
        blob = blobs[index]
        if blob.nbytes == 0 or not isinstance(blob.source, torch.Tensor):
            continue
        source = blob.source.detach()
        if blob.device_copier is not None:
            copy = source.clone()
        else:
            copy = source.clone(memory_format=torch.contiguous_format) if source.is_cpu else source.cpu()
        blobs[index] = Blob(None, copy, None, blob.nbytes, blob.device_copier)
        copied += blob.nbytes
    return copied
