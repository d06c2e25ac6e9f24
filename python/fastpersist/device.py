"""Device-to-host staging: how a save copies GPU tensors into the engine's staging slots.

A save does not call ``.cpu()`` on device tensors. Their blobs are marked device-resident and
the engine's staging thread asks a :class:`DeviceCopier`, chunk by chunk, to copy the bytes it
is about to write straight into a staging slot; the slot is written with O_DIRECT as soon as
the copy has completed, while the next chunk is being copied. So ``save_async`` returns without
waiting for any copy, the copy overlaps the disk write, a rank of a group copies only the bytes
it writes, and no device memory proportional to the state is allocated.

:class:`CudaCopier` copies on a side CUDA stream, after an event recorded on the caller's
current stream when the save started (so the copies see the values as of ``save_async``), into
slots registered with CUDA (``cudaHostRegister``, once per slot) so that they run at pinned
speed. Tests on machines without a GPU install a fake copier with :func:`use_copier`; it sees
CPU tensors that :func:`use_copier`'s predicate selects as if they were device tensors.

Example:
    >>> import torch
    >>> copier_for(torch.zeros(2)) is None   # CPU tensors are read in place, not copied
    True
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, Protocol

import torch

__all__ = ["CudaCopier", "DeviceCopier", "copier_for", "device_bytes", "use_copier"]


class DeviceCopier(Protocol):
    """Copies device memory into host staging slots for one save."""

    def begin(self) -> None:
        """Called once when the save starts, on the caller's thread: orders the copies after
        the work the caller has queued so far."""

    def copy_to_host(self, src: torch.Tensor, slot: memoryview, start: int, end: int) -> None:
        """Copies `src` (1-D uint8, on the device) into ``slot[start:end]``; returns when done."""


def device_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a contiguous tensor's bytes, on its own device (no copy)."""
    flat = tensor.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


class CudaCopier:
    """Side-stream, event-ordered copies from one CUDA device into pinned slots."""

    _pinned: ClassVar[dict[int, int]] = {}
    _pinned_lock = threading.Lock()

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: Any = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.ready: Any = None

    def begin(self) -> None:
        self.ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self.ready.record(torch.cuda.current_stream(self.device))

    @classmethod
    def _pin(cls, host: torch.Tensor) -> None:
        """Registers a slot with CUDA once (slots live as long as their pool, and pools are
        kept for the process's life); a failure only means an unpinned, slower copy."""
        address, nbytes = host.data_ptr(), host.numel()
        with cls._pinned_lock:
            if cls._pinned.get(address) == nbytes:
                return
            cls._pinned[address] = nbytes
        try:
            cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            cudart.cudaHostRegister(address, nbytes, 0)
        except Exception:  # already registered, or not allowed: copy unpinned
            pass

    def copy_to_host(self, src: torch.Tensor, slot: memoryview, start: int, end: int) -> None:
        host = torch.frombuffer(slot, dtype=torch.uint8)
        self._pin(host)
        with torch.cuda.stream(self.stream):
            if self.ready is not None:
                self.stream.wait_event(self.ready)
            host[start:end].copy_(src, non_blocking=True)
        self.stream.synchronize()


#: The copier installed by :func:`use_copier` (the predicate choosing its tensors, its factory),
#: or None. flatten reads it per tensor, so it is a plain module attribute.
installed_copier: tuple[Callable[[torch.Tensor], bool], Callable[[torch.device], DeviceCopier]] | None = None


def copier_for(tensor: torch.Tensor) -> Callable[[torch.device], DeviceCopier] | None:
    """The factory of the copier that stages `tensor`, or None if the save reads it in place
    (CPU) or copies it to the host at once (devices without a copier)."""
    if installed_copier is not None and installed_copier[0](tensor):
        return installed_copier[1]
    if tensor.is_cuda:
        return CudaCopier
    return None


@contextmanager
def use_copier(
    selects: Callable[[torch.Tensor], bool], factory: Callable[[torch.device], DeviceCopier]
) -> Iterator[None]:
    """Within the block, tensors for which ``selects(t)`` is true are staged by
    ``factory(t.device)`` (the seam the CPU tests drive the device path through)."""
    global installed_copier
    previous, installed_copier = installed_copier, (selects, factory)
    try:
        yield
    finally:
        installed_copier = previous
