"""Interop: a fastpersist checkpoint to and from ``torch.save`` files and safetensors.

Every direction is bit-identical: the tensors that come back have the same dtype, shape,
strides and bytes, and the non-tensor structure (nesting, key types, plain values) is kept.

* torch: a ``.pt`` file is read with ``torch.load(weights_only=True, mmap=True)`` (never
  unpickling code) and written with :func:`fastpersist.torch_save`. Tensors that share storage
  stay shared both ways. A file that needs ``weights_only=False`` (numpy arrays, argparse
  namespaces, classes of its own) is refused unless the caller passes ``unsafe_pickle=True``
  (the CLI's ``--unsafe-pickle``): unpickling it runs whatever code the file names.
* safetensors: every tensor is stored under a dotted name built from its key path
  (``model.layers.0.weight``; list items by index), so ``safetensors.torch.load_file`` gives
  the weights directly. The rest of the state (the tree of containers and plain values, each
  tensor's strides and the storage it shared) goes into ``__metadata__["fastpersist"]`` as JSON,
  so that importing the file rebuilds the original state, sharing included. safetensors cannot
  express sharing, so shared tensors are stored as separate copies. A safetensors file without
  that metadata imports as a flat ``{name: tensor}`` dict.

Example:
    >>> from fastpersist.interop.convert import convert
    >>> convert("ckpt/step-100", "torch", "model.pt")          # doctest: +SKIP
    >>> convert("model.safetensors", "fastpersist", "ckpt/imported")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch

from ..config import Config
from ..errors import FastPersistError, UnsupportedValueError
from ..format.flatten import flatten, materialize, records_from_json, records_to_json, unflatten
from ..format.layout import MANIFEST_NAME, atomic_file
from ..format.manifest import read_manifest
from ..format.quote import shown
from ..format.records import TORCH_DTYPES, TensorRecord, dtype_itemsize, span_elems
from ..loading.phases import PhaseClock
from ..loading.pipeline import LoadOptions, load_checkpoint
from ..saving.pools import pool_for, prefault_in_background
from ..saving.start import save_blocking
from .torchfile import torch_save

__all__ = ["Format", "convert", "detect_format", "read_any", "read_checkpoint", "write_safetensors"]

log = logging.getLogger("fastpersist")

Format = Literal["torch", "safetensors", "fastpersist"]
FORMATS: tuple[Format, ...] = ("torch", "safetensors", "fastpersist")
META_KEY = "fastpersist"
META_VERSION = 1
Progress = Callable[[str], None]
#: dtypes the safetensors format names; other dtypes are stored as raw bytes (uint8).
_SAFETENSORS_DTYPES = frozenset(
    getattr(torch, n)
    for n in (
        "float64 float32 float16 bfloat16 int64 int32 int16 int8 uint8 bool float8_e4m3fn float8_e4m3fnuz "
        "float8_e5m2 float8_e5m2fnuz complex64 uint64 uint32 uint16"
    ).split()
    if hasattr(torch, n)
)


def detect_format(path: str | os.PathLike[str]) -> Format:
    """``"fastpersist"`` for a checkpoint directory, ``"torch"`` for a zip archive, else ``"safetensors"``."""
    p = os.fspath(path)
    if os.path.isdir(p):
        if os.path.exists(os.path.join(p, MANIFEST_NAME)):
            return "fastpersist"
        raise FastPersistError(f"{p} is a directory without {MANIFEST_NAME}: not a fastpersist checkpoint")
    with open(p, "rb") as f:
        head = f.read(9)
    if head[:4] == b"PK\x03\x04":
        return "torch"
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    raise FastPersistError(f"{p}: neither a torch.save zip archive nor a safetensors file")


def read_checkpoint(path: str | os.PathLike[str]) -> Any:
    """Loads a fastpersist checkpoint on the CPU with every storage of its own (no shared stream buffer).

    ``fastpersist.load`` may return large tensors as views into one read buffer; exported
    files should instead hold exactly the storages the saved state had.
    """
    root = os.path.abspath(os.fspath(path))
    m = read_manifest(root)
    if m.shards:
        raise FastPersistError(f"{root} is sharded over {len(m.shards)} ranks; convert one shard at a time")
    options = LoadOptions(map_location="cpu", verify=True, config=Config(), namedtuple_types=(), clock=PhaseClock(None))
    state = load_checkpoint(root, options)
    leaves = flatten(state).leaves
    if len(leaves) != len(m.tensors):
        return state
    buffers: dict[int, torch.Tensor] = {}
    for rec, leaf in zip(m.tensors, leaves, strict=True):
        if rec.blob in buffers:
            continue
        length = m.blobs[rec.blob][1]
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "meta":  # no bytes: its blob is empty
            buffers[rec.blob] = torch.zeros(length, dtype=torch.uint8)
        elif isinstance(leaf, torch.Tensor):
            raw = torch.empty(0, dtype=torch.uint8).set_(leaf.untyped_storage())
            start = leaf.storage_offset() * leaf.element_size() - rec.offset_bytes
            buffers[rec.blob] = raw[start : start + length].clone()
        elif isinstance(leaf, bytes):  # a large bytes value, kept in the stream as a uint8 record
            buffers[rec.blob] = _bytes_tensor(leaf)
        else:
            buffers[rec.blob] = torch.from_numpy(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8).copy())
    if len(buffers) != len(m.blobs):
        return state
    return unflatten(m.tree, materialize(m.tensors, [buffers[b] for b in range(len(m.blobs))]))


def read_any(path: str | os.PathLike[str], *, unsafe_pickle: bool = False) -> Any:
    """Reads a checkpoint, ``torch.save`` file or safetensors file into a state (on the CPU).

    A ``torch.save`` file is read with ``weights_only=True``; one that needs more is refused
    (FastPersistError naming the file and the flag) unless `unsafe_pickle`: then it is read
    with ``weights_only=False``, which runs any code its pickle names. Only for trusted files.
    """
    kind = detect_format(path)
    if kind == "fastpersist":
        return read_checkpoint(path)
    if kind == "torch":
        return _read_torch_file(os.fspath(path), unsafe_pickle)
    return read_safetensors(path)


#: Globals a weights_only load may build besides torch's defaults: constructors of plain values
#: that fastpersist stores too (torch.save writes a frozenset as a call of its type).
SAFE_GLOBALS: list[Any] = [frozenset]


def _read_torch_file(path: str, unsafe_pickle: bool) -> Any:
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        if not unsafe_pickle:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
            why = next((line for line in lines if "WeightsUnpickler error" in line), lines[0])
            raise FastPersistError(
                f"{path} needs torch.load(weights_only=False), which runs code the file names "
                f"(torch says: {shown(why, 200)}). If you trust the file, pass --unsafe-pickle "
                "(convert(..., unsafe_pickle=True) in Python)"
            ) from None
    except Exception as e:
        raise FastPersistError(f"{path}: torch.load could not read it: {shown(str(e), 300)}") from None
    log.warning("unpickling %s with weights_only=False (unsafe_pickle): it may run code the file names", path)
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


# ----------------------------------------------------------------------------- safetensors


def _names(state: object, leaves: list[object]) -> list[str]:
    """A unique dotted name per tensor leaf, in record order."""
    index = {id(x): i for i, x in enumerate(leaves)}
    names: list[str | None] = [None] * len(leaves)
    used: set[str] = set()
    for name, leaf in _walk(state, ""):
        i = index.get(id(leaf))
        if i is None or names[i] is not None:
            continue
        unique, n = name or "tensor", 1
        while unique in used:
            n += 1
            unique = f"{name}#{n}"
        used.add(unique)
        names[i] = unique
    return [n if n is not None else f"tensor#{i}" for i, n in enumerate(names)]


def _walk(x: object, prefix: str) -> Iterator[tuple[str, object]]:
    join: Callable[[object], str] = lambda k: f"{prefix}.{k}" if prefix else str(k)  # noqa: E731
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _walk(v, join(k))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _walk(v, join(i))
    elif isinstance(x, (torch.Tensor, np.ndarray, bytes)):  # bytes: only large ones have a record
        yield prefix, x


def _storable(leaf: object) -> torch.Tensor:
    """What safetensors stores for a leaf: a contiguous tensor of its own (raw bytes if the dtype is foreign)."""
    if isinstance(leaf, bytes):
        return _bytes_tensor(leaf)
    if isinstance(leaf, np.ndarray):
        try:
            t = torch.from_numpy(np.ascontiguousarray(leaf)).clone()
        except TypeError:
            return torch.from_numpy(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8).copy())
    else:
        assert isinstance(leaf, torch.Tensor)
        if leaf.device.type == "meta":  # shape and dtype only: its record says them, no bytes to store
            return torch.zeros(0, dtype=torch.uint8)
        t = leaf.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
    if t.dtype not in _SAFETENSORS_DTYPES:
        return t.reshape(-1).view(torch.uint8).clone() if t.numel() else torch.zeros(0, dtype=torch.uint8)
    return t


def _bytes_tensor(value: bytes) -> torch.Tensor:
    """A uint8 tensor holding a copy of `value` (the record a large bytes value gets)."""
    return torch.from_numpy(np.frombuffer(value, dtype=np.uint8).copy())


def write_safetensors(state: object, path: str | os.PathLike[str]) -> int:
    """Writes `state` as a safetensors file (see the module docstring); returns the tensor count."""
    import safetensors.torch

    flat = flatten(state)
    names = _names(state, flat.leaves)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, leaf in zip(names, flat.leaves, strict=True):
        t = _storable(leaf)
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:  # safetensors refuses shared memory: store a copy
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    meta = {"version": META_VERSION, "spec": flat.spec, "records": records_to_json(flat.tensors), "names": names}
    target = os.fspath(path)
    with atomic_file(target, durable=True) as tmp:
        safetensors.torch.save_file(tensors, tmp, metadata={"format": "pt", META_KEY: json.dumps(meta)})
    return len(tensors)


def read_safetensors(path: str | os.PathLike[str]) -> Any:
    """Reads a safetensors file; one written by fastpersist comes back as the original state."""
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="pt") as f:
        meta = (f.metadata() or {}).get(META_KEY)
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta is None:
        return tensors
    try:
        info = json.loads(meta)
        if info.get("version") != META_VERSION:
            raise ValueError(f"metadata version {shown(info.get('version'))} (this reader knows {META_VERSION})")
        records = records_from_json(info["records"])
        values = [tensors[n] for n in info["names"]]
        buffers = _blob_buffers(records, values)
        return unflatten(info["spec"], materialize(records, buffers))
    except (ValueError, KeyError, TypeError) as e:
        raise FastPersistError(
            f"{path}: bad fastpersist metadata in the safetensors header: {shown(str(e), 300)}"
        ) from None


def _blob_buffers(records: list[TensorRecord], values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Rebuilds each blob's bytes by placing every record's values at its offset and strides."""
    if len(records) != len(values):
        raise ValueError(f"{len(records)} records but {len(values)} named tensors")
    sizes: dict[int, int] = {}
    for r in records:
        end = r.offset_bytes + span_elems(r.shape, r.stride) * dtype_itemsize(r.kind, r.dtype)
        sizes[r.blob] = max(sizes.get(r.blob, 0), end)
    buffers = [torch.zeros(sizes.get(b, 0), dtype=torch.uint8) for b in range(max(sizes, default=-1) + 1)]
    for r, v in zip(records, values, strict=True):
        if r.device == "meta" and r.kind == "torch":  # no bytes in the blob
            continue
        buf = buffers[r.blob]
        itemsize = dtype_itemsize(r.kind, r.dtype)
        span = span_elems(r.shape, r.stride) * itemsize
        raw = buf[r.offset_bytes : r.offset_bytes + span]
        if r.kind == "numpy":
            raw.copy_(v.reshape(-1).view(torch.uint8) if v.numel() else raw)
            continue
        if v.dtype == torch.uint8 and r.dtype != "uint8":  # a dtype safetensors lacks, stored as its bytes
            _place_bytes(raw, v, tuple(r.shape), tuple(r.stride), itemsize)
            continue
        dest = raw.view(TORCH_DTYPES[r.dtype]).as_strided(r.shape, r.stride)
        with torch.no_grad():
            _copy_into(dest, v)
    return buffers


def _may_overlap(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """False when no two elements of a view with `shape` and `stride` can share a location:
    taken by increasing stride, each dimension steps past everything the smaller ones reach."""
    reach = 0
    for n, step in sorted(((n, step) for n, step in zip(shape, stride, strict=True) if n > 1), key=lambda d: d[1]):
        if step <= reach:
            return True
        reach += (n - 1) * step
    return False


def _copy_into(dest: torch.Tensor, values: torch.Tensor) -> None:
    """``dest.copy_(values)``, also where `dest`'s elements overlap (an expanded view: torch
    refuses to write one location twice, so those go by index; the values there agree)."""
    if not _may_overlap(dest.shape, dest.stride()):
        dest.copy_(values)
        return
    index = torch.zeros(dest.shape, dtype=torch.int64)
    for dim, (n, step) in enumerate(zip(dest.shape, dest.stride(), strict=True)):
        index += (torch.arange(n) * step).view([n if d == dim else 1 for d in range(dest.dim())])
    flat = dest.as_strided((dest.storage_offset() + int(index.max()) + 1,), (1,), 0)
    flat[dest.storage_offset() + index.reshape(-1)] = values.reshape(-1).to(dest.dtype)


#: An integer dtype per element size, to move elements of any dtype as whole words.
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _place_bytes(
    raw: torch.Tensor, values: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int
) -> None:
    """Writes `values` (the elements' bytes in row-major order) into `raw` at `stride` (in
    elements of `itemsize` bytes), moving each element as whole words of an integer dtype."""
    if not values.numel():
        return
    word = 8 if itemsize % 8 == 0 else max(w for w in _WORDS if itemsize % w == 0)
    per = itemsize // word
    dest = raw.view(_WORDS[word]).as_strided((*shape, per), (*(s * per for s in stride), 1))
    _copy_into(dest, values.view(_WORDS[word]).reshape(*shape, per))


# ----------------------------------------------------------------------------- convert


def convert(
    src: str | os.PathLike[str],
    to: Format,
    out: str | os.PathLike[str],
    *,
    progress: Progress | None = None,
    unsafe_pickle: bool = False,
) -> dict[str, Any]:
    """Converts `src` (any of the three formats, detected from its content) to format `to` at `out`.

    Returns ``{"src_format", "to", "out", "tensors"}``. `progress`, when given, is called with
    a short description of each step. `unsafe_pickle`: read a ``.pt`` file that needs
    ``torch.load(weights_only=False)`` (see :func:`read_any`); only for files you trust.

    Example:
        >>> import fastpersist as fp, torch
        >>> _ = fp.save({"w": torch.ones(2)}, "/tmp/fp-doc-conv")
        >>> convert("/tmp/fp-doc-conv", "safetensors", "/tmp/fp-doc.safetensors")["tensors"]
        1
    """
    if to not in FORMATS:
        raise ValueError(f"to={to!r}: expected one of {', '.join(FORMATS)}")
    step = progress or (lambda _text: None)
    kind = detect_format(src)
    if to == "fastpersist":  # the staging pool's first touch overlaps the read (fp.prepare)
        prefault_in_background(pool_for(Config().resolved_for(out)))
    step(f"reading {kind} {src}")
    state = read_any(src, unsafe_pickle=unsafe_pickle)
    step(f"writing {to} {out}")
    try:
        count = len(flatten(state).leaves)
    except UnsupportedValueError:
        if to != "torch":  # torch's format pickles what an unpickled file held; ours does not
            raise
        count = sum(isinstance(x, torch.Tensor) for _, x in _walk(state, ""))
    if to == "fastpersist":
        save_blocking(state, out, Config())
    elif to == "torch":
        torch_save(state, out)
    else:
        write_safetensors(state, out)
    return {"src_format": kind, "to": to, "out": os.fspath(out), "tensors": count}
