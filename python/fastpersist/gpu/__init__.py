"""Device staging: everything a save or a load does with device (GPU) memory, in one place.

A save with CUDA tensors (docs/gpu.md):

* :mod:`~fastpersist.gpu.copiers`: which tensors are staged from their device
  (:func:`~fastpersist.gpu.copiers.copier_for`, asked by flatten), and the copiers that queue
  their device-to-host copies (:class:`~fastpersist.gpu.copiers.CudaCopier`; the test seam
  :func:`~fastpersist.gpu.copiers.use_copier`);
* :mod:`~fastpersist.gpu.early`: the early copy, one budget for host and device tensors;
* :mod:`~fastpersist.gpu.arenas`: the pinned arenas saves stage into and write from, made once
  per process and bounded by ``Config.pinned_bytes``;
* :mod:`~fastpersist.gpu.device_side`: one save's device side, as the engine calls it (every copy
  of an arena window in one call, one wait);
* :mod:`~fastpersist.gpu.snapshots`: tensors copied into an arena for a caller that hands the
  copies on instead of writing them (``dcp.async_save``'s staging);
* :mod:`~fastpersist.gpu.pinned`: registering host memory with CUDA, and undoing it before the
  memory goes.

A load to a CUDA device: :mod:`~fastpersist.gpu.loaders` (the mirror, used by
:mod:`fastpersist.loading.todevice`).
"""

from .arenas import ARENAS
from .copiers import use_copier
from .loaders import use_loader
from .pinned import pinned_bytes

__all__ = ["arena_bytes", "pinned_bytes", "use_copier", "use_loader"]


def arena_bytes() -> int:
    """Bytes of staging arenas this process keeps for device saves (pinned where CUDA took the
    registration; see :func:`pinned_bytes`)."""
    return ARENAS.total_bytes()
