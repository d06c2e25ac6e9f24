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
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import device as _device
from ..device import copier_for as _copier_for
from ..errors import UnsupportedValueError
from ..gcpause import paused_gc
from .blobs import U8, Blob, byte_view
from .limits import MAX_DEPTH, MAX_DIMS, namedtuple_problem
from .quote import shown
from .records import (
    BYTES_INLINE_MAX_BYTES,
    BYTES_RECORD_DTYPE,
    CANONICAL_CACHE,
    ITEMSIZE,
    NUMPY_KINDS,
    SPEC_VERSION,
    SPEC_VERSION_PLAIN,
    TORCH_DTYPE_NAME,
    TORCH_DTYPES,
    TensorRecord,
    canonical_layout,
    dtype_itemsize,
    numpy_dtype,
    records_from_json,
    records_to_json,
    span_elems,
)
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

_SUPPORTED = (
    "Supported: torch tensors (strided, non-quantized, any plain dtype), numpy arrays of "
    "numeric/bool/datetime/string dtypes, dict, OrderedDict, list, tuple, namedtuple, None, "
    "bool, int, float, complex, str, bytes, torch.dtype, torch.Size, torch.device and numpy "
    "scalars"
)

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


def flatten(state: object, *, root_name: str = "state") -> FlatState:
    """Split `state` into a JSON-serialisable spec, tensor records and byte blobs.

    Tensors sharing a storage (tied weights, views) go into one blob and come back sharing
    it; the same tensor object reached twice is recorded once. Raises UnsupportedValueError,
    naming the key path, for any leaf or key the format cannot hold and for cycles.

    Example:
        >>> flat = flatten({"opt": {"state": {0: {"step": torch.tensor(2.0)}}}})
        >>> flat.tensors[0].key_path
        'state.opt.state[0].step'
    """
    walker = _Walker()
    try:
        with paused_gc():
            root = walker.node(state, root_name, 0)
            walker.finish()
    except RecursionError:
        raise UnsupportedValueError(f"at key path {shown(root_name)}: the state is nested too deeply to save") from None
    version = SPEC_VERSION if walker.bytes_in_stream else SPEC_VERSION_PLAIN
    return FlatState({"spec_version": version, "root": root}, walker.records, walker.blobs, walker.leaves)


def _type_name(cls: type) -> str:
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _unsupported(path: str, x: object, why: str = "") -> UnsupportedValueError:
    why = f" ({why})" if why else ""
    return UnsupportedValueError(
        f"at key path {shown(path)}: cannot save value of type {_type_name(type(x))}{why}. {_SUPPORTED}."
    )


def _key_text(k: object) -> str:
    """A non-str dict key as it appears inside a key path (whole: a key path is data, and
    messages bound it with :func:`~fastpersist.format.quote.shown`)."""
    try:
        return repr(k)
    except ValueError:  # an int past sys.get_int_max_str_digits()
        return hex(k) if isinstance(k, int) else f"<{type(k).__name__}>"


class _Walker:
    """Depth-first walk building the spec, with tensor records and blobs made on the way.

    A storage's first tensor gets a blob of its own at once (zero-copy when contiguous on
    CPU); when a second tensor of the same storage shows up, `finish` replaces that blob by
    one covering the storage range of all of them.
    """

    __slots__ = (
        "_groups",
        "_host_only",
        "_index",
        "_on_path",
        "_storages",
        "blobs",
        "bytes_in_stream",
        "leaves",
        "records",
    )

    def __init__(self) -> None:
        self.records: list[TensorRecord] = []
        self.leaves: list[object] = []
        self.blobs: list[Blob] = []
        self._index: dict[int, int] = {}
        self._on_path: set[int] = set()
        self._storages: dict[object, int] = {}  # storage -> record of its first tensor
        self._groups: dict[object, list[tuple[int, torch.Tensor, str]]] = {}
        #: No copier is installed (fastpersist.device.use_copier): CPU tensors are read in place.
        self._host_only = _device.installed_copier is None
        #: Some bytes value went into the data stream (a ``bytes_blob`` node: spec version 2).
        self.bytes_in_stream = False

    def node(self, x: object, path: str, depth: int) -> Any:
        cls = type(x)
        if cls is _Tensor or cls is _Parameter:
            i = self._index.get(id(x))
            if i is None:
                i = self._index[id(x)] = len(self.records)
                self.leaves.append(x)
                self._tensor(x, path, i)  # type: ignore[arg-type]
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
        if cls is np.ndarray or cls is np.memmap:
            i = self._index.get(id(x))
            if i is None:
                i = self._index[id(x)] = len(self.records)
                self.leaves.append(x)
                self._array(x, path)  # type: ignore[arg-type]
            return {"t": "tensor", "i": i}
        return self._other(x, path, depth)

    def _bytes(self, x: bytes, path: str) -> dict[str, Any]:
        """A large bytes value: a uint8 record whose blob views the bytes (immutable: unwatched)."""
        i = self._index.get(id(x))
        if i is None:
            i = self._index[id(x)] = len(self.records)
            self.leaves.append(x)
            self.records.append(
                TensorRecord(path, "numpy", BYTES_RECORD_DTYPE, [len(x)], [1], len(self.blobs), 0, "cpu", False, False)
            )
            self.blobs.append(Blob(np.frombuffer(x, dtype=U8), x, None))
            self.bytes_in_stream = True
        return {"t": "bytes_blob", "i": i}

    def _enter(self, x: object, path: str, depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise UnsupportedValueError(f"at key path {shown(path)}: containers nested deeper than {MAX_DEPTH} levels")
        if id(x) in self._on_path:
            raise UnsupportedValueError(
                f"at key path {shown(path)}: cyclic reference (a container that contains itself)"
            )
        self._on_path.add(id(x))

    def _mapping(self, x: dict[Any, Any], path: str, depth: int, tag: str) -> dict[str, Any]:
        self._enter(x, path, depth)
        keys: list[Any] = []
        values: list[Any] = []
        for k, v in x.items():
            if type(k) is str:
                keys.append(k)
                child = f"{path}.{k}" if k.isidentifier() else f"{path}[{k!r}]"
            else:
                keys.append(self._key(k, path, depth))
                child = f"{path}[{_key_text(k)}]"
            values.append(self.node(v, child, depth + 1))
        node = {"t": tag, "k": keys, "v": values}
        # Module.state_dict() keeps per-module versions in `_metadata`; load_state_dict uses
        # them to upgrade old layouts, and torch.save keeps them, so we do too.
        meta = vars(x).get("_metadata") if tag == "odict" else None
        if meta is not None:
            node["meta"] = self.node(meta, f"{path}._metadata", depth + 1)
        self._on_path.discard(id(x))
        return node

    def _items(self, x: list[Any] | tuple[Any, ...], path: str, depth: int) -> list[Any]:
        self._enter(x, path, depth)
        out = [self.node(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(x)]
        self._on_path.discard(id(x))
        return out

    def _key(self, k: object, path: str, depth: int) -> Any:
        cls = type(k)
        if cls is str or cls is bool or k is None:
            return k
        encoder = KEY_ENCODERS.get(cls)
        if encoder is not None:
            return encoder(k)
        if cls is tuple:
            if depth >= MAX_DEPTH:
                raise UnsupportedValueError(f"at key path {shown(path)}: dict key nested too deeply")
            return {"t": "tuple", "v": [self._key(e, path, depth + 1) for e in k]}  # type: ignore[attr-defined]
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

    # This runs once per tensor of the state: every attribute read here costs ~0.1 us, and a
    # 10,000-tensor state is a budget of 2.5 us per tensor for the whole walk.
    def _tensor(self, x: torch.Tensor, path: str, i: int) -> None:
        name = TORCH_DTYPE_NAME.get(x.dtype)
        cpu = x.is_cpu
        if name is None or x.layout is not _STRIDED or x.is_nested or (not cpu and x.is_meta) or x.dim() > MAX_DIMS:
            raise _tensor_error(x, path)
        plain = not (x.is_neg() or x.is_conj())
        # Empty tensors may all report data_ptr 0, and conj/neg views are not their raw
        # storage bytes: both always get a blob of their own.
        numel = x.numel()
        itemsize = ITEMSIZE[name]
        if plain and numel:
            # The storage's base address, without building a storage object (~0.3 us).
            ptr = x.data_ptr() - x.storage_offset() * itemsize
            key = ptr if cpu else (ptr, str(x.device))
            first = self._storages.setdefault(key, i)
            if first != i:
                group = self._groups.get(key)
                if group is None:
                    rec = self.records[first]
                    owner = self.blobs[rec.blob].source_tensor
                    group = self._groups[key] = [(first, owner, rec.key_path)]
                group.append((i, x, path))
                self.records.append(None)  # type: ignore[arg-type]  # filled by finish()
                return
        data = None
        source = x
        copier = _copier_for(x) if numel and not (cpu and self._host_only) else None
        if not numel:
            data = np.empty(0, U8)  # an empty tensor's strides need not allow a byte view
        elif copier is not None:
            if not (plain and x.is_contiguous()):  # rare: made contiguous on its device
                source = x.detach().resolve_conj().resolve_neg().contiguous()
        elif not (plain and cpu and x.is_contiguous()):
            data = byte_view(x.detach().resolve_conj().resolve_neg().contiguous().cpu())
        size = x.shape
        # Records share the cached shape and stride lists: records are never mutated.
        shape, stride = CANONICAL_CACHE.get(size) or canonical_layout(size)
        version = None
        if data is None and source is x:  # the source itself, not a copy: the guard watches it
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
                0,
                "cpu" if cpu else str(x.device),
                x.requires_grad,
                type(x) is _Parameter,
            )
        )
        self.blobs.append(Blob(data, source, version, numel * itemsize, copier))

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
        # Each tensor starts a multiple of its own itemsize (at most 16) past the storage
        # base, so a blob starting at a multiple of 16 keeps every offset_bytes aligned.
        lo -= lo % 16
        # Tensors made from the same memory may carry distinct storages; take the largest.
        owner = max((t for _, t, _ in group), key=lambda t: t.untyped_storage().nbytes())
        raw = torch.empty(0, dtype=torch.uint8, device=owner.device)
        raw.set_(owner.untyped_storage(), lo, (hi - lo,), (1,))
        blob = self.records[group[0][0]].blob
        copier = _copier_for(owner) if not owner.is_cpu or _device.installed_copier is not None else None
        version = None
        if raw.is_cpu or copier is not None:  # the source itself, not a host copy: watched
            try:
                version = owner._version
            except RuntimeError:  # inference tensors track no version
                pass
        if copier is not None:
            self.blobs[blob] = Blob(None, raw, version, hi - lo, copier)
        else:
            self.blobs[blob] = Blob(raw.cpu().numpy(), owner, version)
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


_DTENSOR_FIX = (
    "a DTensor is one rank's part of a distributed tensor, and .as_subclass() would keep it one: "
    "save .full_tensor() (the whole tensor, gathered on every rank) or .to_local() (this rank's "
    "shard, e.g. with sharded=True), or save the state with torch.distributed.checkpoint through "
    "fastpersist.integrations.dcp"
)


def _is_dtensor(x: object) -> bool:
    # Only a process that imported torch.distributed.tensor can hold a DTensor: no import here.
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return isinstance(dtensor, type) and isinstance(x, dtensor)


def _loadable(dt: np.dtype[Any]) -> bool:
    """Whether a reader accepts this numpy dtype (records.numpy_dtype: the one rule for both sides)."""
    try:
        numpy_dtype(dt.str)
    except ValueError:
        return False
    return True


def _tensor_error(t: torch.Tensor, path: str) -> UnsupportedValueError:
    if t.layout is not _STRIDED:
        why = f"layout {t.layout}; convert it with .to_dense()"
    elif t.is_quantized:
        why = "quantized tensor; save .int_repr() and the quantization parameters"
    elif t.is_nested:
        why = "nested tensor; save its components from .unbind()"
    elif t.is_meta:
        why = "a meta tensor has no data"
    elif t.dim() > MAX_DIMS:
        why = f"{t.dim()} dimensions; a checkpoint holds at most {MAX_DIMS}, reshape it"
    else:
        why = f"dtype {t.dtype} is not supported"
    return _unsupported(path, t, why)
