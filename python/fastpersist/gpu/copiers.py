"""Which tensors a save stages from their device, and the copiers that copy them into the
save's pinned arena.

A save does not call ``.cpu()`` on device tensors. ``flatten(state, copiers=DEVICE_COPIERS)``
keeps their blobs device-resident (:func:`copier_for` names the copier), and the engine asks for
the device-to-host copies of a whole window of the arena in one call
(:class:`~fastpersist.gpu.device_side.DeviceStaging`): for a state that fits the arena, every copy
of the save at once, before ``save_async`` returns.

:class:`CudaCopier` queues one non-blocking ``copy_`` per contiguous run (a tensor, for a state
that fits) on a side stream of the source's device, after an event recorded on the caller's
current stream at the save call (so the copies see the values as of ``save_async``), and one
event after them; :meth:`~CudaCopier.wait` synchronizes on that event. No Python runs per
chunk and nothing synchronizes per copy. Tests on machines without a GPU install a fake copier
with :func:`use_copier`; it sees CPU tensors that :func:`use_copier`'s predicate selects as if
they were device tensors.

Example:
    >>> import torch
    >>> copier_for(torch.zeros(2)) is None   # CPU tensors are read in place, not copied
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, Protocol

import torch

__all__ = ["DEVICE_COPIERS", "CopierFactory", "CudaCopier", "DeviceCopier", "copier_for", "device_bytes", "use_copier"]


class DeviceCopier(Protocol):
    """Copies device memory into a save's arena, for one save and one source device.

    The order of calls: ``begin()`` once, on the caller's thread, when the save starts; then per
    window of the arena ``copy(pairs)`` with every copy of the window (and, for the first window
    of a save that fits the arena, ``copy(pairs, early=True)`` with the small tensors' copies,
    before the save call returns), and ``wait()``; the engine neither reads nor reuses those
    arena bytes before ``wait()`` returned.
    """

    #: The arena must be registered with CUDA (``cudaHostRegister``) for these copies to run
    #: at pinned speed (a fake copier says False).
    needs_pinned_memory: ClassVar[bool]

    def begin(self) -> None:
        """Orders the copies after the work the caller has queued so far."""

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, early: bool = False) -> None:
        """Copies, or queues the copies of, each ``src`` (1-D uint8, on the device) into ``dst``
        (a 1-D uint8 view of the arena, same length). ``early``: the copies are ordered before
        whatever the caller queues after the save call (the early copy of the small tensors the
        next forward pass may update in place): a CUDA copier queues them on the stream that was
        current at ``begin()``, a fake copies them before returning."""

    def wait(self) -> None:
        """Returns once every copy asked for so far has completed."""


#: Makes the copier that stages a save's blobs resident on one device.
CopierFactory = Callable[[torch.device], DeviceCopier]


def device_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a contiguous tensor's bytes, on its own device (no copy)."""
    if tensor.requires_grad:  # detached only where needed: a save views hundreds of tensors
        tensor = tensor.detach()
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if flat.dtype is not torch.uint8 else flat


#: ``torch.cuda`` as the CUDA copier and loader use it: a fake stands in for it in the CPU tests
#: of their ordering (which device is current when memory is registered and copies are queued).
cuda: Any = torch.cuda

#: One side stream per CUDA device for the copies of every save (created on first use).
_side_streams: dict[int, Any] = {}


class CudaCopier:
    """Side-stream, event-ordered copies from one CUDA device into the save's arena.

    The engine calls :meth:`copy` and :meth:`wait` from the save's own thread, whose current
    device is 0: every CUDA call runs with the source's device made current (a call made on
    another device would create a context there)."""

    needs_pinned_memory: ClassVar[bool] = True

    def __init__(self, device: torch.device) -> None:
        index = device.index if device.index is not None else cuda.current_device()
        self.device = torch.device("cuda", index)
        if index not in _side_streams:
            _side_streams[index] = cuda.Stream(self.device)
        self.stream: Any = _side_streams[index]
        self.caller_stream: Any = None
        self.ready: Any = None
        self.done: list[Any] = []

    def begin(self) -> None:
        with cuda.device(self.device):
            self.caller_stream = cuda.current_stream(self.device)
            self.ready = cuda.Event()
            self.ready.record(self.caller_stream)

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, early: bool = False) -> None:
        stream = self.caller_stream if early and self.caller_stream is not None else self.stream
        with cuda.device(self.device), cuda.stream(stream):
            if stream is self.stream and self.ready is not None:
                self.stream.wait_event(self.ready)
            side = stream is self.stream
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
                if side:
                    # The caching allocator must not hand a source's block to a new allocation
                    # before this copy has read it: a storage freed and re-allocated meanwhile
                    # (FSDP's resize_(0)/resize_(n)) then lands elsewhere and staging's address
                    # check refuses the save, instead of the copy reading the new tensor's bytes.
                    src.record_stream(stream)
            done = cuda.Event()
            done.record(stream)
            self.done.append(done)

    def wait(self) -> None:
        with cuda.device(self.device):
            for done in self.done:
                done.synchronize()
        self.done = []


#: The copier installed by :func:`use_copier` (the predicate choosing its tensors, its
#: factory), or None. flatten reads it per tensor, so it is a plain module attribute.
installed_copier: tuple[Callable[[torch.Tensor], bool], CopierFactory] | None = None


def copier_for(tensor: torch.Tensor) -> CopierFactory | None:
    """The factory of the copier that stages `tensor`, or None if the save reads it in place
    (CPU) or copies it to the host at once (devices without a copier)."""
    if installed_copier is not None and installed_copier[0](tensor):
        return installed_copier[1]
    if tensor.is_cuda:
        return CudaCopier
    return None


class _DeviceCopiers:
    """The save's choice for ``flatten(state, copiers=...)`` (format/blobs.py's DeviceCopiers):
    :func:`copier_for` each tensor; CPU tensors are read in place unless a fake is installed."""

    @property
    def host_only(self) -> bool:
        return installed_copier is None

    def __call__(self, tensor: torch.Tensor) -> CopierFactory | None:
        return copier_for(tensor)


#: What a save hands flatten: its blobs of device tensors keep the factory of their copier.
DEVICE_COPIERS = _DeviceCopiers()


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
