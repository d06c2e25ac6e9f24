"""Loading tensors straight into device memory: the mirror of the save's device staging.

When ``map_location`` sends a checkpoint's tensors to a device with a
:class:`~fastpersist.gpu.loaders.DeviceLoader` (CUDA, or a fake installed with
:func:`~fastpersist.gpu.loaders.use_loader`), the load does not read the whole stream into host
memory and call ``.to(device)`` per tensor. Instead:

1. each such blob gets a destination on its target device (``loader.empty``); tensors are
   views of it, built as for a host load, so tied weights share device storage again;
2. the stream is read in fixed chunk-aligned windows (:data:`DEVICE_WINDOW_BYTES`, O_DIRECT,
   every chunk's crc32c checked by ``read_window``) into a ring of two page-aligned host
   buffers, registered with CUDA once and kept for later loads;
3. each window's bytes are queued host-to-device (``loader.copy_to_device``, non-blocking on a
   side stream) into the blobs' destinations, then a fence (a CUDA event) is recorded after
   them and kept with the ring buffer (``loader.fence``); while those copies run, the next
   window is read into the other buffer (the read releases the GIL). A ring buffer is refilled
   only once its fences completed: the load returns before its last two windows' copies have
   run, so the fences go back to the cache with the ring and the next load that takes it
   waits on them first; a ring dropped from the cache is unpinned and freed only after them;
4. blobs bound for the CPU (or a device without a loader) are copied out of the ring into host
   memory of their own and placed as today.

Ordering contract (:class:`~fastpersist.gpu.loaders.CudaLoader`): the side stream first waits for
the work the caller had queued on its current stream (``begin``: memory the caching allocator
hands out may still be in use by it); at the end the caller's current stream waits for the side
stream (``finish``), without blocking the host. So the returned tensors are safe to use on the
stream that was current during ``load``; on another stream, synchronise with it first (or call
``torch.cuda.synchronize()``). Host memory stays at two windows, whatever the state's size; a
blob larger than a window is simply copied in several pieces.

Example:
    >>> import fastpersist as fp, torch
    >>> from fastpersist.format.manifest import read_manifest
    >>> _ = fp.save({"w": torch.ones(4)}, "/tmp/fp-doc-todevice")
    >>> device_targets(read_manifest("/tmp/fp-doc-todevice"), None)   # CPU tensors: the host path
    {}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

import fastpersist._core as _core

from ..config import Config
from ..engine.kept_memory import KeptCache
from ..errors import FastPersistError
from ..format.manifest import Manifest
from ..gpu.loaders import CopyFence, DeviceLoader, loader_for
from ..gpu.pinned import unpin_host
from .maplocation import MapLocation, target_device
from .reading import WINDOW_BYTES, direct_padded, paged_uint8, read_window

__all__ = [
    "DEVICE_WINDOW_BYTES",
    "RING_SLOTS",
    "DeviceCopies",
    "Extent",
    "copy_extents",
    "device_targets",
    "load_blobs",
]

#: Stream bytes read per window of a device load (rounded down to whole chunks, at least one).
DEVICE_WINDOW_BYTES = WINDOW_BYTES
#: Host buffers in the ring: one being read while the other's copies run.
RING_SLOTS = 2

RingBuffer = tuple[_core.PagedBuffer, torch.Tensor]


class Ring:
    """The host buffers of a device load and, per buffer, the fences of the copies last queued
    from it (one per loader). A load returns before its last copies have run, so the fences go
    back to the cache with the buffers: a buffer is refilled, and a dropped ring unpinned and
    freed, only once they completed."""

    def __init__(self, nbytes: int) -> None:
        self.buffers: list[RingBuffer] = [paged_uint8(nbytes) for _ in range(RING_SLOTS)]
        self.fences: list[list[tuple[torch.device, CopyFence]]] = [[] for _ in range(RING_SLOTS)]

    def wait(self, slot: int) -> None:
        """Returns once the copies from buffer `slot` have completed; a fence that fails raises
        (and stays, so that :meth:`settle` still waits for the others)."""
        for _, fence in self.fences[slot]:
            fence.synchronize()
        self.fences[slot] = []

    def settle(self) -> None:
        """Waits for every copy from the ring, whatever fails (a device error: already raised,
        or the device is gone)."""
        for slot in range(RING_SLOTS):
            for _, fence in self.fences[slot]:
                try:
                    fence.synchronize()
                except Exception:
                    pass
            self.fences[slot] = []

    def release(self) -> None:
        """Unpins the buffers once no copy reads them (they are freed when dropped)."""
        self.settle()
        for _, host in self.buffers:
            unpin_host(host)

    def nbytes(self) -> int:
        return sum(host.numel() for _, host in self.buffers)


def ring_window(chunk_bytes: int) -> int:
    """Stream bytes per window of a load of a checkpoint of `chunk_bytes` chunks."""
    return max(chunk_bytes, DEVICE_WINDOW_BYTES // chunk_bytes * chunk_bytes)


def ring_bytes(chunk_bytes: int) -> int:
    """The bytes of one buffer of the ring for a checkpoint of `chunk_bytes` chunks: a window."""
    return direct_padded(ring_window(chunk_bytes))


#: Rings kept between loads by buffer size (bounded, as save pools are: engine/kept_memory.py). A
#: ring let go of is unpinned once the copies from it have run.
RINGS: KeptCache[int, Ring] = KeptCache(
    "device-load rings",
    size_of=Ring.nbytes,
    bound_of_one=lambda config: RING_SLOTS * ring_bytes(config.resolved_chunk_bytes),
    release=Ring.release,
)


def device_targets(m: Manifest, location: MapLocation) -> dict[int, torch.device]:
    """Blob index -> target device, for the blobs whose tensors all go to one device that has a
    loader (empty: the whole load takes the host path; always so for a callable `location`)."""
    if callable(location) and not isinstance(location, Mapping):
        return {}
    by_saved: dict[str, torch.device | None] = {}  # saved device -> target with a loader
    targets: dict[int, torch.device | None] = {}
    for rec in m.tensors:
        if rec.device not in by_saved:
            target = target_device(location, rec.device)
            by_saved[rec.device] = target if target is not None and loader_for(target) is not None else None
        target = by_saved[rec.device] if rec.kind == "torch" else None
        if target is None:
            targets[rec.blob] = None
        elif targets.setdefault(rec.blob, target) != target:
            targets[rec.blob] = None  # records of one storage sent to two devices: host path
    return {b: t for b, t in targets.items() if t is not None}


def _copy_failed(root: str, device: torch.device, error: BaseException) -> FastPersistError:
    return FastPersistError(
        f"loading {root} to {device}: a host-to-device copy failed ({type(error).__name__}: {error}); "
        "nothing was loaded (check the device's health and free memory, or load with map_location='cpu')"
    )


class DeviceCopies:
    """The loaders of one load (one per target device); a loader's failure becomes one error
    naming the checkpoint."""

    def __init__(self, root: str, devices: set[torch.device]) -> None:
        self.root = root
        self.loaders: dict[torch.device, DeviceLoader] = {}
        for device in sorted(devices, key=str):
            factory = loader_for(device)
            assert factory is not None, f"{device} has no loader"
            self.loaders[device] = factory(device)
        for device in self.loaders:
            self.call(device, "begin")

    def call(self, device: torch.device, what: str, *args: object) -> None:
        """``loaders[device].what(*args)``, its failure raised as :class:`FastPersistError`."""
        try:
            getattr(self.loaders[device], what)(*args)
        except Exception as e:
            raise _copy_failed(self.root, device, e) from e

    def reuse(self, ring: Ring, slot: int) -> None:
        """Returns once ring buffer `slot` may be refilled: the copies last queued from it, by
        this load or an earlier one, have completed."""
        for device, fence in ring.fences[slot]:
            try:
                fence.synchronize()
            except Exception as e:
                raise _copy_failed(self.root, device, e) from e
        ring.fences[slot] = []

    def mark(self, ring: Ring, slot: int, devices: set[torch.device]) -> None:
        """Keeps with the ring the end of the window's copies from buffer `slot` (made by the
        loaders of `devices`)."""
        for device in sorted(devices, key=str):
            try:
                fence = self.loaders[device].fence()
            except Exception as e:
                raise _copy_failed(self.root, device, e) from e
            ring.fences[slot].append((device, fence))

    def drain(self, ring: Ring) -> None:
        """After a failure: lets every copy in flight finish (errors are already being raised)."""
        ring.settle()
        for loader in self.loaders.values():
            try:
                loader.finish()
            except Exception:
                pass


class Extent(NamedTuple):
    """Stream bytes ``[offset_bytes, offset_bytes + dst.numel())`` go to `dst` (1-D uint8):
    through the loader of `device`, or by a host copy when `device` is None."""

    offset_bytes: int
    dst: torch.Tensor
    device: torch.device | None


def load_blobs(
    root: str,
    m: Manifest,
    verify: bool,
    config: Config,
    targets: dict[int, torch.device],
    stats: dict[str, float] | None = None,
) -> list[torch.Tensor]:
    """One 1-D uint8 buffer per blob of `m`: on its target device for the blobs in `targets`
    (filled through their loaders), in host memory of its own for the others.

    Raises what ``read_window`` raises for a damaged or missing file (naming file and
    tensors), and :class:`FastPersistError` naming the checkpoint for a failing copy; copies
    already queued have completed by then. `stats` gets the reads' ``bytes`` and ``crc32c_s``.
    """
    copies = DeviceCopies(root, set(targets.values()))
    buffers = [
        copies.loaders[targets[b]].empty(nbytes) if b in targets else torch.empty(nbytes, dtype=torch.uint8)
        for b, (_, nbytes) in enumerate(m.blobs)
    ]
    extents = [Extent(offset, buffers[b], targets.get(b)) for b, (offset, _) in enumerate(m.blobs)]
    copy_extents(root, m, verify, config, copies, extents, stats)
    return buffers


def copy_extents(
    root: str,
    m: Manifest,
    verify: bool,
    config: Config,
    copies: DeviceCopies,
    extents: list[Extent],
    stats: dict[str, float] | None = None,
) -> None:
    """Reads the windows of the stream that hold `extents` through the ring and copies each
    extent's bytes to its destination; on return every copy is ordered before the caller's
    later work on its current stream (``finish``). See the module docstring."""
    window, nbytes = ring_window(m.chunk_bytes), ring_bytes(m.chunk_bytes)
    ring = RINGS.take(nbytes) or Ring(nbytes)
    try:
        for _, host in ring.buffers:
            for device in copies.loaders:
                copies.call(device, "register", host)
        _fill(root, m, verify, config, window, ring, copies, extents, stats)
        for device in copies.loaders:
            copies.call(device, "finish")
    except BaseException:
        copies.drain(ring)
        raise
    finally:
        RINGS.give_back(nbytes, ring)


def _fill(
    root: str,
    m: Manifest,
    verify: bool,
    config: Config,
    window: int,
    ring: Ring,
    copies: DeviceCopies,
    extents: list[Extent],
    stats: dict[str, float] | None,
) -> None:
    """Reads each window that holds extent bytes into the next ring buffer and copies them out
    (extents may overlap: views of one storage filled into separate tensors); adds the reads'
    measures to `stats`."""
    by_window: dict[int, list[Extent]] = {}
    for e in sorted(extents, key=lambda e: e.offset_bytes):
        for w in range(e.offset_bytes // window, -(-(e.offset_bytes + e.dst.numel()) // window)):
            by_window.setdefault(w, []).append(e)
    for k, w in enumerate(sorted(by_window)):
        slot = k % RING_SLOTS
        copies.reuse(ring, slot)
        lo = w * window
        hi = min(lo + window, m.total_bytes)
        paged, host = ring.buffers[slot]
        read_window(root, m, lo, hi, paged, verify, config, stats)  # the engine adds to `stats`
        devices: set[torch.device] = set()
        try:
            for offset, dst, device in by_window[w]:
                a, z = max(lo, offset), min(hi, offset + dst.numel())
                src, piece = host[a - lo : z - lo], dst[a - offset : z - offset]
                if device is None:
                    piece.copy_(src)
                    continue
                devices.add(device)
                copies.call(device, "copy_to_device", src, piece)
        finally:
            copies.mark(ring, slot, devices)
