"""``load(out=...)``: fill an existing state's tensors in place, matched by key path.

Every tensor of `out` must be in the checkpoint with the same kind, dtype and shape (checked
before any byte is read, so a mismatch leaves `out` untouched). The stream is read one
chunk-aligned window at a time (:data:`~fastpersist.loading.reading.WINDOW_BYTES`, or one blob if it is
larger) and each window's bytes are copied into the destination tensors: no buffer of the
state's size is allocated. Tensors of the checkpoint that `out` lacks (for example optimizer
state created by the first ``step()``) come back as new tensors, and non-tensor values (step,
learning rate, RNG state) come from the checkpoint: the returned state has the checkpoint's
structure, holding `out`'s tensor objects where it has them.

Device tensors of `out` (contiguous, on a device with a :class:`~fastpersist.device.DeviceLoader`,
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

from collections.abc import Iterable
from typing import Any, cast

import numpy as np
import torch

from .. import _core
from ..config import Config
from ..device import device_bytes, loader_for
from ..format.flatten import flatten
from ..format.manifest import Manifest
from ..format.records import TensorRecord, canonical_layout
from ..format.unflatten import materialize, unflatten
from .reading import direct_padded, read_window, stream_windows
from .todevice import DeviceCopies, Extent, copy_extents

__all__ = ["fill_by_key"]


def _destinations(out: object, m: Manifest, root: str) -> dict[int, object]:
    """Maps each checkpoint tensor index to the `out` leaf with the same key path (checked)."""
    flat = flatten(out)
    saved = {t.key_path: i for i, t in enumerate(m.tensors)}
    dests: dict[int, object] = {}
    for rec, leaf in zip(flat.tensors, flat.leaves, strict=True):
        index = saved.get(rec.key_path)
        if index is None:
            raise ValueError(f"out= has tensor {rec.key_path!r} but the checkpoint {root} does not")
        have = m.tensors[index]
        if (rec.kind, rec.dtype, list(rec.shape)) != (have.kind, have.dtype, list(have.shape)):
            raise ValueError(
                f"out= tensor {rec.key_path!r} is {rec.kind} {rec.dtype}{list(rec.shape)} but the checkpoint "
                f"{root} has {have.kind} {have.dtype}{list(have.shape)}"
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


def _fill_on_devices(
    root: str, m: Manifest, verify: bool, config: Config, dests: dict[int, object], by_blob: dict[int, list[int]]
) -> set[int]:
    """Fills the device tensors of `out` whose blobs go only to such tensors straight through the
    ring of pinned windows and their device's loader (:mod:`~fastpersist.loading.todevice`);
    returns those blobs."""
    extents: list[Extent] = []
    blobs: set[int] = set()
    for b, indices in by_blob.items():
        devices = [_device_dest(dests[i], m.tensors[i]) if i in dests else None for i in indices]
        if None in devices:
            continue
        blobs.add(b)
        for i, device in zip(indices, devices, strict=True):
            extents.append(Extent(m.blobs[b][0] + m.tensors[i].offset_bytes, device_bytes(_tensor(dests[i])), device))
    if extents:
        copies = DeviceCopies(root, {e.device for e in extents if e.device is not None})
        copy_extents(root, m, verify, config, copies, extents)
    return blobs


def _tensor(x: object) -> torch.Tensor:
    assert isinstance(x, torch.Tensor)
    return x


def fill_by_key(
    out: object,
    root: str,
    m: Manifest,
    verify: bool,
    config: Config,
    place: Any,
    *,
    namedtuple_types: Iterable[type] = (),
) -> object:
    """Fills `out` from the checkpoint at `root` (manifest `m`) and returns the loaded state.

    `place(tensor, record)` moves a new tensor to its target device (``map_location``).
    """
    dests = _destinations(out, m, root)
    by_blob: dict[int, list[int]] = {}
    for i, rec in enumerate(m.tensors):
        by_blob.setdefault(rec.blob, []).append(i)
    values: list[object] = [None] * len(m.tensors)
    on_device = _fill_on_devices(root, m, verify, config, dests, by_blob)
    for b in on_device:
        for i in by_blob[b]:
            values[i] = dests[i]
    empty = torch.empty(0, dtype=torch.uint8)
    paged: _core.PagedBuffer | None = None
    window = empty
    for lo, hi, all_blobs in stream_windows(m):
        blobs = [b for b in all_blobs if b not in on_device]
        if not blobs:
            continue
        if paged is None or len(paged) < hi - lo:
            paged = _core.PagedBuffer(direct_padded(hi - lo))
            window = torch.frombuffer(paged, dtype=torch.uint8)
        read_window(root, m, lo, hi, paged, verify, config)
        buffers = [empty] * len(m.blobs)
        records: list[TensorRecord] = []
        indices: list[int] = []
        for b in blobs:
            offset, nbytes = m.blobs[b]
            view = window[offset - lo : offset - lo + nbytes]
            # A blob with a tensor that `out` lacks gets storage of its own (shared by all of
            # its tensors, so tied weights stay tied); the window is reused.
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
    return unflatten(m.tree, values, namedtuple_types=namedtuple_types)
