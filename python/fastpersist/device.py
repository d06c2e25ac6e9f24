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

The load side mirrors it with a :class:`DeviceLoader`: a load whose tensors go to a CUDA
device reads the stream window by window into two pinned host buffers and copies each window
host-to-device on a side stream while the next window is read (see
:mod:`fastpersist.loading.todevice`). :class:`CudaLoader` implements it; tests install a fake
with :func:`use_loader`, which chooses the target devices it handles.

Example:
    >>> import torch
    >>> copier_for(torch.zeros(2)) is None   # CPU tensors are read in place, not copied
    True
    >>> loader_for(torch.device("cpu")) is None   # CPU targets are read into host memory
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from .pinned import pin_host, unpin_host

__all__ = [
    "CopierFactory",
    "CopyFence",
    "CudaCopier",
    "CudaLoader",
    "DeviceCopier",
    "DeviceLoader",
    "copier_for",
    "device_bytes",
    "loader_for",
    "pin_host",
    "unpin_host",
    "use_copier",
    "use_loader",
]


class DeviceCopier(Protocol):
    """Copies device memory into host staging slots for one save."""

    def begin(self, slots_owner: object) -> None:
        """Called once when the save starts, on the caller's thread: orders the copies after
        the work the caller has queued so far. `slots_owner` owns the staging slots the copies
        go into (the save's pool): memory pinned for them must stay pinned only while it lives."""

    def copy_to_host(self, src: torch.Tensor, slot: memoryview, start: int, end: int) -> None:
        """Copies `src` (1-D uint8, on the device) into ``slot[start:end]``, or queues the copy.
        The slot's memory stays untouched by the save until :meth:`wait` returned (the memoryview
        itself is valid only during the call)."""

    def wait(self) -> None:
        """Returns once every copy asked for so far has completed. The save asks for the next
        chunk's copies before it checksums the current one, so that the two overlap."""


def device_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a contiguous tensor's bytes, on its own device (no copy)."""
    flat = tensor.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


#: ``torch.cuda`` as the CUDA copier and loader use it: a fake stands in for it in the CPU tests
#: of their ordering (which device is current when memory is registered and copies are queued).
cuda: Any = torch.cuda


class CudaCopier:
    """Side-stream, event-ordered copies from one CUDA device into pinned slots.

    The staging thread is new per save and its current device is 0: every CUDA call of a copy
    (the registration included, which would otherwise create a context on device 0 for a rank
    on ``cuda:k``) runs with the source's device made current."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: Any = cuda.Stream(device)
        self.ready: Any = None
        self.slots_owner: object = None

    def begin(self, slots_owner: object) -> None:
        self.slots_owner = slots_owner
        with cuda.device(self.device):
            self.ready = cuda.Event()
            self.ready.record(cuda.current_stream(self.device))

    def copy_to_host(self, src: torch.Tensor, slot: memoryview, start: int, end: int) -> None:
        with cuda.device(self.device):
            host = torch.frombuffer(slot, dtype=torch.uint8)
            pin_host(host, self.slots_owner)
            with cuda.stream(self.stream):
                if self.ready is not None:
                    self.stream.wait_event(self.ready)
                host[start:end].copy_(src, non_blocking=True)

    def wait(self) -> None:
        with cuda.device(self.device):
            self.stream.synchronize()


#: The copier installed by :func:`use_copier` (the predicate choosing its tensors, its factory),
#: or None. flatten reads it per tensor, so it is a plain module attribute.
#: Makes the copier that stages a save's blobs resident on one device.
CopierFactory = Callable[[torch.device], DeviceCopier]

installed_copier: tuple[Callable[[torch.Tensor], bool], CopierFactory] | None = None


def copier_for(tensor: torch.Tensor) -> CopierFactory | None:
    """The factory of the copier that stages `tensor`, or None if the save reads it in place
    (CPU) or copies it to the host at once (devices without a copier)."""
    if installed_copier is not None and installed_copier[0](tensor):
        return installed_copier[1]
    if tensor.is_cuda:
        return CudaCopier
    return None


@contextmanager
def use_copier(selects: Callable[[torch.Tensor], bool], factory: CopierFactory) -> Iterator[None]:
    """Within the block, tensors for which ``selects(t)`` is true are staged by
    ``factory(t.device)`` (the seam the CPU tests drive the device path through)."""
    global installed_copier
    previous, installed_copier = installed_copier, (selects, factory)
    try:
        yield
    finally:
        installed_copier = previous


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
        self.device = device if device.index is not None else torch.device("cuda", cuda.current_device())
        self.stream: Any = cuda.Stream(self.device)

    def begin(self) -> None:
        with cuda.device(self.device):
            self.stream.wait_stream(cuda.current_stream(self.device))

    def register(self, host: torch.Tensor) -> None:
        with cuda.device(self.device):
            pin_host(host, host)  # unpinned when the ring drops the buffer (or the tensor dies)

    def empty(self, nbytes: int) -> torch.Tensor:
        # Allocated on the caller's current stream, which owns the memory from here on: the side
        # stream's copies are ordered after the caller's prior work (begin) and before its later
        # work (finish), so the caching allocator's per-stream reuse stays correct.
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy_to_device(self, host: torch.Tensor, dst: torch.Tensor) -> None:
        with cuda.device(self.device), cuda.stream(self.stream):
            dst.copy_(host, non_blocking=True)

    def fence(self) -> CopyFence:
        with cuda.device(self.device):
            event: Any = cuda.Event()
            event.record(self.stream)
        return _DeviceFence(event, self.device)

    def finish(self) -> None:
        with cuda.device(self.device):
            cuda.current_stream(self.device).wait_stream(self.stream)


class _DeviceFence:
    """A CUDA event, waited for with its device current: it may be waited for on any thread,
    by a later load, and a CUDA call creates a context on the current device if it has none."""

    def __init__(self, event: Any, device: torch.device) -> None:
        self.event, self.device = event, device

    def synchronize(self) -> None:
        with cuda.device(self.device):
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
