"""Flatten a nested training state into a JSON tree spec, tensor records and byte blobs; and back.

Nothing here pickles, imports by name or evaluates text: a spec read from a file is data,
validated node by node, and every value it can produce is built from a fixed list of types.

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
import gc
import keyword
import math
import re
import reprlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import UnsupportedValueError

SPEC_VERSION = 1
# Python's json encoder and decoder recurse (two levels per container), so a deeper state
# could be written but not read back; no real training state comes close.
MAX_DEPTH = 200
_MAX_DIMS = 64
_MAX_EXTENT = 1 << 62
_MAX_FIELDS = 4096  # namedtuple fields; building a class costs time linear in them

_SUPPORTED = (
    "Supported: torch tensors (strided, non-quantized, any plain dtype), numpy arrays of "
    "numeric/bool/datetime/string dtypes, dict, OrderedDict, list, tuple, namedtuple, None, "
    "bool, int, float, complex, str, bytes, torch.dtype, torch.Size, torch.device and numpy "
    "scalars"
)

# Tensor dtypes whose bytes we write; filtered by what this torch build has.
_TORCH_DTYPE_CANDIDATES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "bits8",
    "bits16",
    "bits1x8",
    "bits2x4",
    "bits4x2",
)
TORCH_DTYPES: dict[str, torch.dtype] = {
    n: d for n in _TORCH_DTYPE_CANDIDATES if isinstance(d := vars(torch).get(n), torch.dtype)
}
_TORCH_DTYPE_NAME: dict[torch.dtype, str] = {d: n for n, d in TORCH_DTYPES.items()}
_ITEMSIZE: dict[str, int] = {n: d.itemsize for n, d in TORCH_DTYPES.items()}
# Every torch.dtype, for dtype-valued leaves; vars() so no lazy torch submodule is imported.
_ANY_TORCH_DTYPE: dict[str, torch.dtype] = {n: d for n, d in vars(torch).items() if isinstance(d, torch.dtype)}
# Dtypes for which Tensor.numpy() works: about twice as fast as a uint8 torch view.
_NUMPY_VIEWABLE = frozenset(
    getattr(torch, n)
    for n in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
)
_NUMPY_KINDS = frozenset("biufcmMSU")
_U8 = np.dtype(np.uint8)
_NUMPY_DTYPE_RE = re.compile(r"[<>|=][biufcmMSU][0-9]{1,6}(?:\[[0-9]{0,9}[a-zA-Z]{1,3}\])?")
_DEC_INT_RE = re.compile(r"-?(?:0|[1-9][0-9]*)")
_HEX_INT_RE = re.compile(r"-?0x[0-9a-f]+")
_DEVICE_RE = re.compile(r"[a-z_][a-z0-9_]{0,31}(?::[0-9]{1,6})?")

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_OrderedDict = collections.OrderedDict


class Blob:
    """One contiguous run of bytes to write: a storage range or one tensor's values.

    `data` is a 1-D C-contiguous uint8 CPU array; it views the source memory when it can
    (contiguous CPU tensors and arrays), else it holds a copy. `source` keeps that memory alive
    and `version` (torch's `_version` at flatten time, None for numpy and inference tensors)
    lets a save detect that the source was modified before staging finished.

    A zero-copy view of a tensor is only built when `data` is first read (about 1 us per
    tensor, a third of flatten's cost on many small tensors): planning needs `nbytes` alone.

    Example:
        >>> blob = flatten(torch.zeros(3)).blobs[0]
        >>> blob.nbytes, blob.data.dtype
        (12, dtype('uint8'))
    """

    __slots__ = ("_data", "nbytes", "source", "version")

    def __init__(self, data: np.ndarray | None, source: object, version: int | None, nbytes: int = -1) -> None:
        self._data = data
        self.source = source
        self.version = version
        self.nbytes = data.nbytes if data is not None else nbytes

    @property
    def data(self) -> np.ndarray:
        if self._data is None:
            # Only left unset for a non-empty contiguous plain CPU tensor (_Walker._tensor).
            data = _byte_view(self.source)  # type: ignore[arg-type]
            if data.nbytes != self.nbytes:
                raise RuntimeError(
                    f"a tensor of {data.nbytes} bytes was resized from {self.nbytes} bytes between "
                    "flatten() and reading its data; do not resize tensors while a save is staging"
                )
            self._data = data
        return self._data

    def __repr__(self) -> str:
        return f"Blob(nbytes={self.nbytes}, source={type(self.source).__name__}, version={self.version})"


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """A 1-D uint8 numpy view of a non-empty contiguous plain CPU tensor's bytes."""
    if t.dtype in _NUMPY_VIEWABLE:
        return (t.detach() if t.requires_grad else t).numpy().ravel().view(_U8)
    # as_strided, since "contiguous" allows any stride on a dimension of size 1
    return t.detach().as_strided((t.numel(),), (1,)).view(torch.uint8).numpy()


@dataclass(slots=True)
class TensorRecord:
    """Where one tensor leaf's bytes live inside a blob, and how to rebuild it.

    `stride` is in elements; `offset_bytes` locates element [0, ..., 0] inside the blob.
    `dtype` is the torch name without "torch." ("bfloat16") or numpy's `dtype.str` ("<f4").

    Example:
        >>> flatten({"w": torch.zeros(2, 3)}).tensors[0].stride
        [3, 1]
    """

    key_path: str
    kind: str
    dtype: str
    shape: list[int]
    stride: list[int]
    blob: int
    offset_bytes: int
    device: str
    requires_grad: bool
    is_parameter: bool = False


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
    # The walk allocates a few objects per leaf and no cycles; collections triggered by
    # them would cost more than the walk itself on a state of many small tensors.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        root = walker.node(state, root_name, 0)
        walker.finish()
    except RecursionError:
        raise UnsupportedValueError(f"at key path {root_name}: the state is nested too deeply to save") from None
    finally:
        if gc_was_enabled:
            gc.enable()
    return FlatState({"spec_version": SPEC_VERSION, "root": root}, walker.records, walker.blobs, walker.leaves)


def _type_name(cls: type) -> str:
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _unsupported(path: str, x: object, why: str = "") -> UnsupportedValueError:
    why = f" ({why})" if why else ""
    return UnsupportedValueError(
        f"at key path {path}: cannot save value of type {_type_name(type(x))}{why}. {_SUPPORTED}."
    )


def _safe_repr(k: object) -> str:
    try:
        return repr(k)
    except ValueError:  # an int past sys.get_int_max_str_digits()
        return hex(k) if isinstance(k, int) else f"<{type(k).__name__}>"


def _int_text(x: int) -> str:
    try:
        return str(x)
    except ValueError:  # too many digits for decimal conversion; hex has no limit
        return hex(x)


def _float_text(x: float) -> str:
    if math.isnan(x) and math.copysign(1.0, x) < 0:
        return "-nan"  # float.hex drops the sign of a NaN
    return x.hex()


def _enc_int(x: int) -> dict[str, Any]:
    return {"t": "int", "v": _int_text(x)}


def _enc_float(x: float) -> dict[str, Any]:
    return {"t": "float", "v": _float_text(x)}


def _enc_complex(x: complex) -> dict[str, Any]:
    return {"t": "complex", "re": _float_text(x.real), "im": _float_text(x.imag)}


def _enc_bytes(x: bytes) -> dict[str, Any]:
    return {"t": "bytes", "v": base64.b64encode(x).decode("ascii")}


def _enc_dtype(x: torch.dtype) -> dict[str, Any]:
    return {"t": "dtype", "v": str(x).removeprefix("torch.")}


def _enc_size(x: torch.Size) -> dict[str, Any]:
    return {"t": "size", "v": list(x)}


def _enc_device(x: torch.device) -> dict[str, Any]:
    return {"t": "device", "v": str(x)}


_VALUE_ENCODERS: dict[type, Callable[[Any], dict[str, Any]]] = {
    int: _enc_int,
    float: _enc_float,
    complex: _enc_complex,
    bytes: _enc_bytes,
    torch.dtype: _enc_dtype,
    torch.Size: _enc_size,
    torch.device: _enc_device,
}
_KEY_ENCODERS: dict[type, Callable[[Any], dict[str, Any]]] = {
    int: _enc_int,
    float: _enc_float,
    bytes: _enc_bytes,
    torch.dtype: _enc_dtype,
}


class _Walker:
    """Depth-first walk building the spec, with tensor records and blobs made on the way.

    A storage's first tensor gets a blob of its own at once (zero-copy when contiguous on
    CPU); when a second tensor of the same storage shows up, `finish` replaces that blob by
    one covering the storage range of all of them.
    """

    __slots__ = ("_groups", "_index", "_on_path", "_storages", "blobs", "leaves", "records")

    def __init__(self) -> None:
        self.records: list[TensorRecord] = []
        self.leaves: list[object] = []
        self.blobs: list[Blob] = []
        self._index: dict[int, int] = {}
        self._on_path: set[int] = set()
        self._storages: dict[object, int] = {}  # storage -> record of its first tensor
        self._groups: dict[object, list[tuple[int, torch.Tensor, str]]] = {}

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
        encoder = _VALUE_ENCODERS.get(cls)
        if encoder is not None:
            return encoder(x)
        if cls is np.ndarray or cls is np.memmap:
            i = self._index.get(id(x))
            if i is None:
                i = self._index[id(x)] = len(self.records)
                self.leaves.append(x)
                self._array(x, path)  # type: ignore[arg-type]
            return {"t": "tensor", "i": i}
        return self._other(x, path, depth)

    def _enter(self, x: object, path: str, depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise UnsupportedValueError(f"at key path {path}: containers nested deeper than {MAX_DEPTH} levels")
        if id(x) in self._on_path:
            raise UnsupportedValueError(f"at key path {path}: cyclic reference (a container that contains itself)")
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
                child = f"{path}[{_safe_repr(k)}]"
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
        encoder = _KEY_ENCODERS.get(cls)
        if encoder is not None:
            return encoder(k)
        if cls is tuple:
            if depth >= MAX_DEPTH:
                raise UnsupportedValueError(f"at key path {path}: dict key nested too deeply")
            return {"t": "tuple", "v": [self._key(e, path, depth + 1) for e in k]}  # type: ignore[attr-defined]
        raise UnsupportedValueError(
            f"at key path {path}: cannot save a dict key of type {_type_name(cls)} "
            f"({_safe_repr(k)[:80]}). Dict keys may be str, int, float, bool, None, bytes, "
            "torch.dtype or tuples of those"
        )

    def _other(self, x: object, path: str, depth: int) -> Any:
        cls = type(x)
        if isinstance(x, tuple):
            fields = getattr(cls, "_fields", None)
            if isinstance(fields, tuple) and all(type(f) is str for f in fields):
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
            if dt.kind not in _NUMPY_KINDS or dt.hasobject or dt.names is not None:
                raise _unsupported(path, x, f"numpy dtype {dt}")
            return {"t": "np", "dtype": dt.str, "v": base64.b64encode(a.tobytes()).decode("ascii")}
        if isinstance(x, torch.nn.parameter.UninitializedTensorMixin):  # type: ignore[attr-defined]
            raise _unsupported(path, x, "an uninitialized lazy parameter or buffer has no data")
        if isinstance(x, torch.Tensor):
            raise _unsupported(path, x, "tensor subclass; convert it with .as_subclass(torch.Tensor)")
        if isinstance(x, np.ndarray):
            raise _unsupported(path, x, "ndarray subclass; convert it with np.asarray")
        if isinstance(x, (dict, list, tuple, int, float, str, bytes, complex)):
            raise _unsupported(path, x, "a subclass of a supported type; convert it to the base type")
        raise _unsupported(path, x)

    # This runs once per tensor of the state: every attribute read here costs ~0.1 us.
    def _tensor(self, x: torch.Tensor, path: str, i: int) -> None:
        name = _TORCH_DTYPE_NAME.get(x.dtype)
        cpu = x.is_cpu
        if name is None or x.layout is not _STRIDED or x.is_nested or (not cpu and x.is_meta):
            raise _tensor_error(x, path)
        plain = not (x.is_conj() or x.is_neg())
        # Empty tensors may all report data_ptr 0, and conj/neg views are not their raw
        # storage bytes: both always get a blob of their own.
        numel = x.numel()
        if plain and numel:
            ptr = x.untyped_storage().data_ptr()
            key = ptr if cpu else (ptr, str(x.device))
            first = self._storages.get(key)
            if first is None:
                self._storages[key] = i
            else:
                group = self._groups.get(key)
                if group is None:
                    rec = self.records[first]
                    owner: torch.Tensor = self.blobs[rec.blob].source  # type: ignore[assignment]
                    group = self._groups[key] = [(first, owner, rec.key_path)]
                group.append((i, x, path))
                self.records.append(None)  # type: ignore[arg-type]  # filled by finish()
                return
        data = None
        if not numel:
            data = np.empty(0, _U8)  # an empty tensor's strides need not allow a byte view
        elif not (plain and cpu and x.is_contiguous()):
            data = _byte_view(x.detach().resolve_conj().resolve_neg().contiguous().cpu())
        size = x.shape
        canonical = _CANONICAL.get(size) or _canonical(size)
        try:
            version = x._version
        except RuntimeError:  # inference tensors track no version
            version = None
        self.records.append(
            TensorRecord(
                path,
                "torch",
                name,
                list(canonical[0]),
                list(canonical[1]),
                len(self.blobs),
                0,
                "cpu" if cpu else str(x.device),
                x.requires_grad,
                type(x) is _Parameter,
            )
        )
        self.blobs.append(Blob(data, x, version, numel * _ITEMSIZE[name]))

    def _array(self, a: np.ndarray, path: str) -> None:
        dt = a.dtype
        if dt.kind not in _NUMPY_KINDS or dt.hasobject or dt.names is not None or dt.itemsize == 0:
            raise _unsupported(path, a, f"numpy dtype {dt}; use a numeric, bool, datetime or string dtype")
        shape, stride = _canonical(a.shape)
        self.records.append(
            TensorRecord(path, "numpy", dt.str, list(shape), list(stride), len(self.blobs), 0, "cpu", False, False)
        )
        self.blobs.append(Blob(np.ascontiguousarray(a).reshape(-1).view(_U8), a, None))

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
            hi = max(hi, start + _span_elems(t.shape, t.stride()) * item)
        # Each tensor starts a multiple of its own itemsize (at most 16) past the storage
        # base, so a blob starting at a multiple of 16 keeps every offset_bytes aligned.
        lo -= lo % 16
        # Tensors made from the same memory may carry distinct storages; take the largest.
        owner = max((t for _, t, _ in group), key=lambda t: t.untyped_storage().nbytes())
        raw = torch.empty(0, dtype=torch.uint8, device=owner.device)
        raw.set_(owner.untyped_storage(), lo, (hi - lo,), (1,))
        blob = self.records[group[0][0]].blob
        try:
            version = owner._version
        except RuntimeError:  # inference tensors track no version
            version = None
        self.blobs[blob] = Blob(raw.cpu().numpy(), owner, version)
        for (i, t, path), start in zip(group, starts, strict=True):
            self.records[i] = TensorRecord(
                path,
                "torch",
                _TORCH_DTYPE_NAME[t.dtype],
                list(t.shape),
                list(t.stride()),
                blob,
                start - lo,
                "cpu" if t.is_cpu else str(t.device),
                t.requires_grad,
                type(t) is _Parameter,
            )


# ----------------------------------------------------------------------------- packing helpers


_STRIDED = torch.strided
_CANONICAL: dict[tuple[int, ...], tuple[list[int], list[int]]] = {}


def _canonical(shape: Sequence[int]) -> tuple[list[int], list[int]]:
    """`shape` and its C-contiguous strides in elements, cached by shape; do not mutate."""
    stride = [1] * len(shape)
    acc = 1
    for d in range(len(shape) - 1, -1, -1):
        stride[d] = acc
        acc *= max(shape[d], 1)
    cached = (list(shape), stride)
    if len(_CANONICAL) < 4096:
        _CANONICAL[tuple(shape)] = cached
    return cached


def _tensor_error(t: torch.Tensor, path: str) -> UnsupportedValueError:
    if t.layout is not _STRIDED:
        why = f"layout {t.layout}; convert it with .to_dense()"
    elif t.is_quantized:
        why = "quantized tensor; save .int_repr() and the quantization parameters"
    elif t.is_nested:
        why = "nested tensor; save its components from .unbind()"
    elif t.is_meta:
        why = "a meta tensor has no data"
    else:
        why = f"dtype {t.dtype} is not supported"
    return _unsupported(path, t, why)


def _span_elems(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements from the first to one past the last addressed element (0 when empty)."""
    span = 1
    for n, s in zip(shape, stride, strict=True):
        if n == 0:
            return 0
        span += (n - 1) * s
    return span


# ----------------------------------------------------------------------------- records


_NUMPY_DTYPE_CACHE: dict[str, np.dtype[Any]] = {}


def _numpy_dtype(s: str) -> np.dtype[Any]:
    """Validate a numpy dtype string read from a file."""
    dt = _NUMPY_DTYPE_CACHE.get(s) if type(s) is str else None
    if dt is not None:
        return dt
    if not (type(s) is str and _NUMPY_DTYPE_RE.fullmatch(s)):
        raise ValueError(f"unknown numpy dtype {s!r}")
    try:
        dt = np.dtype(s)
    except (TypeError, ValueError):
        raise ValueError(f"unknown numpy dtype {s!r}") from None
    if dt.kind not in _NUMPY_KINDS or dt.hasobject or dt.itemsize == 0 or dt.str != s:
        raise ValueError(f"unsupported numpy dtype {s!r}")
    if len(_NUMPY_DTYPE_CACHE) < 1024:
        _NUMPY_DTYPE_CACHE[s] = dt
    return dt


def dtype_itemsize(kind: str, dtype: str) -> int:
    """Bytes per element of a record dtype; ValueError for an unknown kind or dtype.

    Example:
        >>> dtype_itemsize("torch", "bfloat16"), dtype_itemsize("numpy", "<c16")
        (2, 16)
    """
    if kind == "torch":
        d = TORCH_DTYPES.get(dtype) if isinstance(dtype, str) else None
        if d is None:
            raise ValueError(f"unknown torch dtype {dtype!r}")
        return d.itemsize
    if kind == "numpy":
        return _numpy_dtype(dtype).itemsize
    raise ValueError(f"unknown tensor kind {kind!r}; expected 'torch' or 'numpy'")


_RECORD_FIELDS = (
    "key_path",
    "kind",
    "dtype",
    "shape",
    "stride",
    "blob",
    "offset_bytes",
    "device",
    "requires_grad",
    "is_parameter",
)


def records_to_json(records: list[TensorRecord]) -> list[dict[str, Any]]:
    """JSON-ready dicts, one per record, in the same order.

    Example:
        >>> records_to_json(flatten(torch.zeros(2)).tensors)[0]["dtype"]
        'float32'
    """
    return [
        {
            "key_path": r.key_path,
            "kind": r.kind,
            "dtype": r.dtype,
            "shape": r.shape,
            "stride": r.stride,
            "blob": r.blob,
            "offset_bytes": r.offset_bytes,
            "device": r.device,
            "requires_grad": r.requires_grad,
            "is_parameter": r.is_parameter,
        }
        for r in records
    ]


def _is_int(x: object) -> bool:
    return type(x) is int and 0 <= x < _MAX_EXTENT


def records_from_json(items: object) -> list[TensorRecord]:
    """Validate JSON record dicts (from an untrusted file) and build TensorRecords.

    Raises ValueError naming the record and field on any malformed entry.

    Example:
        >>> recs = records_from_json(records_to_json(flatten(torch.zeros(2)).tensors))
        >>> recs[0].shape
        [2]
    """
    if type(items) is not list:  # malformed file content is a ValueError, whatever its type
        raise ValueError(f"tensor records must be a list, got {type(items).__name__}")
    return [_record_from_json(i, item) for i, item in enumerate(items)]


def _record_from_json(i: int, item: object) -> TensorRecord:
    def bad(why: str) -> ValueError:
        return ValueError(f"tensor record {i}: {why}")

    if not isinstance(item, dict):
        raise bad(f"expected an object, got {type(item).__name__}")
    if set(item) != set(_RECORD_FIELDS):
        missing = sorted(set(_RECORD_FIELDS) - set(item))
        extra = sorted(str(k) for k in set(item) - set(_RECORD_FIELDS))
        raise bad(f"wrong fields (missing {missing}, unexpected {extra})")
    key_path, kind, dtype = item["key_path"], item["kind"], item["dtype"]
    shape, stride, device = item["shape"], item["stride"], item["device"]
    requires_grad, is_parameter = item["requires_grad"], item["is_parameter"]
    blob, offset_bytes = item["blob"], item["offset_bytes"]
    if not isinstance(key_path, str):
        raise bad("key_path must be a string")
    if kind not in ("torch", "numpy"):
        raise bad(f"kind must be 'torch' or 'numpy', got {kind!r}")
    try:
        itemsize = dtype_itemsize(kind, dtype)
    except ValueError as e:
        raise bad(str(e)) from None
    for name, dims in (("shape", shape), ("stride", stride)):
        if not (isinstance(dims, list) and len(dims) <= _MAX_DIMS and all(map(_is_int, dims))):
            raise bad(f"{name} must be a list of at most {_MAX_DIMS} non-negative integers")
    if math.prod(shape) >= _MAX_EXTENT:
        raise bad(f"shape {shape} has too many elements")
    if len(stride) != len(shape):
        raise bad(f"stride {stride} and shape {shape} have different lengths")
    if not _is_int(blob) or not _is_int(offset_bytes):
        raise bad("blob and offset_bytes must be non-negative integers")
    if not (isinstance(device, str) and _DEVICE_RE.fullmatch(device)):
        raise bad(f"malformed device {device!r}")
    if type(requires_grad) is not bool or type(is_parameter) is not bool:
        raise bad("requires_grad and is_parameter must be booleans")
    if kind == "numpy":
        if requires_grad or is_parameter or device != "cpu":
            raise bad("a numpy record must be on cpu without requires_grad or is_parameter")
        if stride != _canonical(tuple(shape))[1]:
            raise bad(f"numpy stride {stride} is not C-contiguous for shape {shape}")
    else:
        if offset_bytes % itemsize:
            raise bad(f"offset_bytes {offset_bytes} is not a multiple of the itemsize {itemsize}")
        d = TORCH_DTYPES[dtype]
        if requires_grad and not (d.is_floating_point or d.is_complex):
            raise bad(f"requires_grad is set on a {dtype} tensor")
    return TensorRecord(key_path, kind, dtype, shape, stride, blob, offset_bytes, device, requires_grad, is_parameter)


# ----------------------------------------------------------------------------- materialize


def materialize(records: list[TensorRecord], blob_buffers: list[torch.Tensor]) -> list[object]:
    """Build each record's tensor or array as a zero-copy view into its blob buffer.

    `blob_buffers[b]` is a 1-D uint8 CPU tensor holding blob b. Records of one blob share its
    storage, so tied weights stay tied. Devices are left to the caller.

    Example:
        >>> flat = flatten({"w": torch.arange(3.0)})
        >>> materialize(flat.tensors, [torch.tensor(b.data.copy()) for b in flat.blobs])
        [tensor([0., 1., 2.])]
    """
    bufs = list(blob_buffers)
    for b, buf in enumerate(bufs):
        if not (
            isinstance(buf, torch.Tensor)
            and buf.dtype == torch.uint8
            and buf.dim() == 1
            and buf.is_cpu
            and buf.is_contiguous()
        ):
            raise ValueError(f"blob buffer {b} must be a 1-D contiguous uint8 CPU tensor")
    # view(dtype) needs the byte offset in the storage to be a multiple of the itemsize;
    # realign a whole blob at once so that its records still share one storage.
    need: dict[int, int] = {}
    for r in records:
        if r.kind == "torch":
            need[r.blob] = max(need.get(r.blob, 1), dtype_itemsize("torch", r.dtype))
    for b, align in need.items():
        if 0 <= b < len(bufs) and bufs[b].storage_offset() % align:
            bufs[b] = bufs[b].clone()

    out: list[object] = []
    for i, r in enumerate(records):
        if not 0 <= r.blob < len(bufs):
            raise ValueError(f"tensor record {i} ({r.key_path}): blob {r.blob} does not exist")
        buf = bufs[r.blob]
        itemsize = dtype_itemsize(r.kind, r.dtype)
        end = r.offset_bytes + _span_elems(r.shape, r.stride) * itemsize
        if end > buf.numel():
            raise ValueError(
                f"tensor record {i} ({r.key_path}): bytes [{r.offset_bytes}, {end}) run past "
                f"the end of blob {r.blob} ({buf.numel()} bytes)"
            )
        raw = buf[r.offset_bytes : end]
        if r.kind == "numpy":
            out.append(raw.numpy().view(_numpy_dtype(r.dtype)).reshape(r.shape))
            continue
        t = raw.view(TORCH_DTYPES[r.dtype]).as_strided(r.shape, r.stride)
        if r.is_parameter:
            t = _Parameter(t, requires_grad=r.requires_grad)
        elif r.requires_grad:
            t.requires_grad_(True)
        out.append(t)
    return out


# ----------------------------------------------------------------------------- unflatten


_MISSING = object()


def _show(v: object) -> str:
    """A short repr of an untrusted value for an error message."""
    try:
        return reprlib.repr(v)
    except ValueError:  # an int past sys.get_int_max_str_digits()
        return f"<{type(v).__name__}>"


class _SpecError(ValueError):
    """A malformed spec node; `where` collects the JSON path while unwinding."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why
        self.where: list[str] = []


def unflatten(spec: dict[str, Any], tensors: list[object]) -> object:
    """Rebuild the state described by `spec`, taking tensor leaf i from `tensors[i]`.

    The spec is treated as untrusted: any malformed node raises ValueError naming its JSON
    path; nothing is imported and no code from the spec runs.

    Example:
        >>> flat = flatten({"a": [1, (2.0, None)]})
        >>> unflatten(flat.spec, [])
        {'a': [1, (2.0, None)]}
    """
    if not isinstance(spec, dict) or set(spec) != {"spec_version", "root"}:
        raise ValueError("spec must be an object with exactly 'spec_version' and 'root'")
    if spec["spec_version"] != SPEC_VERSION or type(spec["spec_version"]) is not int:
        raise ValueError(
            f"spec_version {_show(spec['spec_version'])} is not supported (this reader knows "
            f"{SPEC_VERSION}); upgrade fastpersist"
        )
    builder = _Builder(tensors)
    try:
        return builder.node(spec["root"], 0)
    except _SpecError as e:
        where = "".join(reversed(e.where))
        raise ValueError(f'invalid spec at ["root"]{where}: {e.why}') from None


def _fields(node: dict[str, Any], *names: str) -> list[Any]:
    if len(node) != len(names) + 1 or not all(n in node for n in names):
        raise _SpecError(f"a {node['t']!r} node must have exactly the fields t, {', '.join(names)}")
    return [node[n] for n in names]


def _dec_int(v: object) -> int:
    if isinstance(v, str):
        if _DEC_INT_RE.fullmatch(v):
            try:
                return int(v)
            except ValueError:
                raise _SpecError("integer has too many decimal digits") from None
        if _HEX_INT_RE.fullmatch(v):
            return int(v, 16)
    raise _SpecError(f"malformed integer {_show(v)}")


def _dec_float(v: object) -> float:
    if isinstance(v, str) and len(v) <= 64:
        try:
            return float.fromhex(v)
        except (ValueError, OverflowError):
            pass
    raise _SpecError(f"malformed float {_show(v)}")


def _dec_b64(v: object) -> bytes:
    if isinstance(v, str):
        try:
            return base64.b64decode(v, validate=True)
        except ValueError:  # binascii.Error, or non-ASCII text
            pass
    raise _SpecError("malformed base64 bytes")


def _dec_dtype(v: object) -> torch.dtype:
    d = _ANY_TORCH_DTYPE.get(v) if isinstance(v, str) else None
    if d is None:
        raise _SpecError(f"unknown torch dtype {_show(v)}")
    return d


def _child(e: _SpecError, where: str) -> _SpecError:
    e.where.append(where)
    return e


class _Builder:
    """Recursive spec reader with a depth cap; `tensors` supplies the tensor leaves."""

    __slots__ = ("_ntuples", "_tensors")

    def __init__(self, tensors: list[object]) -> None:
        self._tensors = tensors
        self._ntuples: dict[tuple[str, str, tuple[str, ...]], type] = {}

    def node(self, node: object, depth: int) -> object:
        if node is None or type(node) is str or type(node) is bool:
            return node
        if type(node) is not dict:
            raise _SpecError(f"a node must be an object, string, boolean or null, not {type(node).__name__}")
        tag = node.get("t")
        if tag == "tensor":
            (i,) = _fields(node, "i")
            if type(i) is not int or not 0 <= i < len(self._tensors):
                raise _SpecError(f"tensor index {_show(i)} out of range (have {len(self._tensors)})")
            return self._tensors[i]
        if tag in ("dict", "odict"):
            meta = _MISSING
            if tag == "odict" and "meta" in node:
                keys, values, meta = _fields(node, "k", "v", "meta")
            else:
                keys, values = _fields(node, "k", "v")
            if type(keys) is not list or type(values) is not list or len(keys) != len(values):
                raise _SpecError("'k' and 'v' must be lists of equal length")
            self._deeper(depth)
            out: dict[Any, Any] = {} if tag == "dict" else collections.OrderedDict()
            for j, (k, v) in enumerate(zip(keys, values, strict=True)):
                try:
                    key = self.key(k, depth + 1)
                except _SpecError as e:
                    raise _child(e, f'["k"][{j}]') from None
                try:
                    out[key] = self.node(v, depth + 1)
                except _SpecError as e:
                    raise _child(e, f'["v"][{j}]') from None
            if len(out) != len(keys):
                raise _SpecError("duplicate dict keys")
            if meta is not _MISSING:
                try:
                    out._metadata = self.node(meta, depth + 1)  # type: ignore[attr-defined]
                    if not isinstance(out._metadata, dict):  # type: ignore[attr-defined]
                        raise _SpecError("an OrderedDict's 'meta' must be a dict")
                except _SpecError as e:
                    raise _child(e, '["meta"]') from None
            return out
        if tag in ("list", "tuple"):
            (values,) = _fields(node, "v")
            items = self._list(values, depth)
            return items if tag == "list" else tuple(items)
        if tag == "ntuple":
            module, name, fields, values = _fields(node, "module", "name", "fields", "v")
            return self._ntuple(module, name, fields, self._list(values, depth))
        return self.leaf(node, tag)

    def _deeper(self, depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise _SpecError(f"nested deeper than {MAX_DEPTH} containers")

    def _list(self, values: object, depth: int) -> list[Any]:
        if type(values) is not list:
            raise _SpecError("'v' must be a list")
        self._deeper(depth)
        out = []
        for j, v in enumerate(values):
            try:
                out.append(self.node(v, depth + 1))
            except _SpecError as e:
                raise _child(e, f'["v"][{j}]') from None
        return out

    def key(self, node: object, depth: int) -> object:
        if node is None or type(node) is str or type(node) is bool:
            return node
        tag = node.get("t") if type(node) is dict else None
        if tag in ("int", "float", "bytes", "dtype"):
            return self.leaf(node, tag)  # type: ignore[arg-type]
        if tag == "tuple":
            (values,) = _fields(node, "v")  # type: ignore[arg-type]
            if type(values) is not list:
                raise _SpecError("'v' must be a list")
            self._deeper(depth)
            return tuple(self.key(v, depth + 1) for v in values)
        raise _SpecError("a dict key must be a string, boolean, null, or an int, float, bytes, dtype or tuple node")

    def leaf(self, node: dict[str, Any], tag: object) -> object:
        if tag == "int":
            return _dec_int(*_fields(node, "v"))
        if tag == "float":
            return _dec_float(*_fields(node, "v"))
        if tag == "complex":
            re_, im = _fields(node, "re", "im")
            return complex(_dec_float(re_), _dec_float(im))
        if tag == "bytes":
            return _dec_b64(*_fields(node, "v"))
        if tag == "dtype":
            return _dec_dtype(*_fields(node, "v"))
        if tag == "size":
            (v,) = _fields(node, "v")
            if (
                type(v) is not list
                or len(v) > _MAX_DIMS
                or not all(type(n) is int and -_MAX_EXTENT <= n < _MAX_EXTENT for n in v)
            ):
                raise _SpecError("a size must be a list of at most 64 integers")
            return torch.Size(v)
        if tag == "device":
            (v,) = _fields(node, "v")
            if isinstance(v, str) and _DEVICE_RE.fullmatch(v):
                try:
                    return torch.device(v)
                except (RuntimeError, ValueError):
                    pass
            raise _SpecError(f"malformed device {_show(v)}")
        if tag == "np_str":
            (v,) = _fields(node, "v")
            if type(v) is not str:
                raise _SpecError("np_str needs a string")
            return np.str_(v)
        if tag == "np_bytes":
            return np.bytes_(_dec_b64(*_fields(node, "v")))
        if tag == "np":
            dtype, v = _fields(node, "dtype", "v")
            try:
                dt = _numpy_dtype(dtype)
            except ValueError as e:
                raise _SpecError(str(e)) from None
            raw = _dec_b64(v)
            if len(raw) != dt.itemsize:
                raise _SpecError(f"numpy scalar of dtype {dtype} needs {dt.itemsize} bytes, got {len(raw)}")
            return np.frombuffer(raw, dtype=dt)[0]
        raise _SpecError(f"unknown node tag {_show(tag)}")

    def _ntuple(self, module: object, name: object, fields: object, values: list[Any]) -> object:
        if not (isinstance(module, str) and isinstance(name, str) and len(name) <= 256):
            raise _SpecError("namedtuple 'module' and 'name' must be strings")
        if not (
            type(fields) is list
            and len(fields) == len(values) <= _MAX_FIELDS
            and all(
                type(f) is str and f.isidentifier() and not f.startswith("_") and not keyword.iskeyword(f)
                for f in fields
            )
            and len(set(fields)) == len(fields)
        ):
            raise _SpecError(f"namedtuple 'fields' must be at most {_MAX_FIELDS} distinct identifiers, one per value")
        key = (module, name, tuple(fields))
        cls = self._ntuples.get(key)
        if cls is None:
            cls = self._ntuples[key] = _find_namedtuple(module, name, key[2])
        try:
            return cls._make(values)  # type: ignore[attr-defined]
        except (TypeError, ValueError) as e:
            raise _SpecError(f"namedtuple {name} rejected its values: {e}") from None


def _find_namedtuple(module: str, qualname: str, fields: tuple[str, ...]) -> type:
    """The already-imported class `module.qualname` if it has these fields, else a new one."""
    obj: object = sys.modules.get(module)
    for part in qualname.split("."):
        # vars() rather than getattr(): a module-level __getattr__ could import or run code.
        try:
            obj = vars(obj).get(part)
        except (TypeError, AttributeError):
            obj = None
            break
    if (
        isinstance(obj, type)
        and issubclass(obj, tuple)
        and getattr(obj, "_fields", None) == fields
        and callable(getattr(obj, "_make", None))
    ):
        return obj
    short = qualname.rsplit(".", 1)[-1]
    if not short.isidentifier() or keyword.iskeyword(short):
        short = "NamedTuple"
    try:
        return collections.namedtuple(short, fields)
    except (ValueError, TypeError) as e:
        raise _SpecError(f"cannot build namedtuple {short}: {e}") from None
