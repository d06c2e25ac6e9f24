"""The early copy: which watched tensors a save copies before ``save_async`` returns.

The next forward pass updates some buffers in place (BatchNorm statistics, step counters and
other small tensors) before anyone calls ``wait_staged()``: such tensors would race their
staging. So watched tensors of at most :data:`EARLY_COPY_MAX_BYTES` are copied at the call,
smallest first, up to :data:`EARLY_COPY_BUDGET_BYTES` for host and device tensors together
(docs/overlap.md). A device tensor's copy is a clone on its device, queued on the caller's
stream before the next forward's kernels (no host sync); a host tensor's is made by the engine
into memory of its own before ``start_write`` returns.

Example:
    >>> import torch
    >>> from fastpersist.format.flatten import flatten
    >>> blobs = flatten({"stats": torch.zeros(4), "weight": torch.zeros(1 << 19)}).blobs
    >>> choose_early_copies(blobs)    # the 16-byte statistic, not the 2 MiB weight
    [0]
"""

from __future__ import annotations

from ..format.blobs import Blob

__all__ = ["EARLY_COPY_BUDGET_BYTES", "EARLY_COPY_MAX_BYTES", "choose_early_copies", "copy_early_on_device"]

#: The largest tensor copied early.
EARLY_COPY_MAX_BYTES = 1 << 20
#: Bytes of early copies per save, host and device tensors together.
EARLY_COPY_BUDGET_BYTES = 64 << 20


def choose_early_copies(blobs: list[Blob]) -> list[int]:
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


def copy_early_on_device(blobs: list[Blob], chosen: list[int]) -> list[int]:
    """Makes the early copies of the device-resident blobs among `chosen` (a clone on their
    device, no longer watched) and returns the others: the host blobs the engine copies."""
    host = []
    for i in chosen:
        blob = blobs[i]
        if blob.copier_factory is None:
            host.append(i)
            continue
        blob.source = blob.source_tensor.clone()
        blob.version, blob.members = None, ()
    return host
