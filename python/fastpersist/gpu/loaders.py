"""Loads into device memory: the loaders that copy a load's host windows to the device.

A load whose tensors go to a CUDA device reads the stream window by window into two pinned
host buffers and copies each window host-to-device on a side stream while the next window is
read (see :mod:`fastpersist.loading.todevice`). :class:`CudaLoader` implements it; tests
install a fake with :func:`use_loader`, which chooses the target devices it handles.

Example:
    >>> import torch
    >>> loader_for(torch.device("cpu")) is None   # CPU targets are read into host memory
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from . import copiers
from .pinned import pin_host

__all__ = ["CopyFence", "CudaLoader", "DeviceLoader", "loader_for", "use_loader"]


class CopyFence(Protocol):
    """The end of some queued copies (a CUDA event recorded after them)."""

    def synchronize(self) -> None:
        """Returns once the copies queued before the fence have completed."""


class DeviceLoader(Protocol):
    """Copies windows of a load's host ring buffers into device memory, for one load and one
    target device. Copies are queued (asynchronous); the ordering is:

    ``begin`` (copies come after the caller's queued work) -> per window ``copy_to_device`` for
    each blob piece -> ``fence()`` -> ... -> ``finish`` (the caller's current stream waits for
    every copy). The ring keeps each window's fence and waits on it before that buffer is
    refilled, by this load or a later one (a load returns before its last copies ran).
    """

    def begin(self) -> None:
        """Called once, on the caller's thread, before any allocation or copy: orders the copies
        after the work the caller has queued so far (memory the allocator hands out may still
        be in use by it)."""

    def register(self, host: torch.Tensor) -> None:
        """`host` (a whole ring buffer, 1-D uint8, page-aligned) will be copied from: pin it."""

    def empty(self, nbytes: int) -> torch.Tensor:
        """A new, uninitialised 1-D uint8 destination of `nbytes` on the target device."""

    def copy_to_device(self, host: torch.Tensor, dst: torch.Tensor) -> None:
        """Queues the copy of `host` (1-D uint8, a part of a ring buffer) into `dst` (1-D uint8
        on the device, same length); may return before the copy has run."""

    def fence(self) -> CopyFence:
        """A fence after every copy queued so far (it may outlive this loader)."""

    def finish(self) -> None:
        """Makes the caller's current stream wait for every queued copy (without blocking the
        host): the loaded tensors are then safe to use on that stream."""


class CudaLoader:
    """Host-to-device copies on a side CUDA stream; an event per window is its fence. Every
    CUDA call runs with the target device made current (the caller's may be another)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device if device.index is not None else torch.device("cuda", copiers.cuda.current_device())
        self.stream: Any = copiers.cuda.Stream(self.device)

    def begin(self) -> None:
        with copiers.cuda.device(self.device):
            self.stream.wait_stream(copiers.cuda.current_stream(self.device))

    def register(self, host: torch.Tensor) -> None:
        with copiers.cuda.device(self.device):
            pin_host(host, host)  # unpinned when the ring drops the buffer (or the tensor dies)

    def empty(self, nbytes: int) -> torch.Tensor:
        # Allocated on the caller's current stream, which owns the memory from here on: the side
        # stream's copies are ordered after the caller's prior work (begin) and before its later
        # work (finish), so the caching allocator's per-stream reuse stays correct.
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy_to_device(self, host: torch.Tensor, dst: torch.Tensor) -> None:
        with copiers.cuda.device(self.device), copiers.cuda.stream(self.stream):
            dst.copy_(host, non_blocking=True)

    def fence(self) -> CopyFence:
        with copiers.cuda.device(self.device):
            event: Any = copiers.cuda.Event()
            event.record(self.stream)
        return _DeviceFence(event, self.device)

    def finish(self) -> None:
        with copiers.cuda.device(self.device):
            copiers.cuda.current_stream(self.device).wait_stream(self.stream)


class _DeviceFence:
    """A CUDA event, waited for with its device current: it may be waited for on any thread,
    by a later load, and a CUDA call creates a context on the current device if it has none."""

    def __init__(self, event: Any, device: torch.device) -> None:
        self.event, self.device = event, device

    def synchronize(self) -> None:
        with copiers.cuda.device(self.device):
            self.event.synchronize()


#: The loader installed by :func:`use_loader` (the predicate choosing its target devices, its
#: factory), or None.
installed_loader: tuple[Callable[[torch.device], bool], Callable[[torch.device], DeviceLoader]] | None = None


def loader_for(device: torch.device) -> Callable[[torch.device], DeviceLoader] | None:
    """The factory of the loader that copies tensors bound for `device`, or None if they are
    built in host memory and moved as ``torch.load`` would (CPU, devices without a loader)."""
    if installed_loader is not None and installed_loader[0](device):
        return installed_loader[1]
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaLoader
    return None


@contextmanager
def use_loader(
    selects: Callable[[torch.device], bool], factory: Callable[[torch.device], DeviceLoader]
) -> Iterator[None]:
    """Within the block, loads treat every target device for which ``selects(device)`` is true
    as a device with a loader, ``factory(device)`` (the seam the CPU tests drive the device
    load path through; a fake may allocate its destinations on the CPU)."""
    global installed_loader
    previous, installed_loader = installed_loader, (selects, factory)
    try:
        yield
    finally:
        installed_loader = previous
