"""``load(out=...)``: fill an existing state's tensors in place, matched by key path.

Every tensor of `out` must be in the checkpoint with the same kind, dtype and shape (checked
before any byte is read, so a mismatch leaves `out` untouched). The stream is read one
chunk-aligned window at a time (:data:`~fastpersist.loading.reading.WINDOW_BYTES`, or one blob
if it is larger) into reused buffers, several windows ahead within :data:`FILL_BUFFER_BYTES`,
and each window's bytes are copied into the destination tensors while the next ones are read:
no buffer of the state's size is allocated. Tensors of the checkpoint that `out` lacks (for
example optimizer state created by the first ``step()``) come back as new tensors, and
non-tensor values (step, learning rate, RNG state) come from the checkpoint: the returned state
has the checkpoint's structure, holding `out`'s tensor objects where it has them.

All or nothing: `out` is not touched until every byte the load reads has been read and, with
``verify=True``, checked against its checksum, so a damaged chunk, a truncated, missing or
resized file leaves every tensor of `out` bit-identical to before. A stream that fits in
:data:`FILL_BUFFER_BYTES` (with no device tensors to fill) is read whole into the window
buffers first, then copied; a larger one (or one filling device tensors) is first checked in a
streamed pass over all its windows, then read again and copied: about twice the reads, and no
more memory. With ``verify=False`` nothing is checked while reading, so a larger stream is
filled as it is read (one pass), and only a failing read (an I/O error) can stop it half-way.
One race stays open for a stream over the budget: the engine reopens the data files for each
window, so if the checkpoint is deleted or replaced while the fill pass runs, the load raises
:class:`~fastpersist.CheckpointNotFoundError` and `out` may hold part of the checkpoint.

Device tensors of `out` (contiguous, on a device with a :class:`~fastpersist.gpu.loaders.DeviceLoader`,
e.g. CUDA) whose storage's bytes all go to such tensors are filled first, without a host copy:
the windows holding them are read into the load's ring of two pinned buffers and copied on a
side stream while the next window is read (:mod:`fastpersist.loading.todevice`; the caller's
current stream waits for those copies). Everything else is copied from the windows as above.

Example:
    >>> import fastpersist as fp, torch
    >>> _ = fp.save({"a": torch.ones(2), "b": torch.zeros(3), "step": 5}, "/tmp/fp-doc-fill")
    >>> out = {"b": torch.empty(3), "a": torch.empty(2)}
    >>> state = fp.load("/tmp/fp-doc-fill", out=out)
    >>> state["a"] is out["a"], out["a"].tolist(), state["step"]
    (True, [1.0, 1.0], 5)
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import numpy as np
import torch

import fastpersist._core as _core

from ..config import Config
from ..format.flatten import flatten
from ..format.manifest import Manifest
from ..format.quote import shown
from ..format.records import TensorRecord, canonical_layout
from ..format.unflatten import materialize, unflatten
from ..gpu.copiers import device_bytes
from ..gpu.loaders import loader_for
from .reading import WINDOW_BYTES, paged_uint8, read_window, stream_windows
from .todevice import DeviceCopies, Extent, copy_extents

__all__ = ["check_out", "fill_by_key", "fill_from_stream"]

#: A chunk-aligned window of the stream: ``(lo, hi, blob indices)``.
Window = tuple[int, int, list[int]]


def check_out(out: object) -> None:
    """Refuses an `out=` that holds no state to fill (``load(out=5)`` loaded as if it were None).

    Raises:
        TypeError: `out` is not None, a dict, list or tuple nesting, a tensor or an array.
    """
    if out is not None and not isinstance(out, (dict, list, tuple, torch.Tensor, np.ndarray)):
        raise TypeError(
            f"out={shown(out)}: expected None or the state to fill in place (a dict, list or tuple "
            f"nesting of tensors, as saved), not {type(out).__name__}"
        )


def _destinations(out: object, m: Manifest, root: str) -> dict[int, object]:
    """Maps each checkpoint tensor index to the `out` leaf with the same key path (checked)."""
    flat = flatten(out)
    saved = {t.key_path: i for i, t in enumerate(m.tensors)}
    dests: dict[int, object] = {}
    for rec, leaf in zip(flat.tensors, flat.leaves, strict=True):
        if type(leaf) is bytes:  # a large bytes value of `out`: values come from the checkpoint
            continue
        index = saved.get(rec.key_path)
        if index is None:
            raise ValueError(f"out= has tensor {shown(rec.key_path)} but the checkpoint {root} does not")
        have = m.tensors[index]
        if (rec.kind, rec.dtype, list(rec.shape)) != (have.kind, have.dtype, list(have.shape)):
            raise ValueError(
                f"out= tensor {shown(rec.key_path)} is {rec.kind} {rec.dtype}{list(rec.shape)} but the checkpoint "
                f"{root} has {have.kind} {have.dtype}{shown(have.shape)}"
            )
        if isinstance(leaf, torch.Tensor) and leaf.is_meta:
            raise ValueError(
                f"out= tensor {shown(rec.key_path)} is on the meta device: it has no memory to fill; pass a "
                "tensor on a real device (e.g. module.to_empty(device=...)) or load without out="
            )
        dests[index] = leaf
    return dests


def _copy_into(dest: object, loaded: object) -> None:
    if isinstance(dest, torch.Tensor):
        with torch.no_grad():
            dest.copy_(loaded)  # type: ignore[arg-type]
    else:
        np.copyto(cast(np.ndarray, dest), cast(np.ndarray, loaded))


def _device_dest(dest: object, rec: TensorRecord) -> torch.device | None:
    """The device whose loader fills `dest` with `rec`'s bytes as they are stored (both
    contiguous, so the bytes match one for one), or None for the host path."""
    if not isinstance(dest, torch.Tensor) or loader_for(dest.device) is None:
        return None
    if not dest.is_contiguous() or dest.is_conj() or dest.is_neg() or rec.stride != canonical_layout(rec.shape)[1]:
        return None
    return dest.device


def _device_extents(
    m: Manifest, dests: dict[int, object], by_blob: dict[int, list[int]]
) -> tuple[set[int], list[Extent]]:
    """The blobs whose tensors all go to device tensors of `out` that a
    :class:`~fastpersist.gpu.loaders.DeviceLoader` fills (:mod:`~fastpersist.loading.todevice`),
    and the extents of those tensors in the stream."""
    extents: list[Extent] = []
    blobs: set[int] = set()
    for b, indices in by_blob.items():
        devices = [_device_dest(dests[i], m.tensors[i]) if i in dests else None for i in indices]
        if None in devices:
            continue
        blobs.add(b)
        for i, device in zip(indices, devices, strict=True):
            extents.append(Extent(m.blobs[b][0] + m.tensors[i].offset_bytes, device_bytes(_tensor(dests[i])), device))
    return blobs, extents


def _tensor(x: object) -> torch.Tensor:
    assert isinstance(x, torch.Tensor)
    return x


#: Bytes of window buffers a fill keeps, being read or copied out (at least one window): each
#: window read drains the drive's queue at its end, so several run at once to keep it busy.
#: On this project's VM, 1 GiB with 64 MiB windows: one read at a time 1.14 s, two 0.92 s,
#: three 0.79 s (a whole-stream load: 0.62 s).
FILL_BUFFER_BYTES = 256 << 20


class _WindowReader:
    """Reads stream windows ahead into reused page-aligned buffers, within a byte budget."""

    def __init__(self, root: str, m: Manifest, verify: bool, config: Config) -> None:
        self.root, self.m, self.verify, self.config = root, m, verify, config
        self.free: list[tuple[_core.PagedBuffer, torch.Tensor]] = []

    def take(self, nbytes: int) -> tuple[_core.PagedBuffer, torch.Tensor]:
        """A free buffer of at least `nbytes` (a new one when none fits; smaller ones go)."""
        while self.free:
            held = self.free.pop()
            if len(held[0]) >= nbytes:
                return held
        return paged_uint8(nbytes)

    def read(self, held: tuple[_core.PagedBuffer, torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        """Stream bytes ``[lo, hi)`` into `held` (run on the read-ahead threads)."""
        read_window(self.root, self.m, lo, hi, held[0], self.verify, self.config)
        return held[1]

    def each(self, windows: list[Window], budget: int) -> Iterator[tuple[int, list[int], torch.Tensor]]:
        """Yields ``(lo, blobs, bytes)`` for each of `windows` in order, reading ahead while the
        buffers fit in `budget` bytes (the engine releases the GIL). With a budget that holds
        every window, all are read (and their checksums checked) before the first is yielded."""
        every_ahead = sum(hi - lo for lo, hi, _ in windows) <= budget
        with ThreadPoolExecutor(
            max(1, FILL_BUFFER_BYTES // WINDOW_BYTES), thread_name_prefix="fastpersist-fill"
        ) as ahead:
            pending: collections.deque[tuple[Future[torch.Tensor], tuple[_core.PagedBuffer, torch.Tensor]]]
            pending = collections.deque()
            held_bytes, submitted = 0, 0
            for lo, hi, blobs in windows:
                while submitted < len(windows):
                    nlo, nhi, _ = windows[submitted]
                    if pending and held_bytes + (nhi - nlo) > budget:
                        break
                    held = self.take(nhi - nlo)
                    held_bytes += nhi - nlo
                    pending.append((ahead.submit(self.read, held, nlo, nhi), held))
                    submitted += 1
                if every_ahead:
                    for read, _ in pending:
                        read.result()
                read, held = pending.popleft()
                yield lo, blobs, read.result()
                held_bytes -= hi - lo
                self.free.append(held)


def _copy_window(
    m: Manifest,
    lo: int,
    window: torch.Tensor,
    blobs: list[int],
    by_blob: dict[int, list[int]],
    dests: dict[int, object],
    values: list[object],
    place: Any,
) -> None:
    """Copies the tensors of `blobs` out of `window` (stream bytes from `lo`) into their
    destinations, or into new tensors placed by `place`; fills their `values`."""
    empty = torch.empty(0, dtype=torch.uint8)
    buffers = [empty] * len(m.blobs)
    indices: list[int] = []
    for b in blobs:
        offset, nbytes = m.blobs[b]
        view = window[offset - lo : offset - lo + nbytes]
        # A blob with a tensor that `out` lacks gets storage of its own (shared by all of its
        # tensors, so tied weights stay tied); the window is reused.
        new = any(i not in dests for i in by_blob.get(b, []))
        buffers[b] = view.clone() if new else view
        indices.extend(by_blob.get(b, []))
    records = [m.tensors[i] for i in indices]
    for i, loaded in zip(indices, materialize(records, buffers), strict=True):
        dest = dests.get(i)
        if dest is None:
            values[i] = place(loaded, m.tensors[i]) if isinstance(loaded, torch.Tensor) else loaded
        else:
            _copy_into(dest, loaded)
            values[i] = dest


def _matched(
    out: object, m: Manifest, root: str, check_new: Callable[[list[TensorRecord]], None] | None
) -> tuple[dict[int, object], dict[int, list[int]]]:
    """`out`'s destinations (checked), the tensor indices of each blob; `check_new` is called
    with the records of the tensors `out` lacks, before anything is read."""
    dests = _destinations(out, m, root)
    by_blob: dict[int, list[int]] = {}
    for i, rec in enumerate(m.tensors):
        by_blob.setdefault(rec.blob, []).append(i)
    if check_new is not None:
        check_new([rec for i, rec in enumerate(m.tensors) if i not in dests])
    return dests, by_blob


def fill_by_key(
    out: object,
    root: str,
    m: Manifest,
    verify: bool,
    config: Config,
    place: Any,
    *,
    namedtuple_types: Iterable[type] = (),
    check_new: Callable[[list[TensorRecord]], None] | None = None,
) -> object:
    """Fills `out` from the checkpoint at `root` (manifest `m`) and returns the loaded state.

    `place(tensor, record)` moves a new tensor to its target device (``map_location``);
    `check_new(records)` is called with the records of those new tensors before anything is read.
    All or nothing: an error while reading leaves `out` as it was (see the module docstring).
    """
    dests, by_blob = _matched(out, m, root, check_new)
    values: list[object] = [None] * len(m.tensors)
    on_device, extents = _device_extents(m, dests, by_blob)
    windows = [
        (lo, hi, bs)
        for lo, hi, blobs in stream_windows(m, WINDOW_BYTES)
        if (bs := [b for b in blobs if b not in on_device])
    ]
    reader = _WindowReader(root, m, verify, config)
    budget = max([FILL_BUFFER_BYTES] + [hi - lo for lo, hi, _ in windows])
    if verify and (extents or sum(hi - lo for lo, hi, _ in windows) > budget):
        # `out` is touched only once every checksum held: a first pass checks them all.
        for _ in reader.each(list(stream_windows(m, WINDOW_BYTES)), budget):
            pass
    if extents:
        copies = DeviceCopies(root, {e.device for e in extents if e.device is not None})
        copy_extents(root, m, verify, config, copies, extents)
    for b in on_device:
        for i in by_blob[b]:
            values[i] = dests[i]
    for lo, blobs, window in reader.each(windows, budget):
        _copy_window(m, lo, window, blobs, by_blob, dests, values, place)
    return unflatten(m.tree, values, namedtuple_types=namedtuple_types)


def fill_from_stream(
    out: object,
    root: str,
    m: Manifest,
    stream: _core.PagedBuffer,
    place: Any,
    *,
    namedtuple_types: Iterable[type] = (),
    check_new: Callable[[list[TensorRecord]], None] | None = None,
) -> object:
    """Fills `out` from a whole stream already read and verified (a restore from the levels);
    returns the loaded state as :func:`fill_by_key` does. `out` is checked against `m` first and
    touched only after that, so a mismatch leaves it as it was."""
    dests, by_blob = _matched(out, m, root, check_new)
    values: list[object] = [None] * len(m.tensors)
    whole = torch.frombuffer(stream, dtype=torch.uint8) if m.total_bytes else torch.empty(0, dtype=torch.uint8)
    _copy_window(m, 0, whole, list(range(len(m.blobs))), by_blob, dests, values, place)
    return unflatten(m.tree, values, namedtuple_types=namedtuple_types)
