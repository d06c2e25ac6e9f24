"""The save side: walk a nested training state into a JSON tree spec, tensor records and blobs.

`flatten` is the entry point. The bytes to write are `Blob`s (`fastpersist.format.blobs`), the read
side (`unflatten`, `materialize`) lives in `fastpersist.format.unflatten` and the record format
(`TensorRecord`, dtype tables, JSON form) in `fastpersist.format.records`; their public names are
re-exported here, so `fastpersist.format.flatten` offers the whole round trip.

Example:
    >>> import torch
    >>> flat = flatten({"w": torch.ones(2), "step": 3})
    >>> [r.key_path for r in flat.tensors], len(flat.blobs)
    (['state.w'], 1)
    >>> bufs = [torch.tensor(b.data.copy()) for b in flat.blobs]   # as if read from disk
    >>> unflatten(flat.spec, materialize(flat.tensors, bufs))
    {'w': tensor([1., 1.]), 'step': 3}
"""

from __future__ import annotations

import base64
import collections
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import UnsupportedValueError
from ..gcpause import paused_gc
from .blobs import U8, Blob, DeviceCopiers, Member
from .kinds import checked_attrs, meta_record, set_node, sparse_node
from .limits import MAX_DEPTH, MAX_DIMS, namedtuple_problem
from .nativewalk import ENV as _NATIVE_ENV
from .nativewalk import NATIVE_WALK as _NATIVE_WALK
from .quote import shown
from .records import (
    BYTES_INLINE_MAX_BYTES,
    BYTES_RECORD_DTYPE,
    CANONICAL_CACHE,
    ITEMSIZE,
    NUMPY_KINDS,
    SPEC_VERSION,
    SPEC_VERSION_BYTES,
    SPEC_VERSION_KINDS,
    SPEC_VERSION_PLAIN,
    TORCH_DTYPE_NAME,
    TORCH_DTYPES,
    TensorRecord,
    canonical_layout,
    dtype_itemsize,
    records_from_json,
    records_to_json,
    span_elems,
)
from .refusals import DTENSOR_FIX as _DTENSOR_FIX
from .refusals import is_dtensor as _is_dtensor
from .refusals import key_text as _key_text
from .refusals import loadable as _loadable
from .refusals import tensor_error as _tensor_error
from .refusals import type_name as _type_name
from .refusals import unsupported as _unsupported
from .unflatten import materialize, unflatten
from .values import KEY_ENCODERS, VALUE_ENCODERS, OverLimit

__all__ = [
    "MAX_DEPTH",
    "SPEC_VERSION",
    "TORCH_DTYPES",
    "Blob",
    "FlatState",
    "TensorRecord",
    "dtype_itemsize",
    "flatten",
    "materialize",
    "records_from_json",
    "records_to_json",
    "unflatten",
]

_STRIDED = torch.strided


_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_OrderedDict = collections.OrderedDict


@dataclass(slots=True)
class FlatState:
    """The result of `flatten`: a JSON-ready spec, one record per tensor leaf, the blobs.

    Example:
        >>> flat = flatten([torch.zeros(1), 2.5])
        >>> len(flat.tensors), flat.spec["root"]["t"]
        (1, 'list')
    """

    spec: dict[str, Any]
    tensors: list[TensorRecord]
    blobs: list[Blob]
    #: The tensor / array object behind each record (same order), e.g. for filling in place.
    leaves: list[object] = field(default_factory=list)


# ----------------------------------------------------------------------------- flatten


def flatten(
    state: object, *, root_name: str = "state", native: bool = True, copiers: DeviceCopiers | None = None
) -> FlatState:
    """Split `state` into a JSON-serialisable spec, tensor records and byte blobs.

    Tensors sharing a storage (tied weights, views) go into one blob and come back sharing
    it; the same tensor object reached twice is recorded once. Raises UnsupportedValueError,
    naming the key path, for any leaf or key the format cannot hold and for cycles.

    `copiers`: a save's choice of the tensors it stages from their device (their blobs keep
    what it returns in ``device_copier``); without it, a device tensor's blob is copied to the
    host when its ``data`` is first read.

    The common nodes are walked natively (format/nativewalk.py), the rest by `_Walker` in
    Python; ``native=False`` walks all of it in Python (the reference: the same result).

    Example:
        >>> flat = flatten({"opt": {"state": {0: {"step": torch.tensor(2.0)}}}})
        >>> flat.tensors[0].key_path
        'state.opt.state[0].step'
    """
    walker = _Walker(copiers)
    try:
        with paused_gc():
            if native and _NATIVE_WALK is not None:
                root = _NATIVE_WALK(walker, state, root_name, _NATIVE_ENV)
            else:
                root = walker.node(state, root_name, 0)
            walker.finish()
    except RecursionError:
        raise UnsupportedValueError(f"at key path {shown(root_name)}: the state is nested too deeply to save") from None
    version = SPEC_VERSION_PLAIN
    if walker.kinds_used:
        version = SPEC_VERSION_KINDS
    elif walker.bytes_in_stream:
        version = SPEC_VERSION_BYTES
    return FlatState({"spec_version": version, "root": root}, walker.records, walker.blobs, walker.leaves)


class _Walker:
    """Depth-first walk building the spec, with tensor records and blobs made on the way.

    A storage's first tensor gets a blob of its own at once (zero-copy when contiguous on
    CPU); when a second tensor of the same storage shows up, `finish` replaces that blob by
    one covering the storage range of all of them.

    The native walk (format/nativewalk.py) drives a walker too. Its interface, all the native
    walk reads or writes of a walker: it appends to `records`, `leaves` and `blobs`, fills
    `index` (``id(tensor)`` -> its record), `on_path` (ids of the containers being walked) and
    `storages` (a storage's key -> the record of its first tensor), reads `host_only` and
    `copiers` (calling it, as `_tensor` does, for a tensor it may stage from a device), and
    calls back `node`, `enter` (a container is entered: depth and cycle checks) and `encode_key`
    (a key other than a str) for what it does not build itself.
    """

    __slots__ = (
        "_composites",
        "_groups",
        "blobs",
        "bytes_in_stream",
        "copiers",
        "host_only",
        "index",
        "kinds_used",
        "leaves",
        "on_path",
        "records",
        "storages",
    )

    def __init__(self, copiers: DeviceCopiers | None = None) -> None:
        self.records: list[TensorRecord] = []
        self.leaves: list[object] = []
        self.blobs: list[Blob] = []
        self.index: dict[int, int] = {}
        self.on_path: set[int] = set()
        self.storages: dict[object, int] = {}  # storage -> record of its first tensor
        self._groups: dict[object, list[tuple[int, torch.Tensor, str]]] = {}
        #: The save's choice of the tensors it stages from their device, or None.
        self.copiers = copiers
        #: Every CPU tensor is read in place: none is staged from a device.
        self.host_only = copiers is None or copiers.host_only
        #: Some bytes value went into the data stream (a ``bytes_blob`` node: spec version 2).
        self.bytes_in_stream = False
        #: Some node or record of spec version 3 was written (format/kinds.py).
        self.kinds_used = False
        self._composites: dict[int, dict[str, Any]] = {}  # sparse tensor id -> its node

    def node(self, x: object, path: str, depth: int) -> Any:
        cls = type(x)
        if cls is _Tensor or cls is _Parameter:
            i = self.index.get(id(x))
            if i is None:
                if x.layout is not _STRIDED:  # type: ignore[attr-defined]
                    return self._sparse(x, path, depth)  # type: ignore[arg-type]
                i = self.index[id(x)] = len(self.records)
                self.leaves.append(x)
                self._tensor(x, path, i)  # type: ignore[arg-type]
                if x.__dict__:  # plain attributes (p.foo = ...), kept as torch.save keeps them
                    self.kinds_used = True
                    attrs = checked_attrs(x, path)  # type: ignore[arg-type]
                    return {"t": "tensor_attrs", "i": i, "a": self._mapping(attrs, path, depth, "dict")}
            return {"t": "tensor", "i": i}
        if cls is str or cls is bool or x is None:
            return x
        if cls is dict or cls is _OrderedDict:
            return self._mapping(x, path, depth, "dict" if cls is dict else "odict")  # type: ignore[arg-type]
        if cls is list or cls is tuple:
            return {"t": cls.__name__, "v": self._items(x, path, depth)}  # type: ignore[arg-type]
        if cls is bytes and len(x) > BYTES_INLINE_MAX_BYTES:  # type: ignore[arg-type]
            return self._bytes(x, path)  # type: ignore[arg-type]
        encoder = VALUE_ENCODERS.get(cls)
        if encoder is not None:
            try:
                return encoder(x)
            except OverLimit as e:
                raise _unsupported(path, x, str(e)) from None
        if cls is set or cls is frozenset:
            self.kinds_used = True
            return set_node(x, path, lambda e: self.encode_key(e, path, depth + 1))  # type: ignore[arg-type]
        if cls is bytearray:
            self.kinds_used = True
            return {"t": "bytearray", "v": self.node(bytes(x), path, depth)}  # type: ignore[call-overload]
        if cls is np.ndarray or cls is np.memmap:
            i = self.index.get(id(x))
            if i is None:
                i = self.index[id(x)] = len(self.records)
                self.leaves.append(x)
                self._array(x, path)  # type: ignore[arg-type]
            return {"t": "tensor", "i": i}
        return self._other(x, path, depth)

    def _bytes(self, x: bytes, path: str) -> dict[str, Any]:
        """A large bytes value: a uint8 record whose blob views the bytes (immutable: unwatched)."""
        i = self.index.get(id(x))
        if i is None:
            i = self.index[id(x)] = len(self.records)
            self.leaves.append(x)
            self.records.append(
                TensorRecord(path, "numpy", BYTES_RECORD_DTYPE, [len(x)], [1], len(self.blobs), 0, "cpu", False, False)
            )
            self.blobs.append(Blob(np.frombuffer(x, dtype=U8), x, None))
            self.bytes_in_stream = True
        return {"t": "bytes_blob", "i": i}

    def _sparse(self, x: torch.Tensor, path: str, depth: int) -> dict[str, Any]:
        node = self._composites.get(id(x))
        if node is None:
            self.kinds_used = True
            node = self._composites[id(x)] = sparse_node(
                x, path, lambda part, name: self.node(part, f"{path}.{name}", depth + 1)
            )
        return node

    def enter(self, x: object, path: str, depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise UnsupportedValueError(f"at key path {shown(path)}: containers nested deeper than {MAX_DEPTH} levels")
        if id(x) in self.on_path:
            raise UnsupportedValueError(
                f"at key path {shown(path)}: cyclic reference (a container that contains itself)"
            )
        self.on_path.add(id(x))

    def _mapping(self, x: dict[Any, Any], path: str, depth: int, tag: str) -> dict[str, Any]:
        self.enter(x, path, depth)
        keys: list[Any] = []
        values: list[Any] = []
        for k, v in x.items():
            if type(k) is str:
                keys.append(k)
                child = f"{path}.{k}" if k.isidentifier() else f"{path}[{k!r}]"
            else:
                keys.append(self.encode_key(k, path, depth))
                child = f"{path}[{_key_text(k)}]"
            values.append(self.node(v, child, depth + 1))
        node = {"t": tag, "k": keys, "v": values}
        # Module.state_dict() keeps per-module versions in `_metadata`; load_state_dict uses
        # them to upgrade old layouts, and torch.save keeps them, so we do too.
        meta = vars(x).get("_metadata") if tag == "odict" else None
        if meta is not None:
            node["meta"] = self.node(meta, f"{path}._metadata", depth + 1)
        self.on_path.discard(id(x))
        return node

    def _items(self, x: list[Any] | tuple[Any, ...], path: str, depth: int) -> list[Any]:
        self.enter(x, path, depth)
        out = [self.node(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(x)]
        self.on_path.discard(id(x))
        return out

    def encode_key(self, k: object, path: str, depth: int) -> Any:
        cls = type(k)
        if cls is str or cls is bool or k is None:
            return k
        encoder = KEY_ENCODERS.get(cls)
        if encoder is not None:
            return encoder(k)
        if cls is tuple:
            if depth >= MAX_DEPTH:
                raise UnsupportedValueError(f"at key path {shown(path)}: dict key nested too deeply")
            return {"t": "tuple", "v": [self.encode_key(e, path, depth + 1) for e in k]}  # type: ignore[attr-defined]
        raise UnsupportedValueError(
            f"at key path {shown(path)}: cannot save a dict key of type {_type_name(cls)} "
            f"({shown(k)}). Dict keys may be str, int, float, complex, bool, None, "
            "bytes, torch.dtype, torch.Size, torch.device or tuples of those"
        )

    def _other(self, x: object, path: str, depth: int) -> Any:
        cls = type(x)
        if isinstance(x, tuple):
            fields = getattr(cls, "_fields", None)
            if isinstance(fields, tuple) and all(type(f) is str for f in fields):
                problem = namedtuple_problem(cls.__qualname__, list(fields))
                if problem is not None:
                    raise _unsupported(path, x, f"{problem}, else it cannot be loaded back")
                return {
                    "t": "ntuple",
                    "module": cls.__module__,
                    "name": cls.__qualname__,
                    "fields": list(fields),
                    "v": self._items(x, path, depth),
                }
        if cls is np.str_:  # its dtype and bytes lose trailing NULs; the str does not
            return {"t": "np_str", "v": str.__str__(x)}
        if cls is np.bytes_:
            return {"t": "np_bytes", "v": base64.b64encode(bytes(x)).decode("ascii")}  # type: ignore[call-overload]
        if isinstance(x, np.generic):
            a = np.asarray(x)
            dt = a.dtype
            if dt.kind not in NUMPY_KINDS or dt.hasobject or dt.names is not None or not _loadable(dt):
                raise _unsupported(path, x, f"numpy dtype {dt}")
            return {"t": "np", "dtype": dt.str, "v": base64.b64encode(a.tobytes()).decode("ascii")}
        if isinstance(x, torch.nn.parameter.UninitializedTensorMixin):  # type: ignore[attr-defined]
            raise _unsupported(path, x, "an uninitialized lazy parameter or buffer has no data")
        if _is_dtensor(x):
            raise _unsupported(path, x, _DTENSOR_FIX)
        if isinstance(x, torch.Tensor):
            raise _unsupported(path, x, "tensor subclass; convert it with .as_subclass(torch.Tensor)")
        if isinstance(x, np.ndarray):
            raise _unsupported(path, x, "ndarray subclass; convert it with np.asarray")
        if isinstance(x, (dict, list, tuple, int, float, str, bytes, complex)):
            raise _unsupported(path, x, "a subclass of a supported type; convert it to the base type")
        raise _unsupported(path, x)

    # The native walk makes the common tensor's record and blob itself (walk/tensor.rs); this
    # runs for the rest, and for every tensor of the Python walk (~0.1 us per attribute read).
    def _tensor(self, x: torch.Tensor, path: str, i: int) -> None:
        name = TORCH_DTYPE_NAME.get(x.dtype)
        cpu = x.is_cpu
        if name is None or x.is_nested or x.dim() > MAX_DIMS:
            raise _tensor_error(x, path)
        if not cpu and x.is_meta:
            self.kinds_used = True
            self.records.append(meta_record(x, path, name, len(self.blobs)))
            self.blobs.append(Blob(np.empty(0, U8), x, None))
            return
        plain = not (x.is_neg() or x.is_conj())
        # Empty tensors may all report data_ptr 0, and conj/neg views are not their raw
        # storage bytes: both always get a blob of their own.
        numel = x.numel()
        itemsize = ITEMSIZE[name]
        offset = 0
        if plain and numel:
            # The storage's base address, without building a storage object (~0.3 us).
            offset = int(x.storage_offset())
            ptr = x.data_ptr() - offset * itemsize
            key = ptr if cpu else (ptr, str(x.device))
            first = self.storages.setdefault(key, i)
            if first != i:
                group = self._groups.get(key)
                if group is None:
                    rec = self.records[first]
                    group = self._groups[key] = [(first, self.leaves[first], rec.key_path)]  # type: ignore[list-item]
                group.append((i, x, path))
                self.records.append(None)  # type: ignore[arg-type]  # filled by finish()
                return
        size = x.shape
        # Records share the cached shape and stride lists: records are never mutated.
        shape, stride = CANONICAL_CACHE.get(size) or canonical_layout(size)
        data = None
        source = x
        nbytes = numel * itemsize
        if not numel:
            data = np.empty(0, U8)  # an empty tensor's strides need not allow a byte view
            stride = list(x.stride())
        else:
            if not plain:  # rare: a copy with the same strides (at storage offset 0)
                source = x.detach().resolve_conj().resolve_neg()
                offset = int(source.storage_offset())
            if offset or not source.is_contiguous():
                # Kept as saved: the storage from its base to the last element, so the strides,
                # storage offset and memory format come back (torch.save keeps the whole storage).
                stride = list(source.stride())
                span = offset + span_elems(shape, stride)
                source = source.detach().as_strided((span,), (1,), 0)  # a view: same version counter
                nbytes = span * itemsize
            elif source.stride() != tuple(stride):  # contiguous, any stride on a size-1 dimension
                stride = list(source.stride())
        copiers = self.copiers
        copier = copiers(x) if copiers is not None and numel and not (cpu and self.host_only) else None
        version = None
        if plain and numel and (cpu or copier is not None):  # the source views x: the guard watches it
            try:
                version = x._version
            except RuntimeError:  # inference tensors track no version
                pass
        self.records.append(
            TensorRecord(
                path,
                "torch",
                name,
                shape,
                stride,
                len(self.blobs),
                offset * itemsize,
                "cpu" if cpu else str(x.device),
                x.requires_grad,
                type(x) is _Parameter,
            )
        )
        self.blobs.append(Blob(data, source, version, nbytes, copier))

    def _array(self, a: np.ndarray, path: str) -> None:
        dt = a.dtype
        if dt.kind not in NUMPY_KINDS or dt.hasobject or dt.names is not None or dt.itemsize == 0 or not _loadable(dt):
            raise _unsupported(path, a, f"numpy dtype {dt}; use a numeric, bool, datetime or string dtype")
        shape, stride = canonical_layout(a.shape)
        self.records.append(
            TensorRecord(path, "numpy", dt.str, list(shape), list(stride), len(self.blobs), 0, "cpu", False, False)
        )
        self.blobs.append(Blob(np.ascontiguousarray(a).reshape(-1).view(U8), a, None))

    def finish(self) -> None:
        """Give every storage reached by two or more tensors one blob shared by all of them."""
        for group in self._groups.values():
            self._share(group)

    def _share(self, group: list[tuple[int, torch.Tensor, str]]) -> None:
        starts: list[int] = []
        lo = hi = -1
        for _, t, _ in group:
            item = t.element_size()
            start = int(t.storage_offset()) * item
            starts.append(start)
            lo = start if lo < 0 else min(lo, start)
            hi = max(hi, start + span_elems(t.shape, t.stride()) * item)
        lo = 0  # from the storage's base, so that every view keeps its storage offset
        # Tensors made from the same memory may carry distinct storages; take the largest.
        owner = max((t for _, t, _ in group), key=lambda t: t.untyped_storage().nbytes())
        raw = torch.empty(0, dtype=torch.uint8, device=owner.device)
        raw.set_(owner.untyped_storage(), lo, (hi - lo,), (1,))
        blob = self.records[group[0][0]].blob
        copiers = self.copiers
        copier = copiers(owner) if copiers is not None and not (owner.is_cpu and self.host_only) else None
        # The source itself, not a host copy, is watched: through every member, as each may
        # have a version counter of its own (`raw` is a new tensor with one of its own, too).
        members = _members(group) if raw.is_cpu or copier is not None else ()
        version = raw._version if members else None
        # Viewed (or, on a device without a copier, copied to the host) when first read.
        self.blobs[blob] = Blob(None, raw, version, hi - lo, copier, members)
        for (i, t, path), start in zip(group, starts, strict=True):
            self.records[i] = TensorRecord(
                path,
                "torch",
                TORCH_DTYPE_NAME[t.dtype],
                list(t.shape),
                list(t.stride()),
                blob,
                start - lo,
                "cpu" if t.is_cpu else str(t.device),
                t.requires_grad,
                type(t) is _Parameter,
            )


def _members(group: list[tuple[int, torch.Tensor, str]]) -> tuple[Member, ...]:
    """The tensors of a shared storage with their versions (inference tensors track none)."""
    members = []
    for i, t, _ in group:
        try:
            members.append(Member(i, t, t._version))
        except RuntimeError:
            pass
    return tuple(members)
