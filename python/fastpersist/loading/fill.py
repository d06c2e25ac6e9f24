"""``load(out=...)``: fill an existing state's tensors in place, matched by key path.

Every tensor of `out` must be in the checkpoint with the same kind, dtype and shape (checked
before any byte is read, so a mismatch leaves `out` untouched). The stream is read one
chunk-aligned window at a time (:data:`~fastpersist.loading.reading.WINDOW_BYTES`, or one blob if it is
larger) and each window's bytes are copied into the destination tensors: no buffer of the
state's size is allocated. Tensors of the checkpoint that `out` lacks (for example optimizer
state created by the first ``step()``) come back as new tensors, and non-tensor values (step,
learning rate, RNG state) come from the checkpoint: the returned state has the checkpoint's
structure, holding `out`'s tensor objects where it has them.

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
from ..format.flatten import flatten
from ..format.manifest import Manifest
from ..format.records import TensorRecord
from ..format.unflatten import materialize, unflatten
from .reading import direct_padded, read_window, stream_windows

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
    empty = torch.empty(0, dtype=torch.uint8)
    paged: _core.PagedBuffer | None = None
    window = empty
    for lo, hi, blobs in stream_windows(m):
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
