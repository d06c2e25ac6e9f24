"""The tensor record format both sides share: dtype tables, records and their JSON form.

A `TensorRecord` says where one tensor leaf's bytes live inside a blob and how to rebuild it.
`flatten` makes them on save; `records_from_json` validates them from a possibly hostile file
on load. Also the spec version both sides agree on (`SPEC_VERSION`); the limits live in `limits`.

Example:
    >>> rec = TensorRecord("state.w", "torch", "bfloat16", [2, 3], [3, 1], 0, 0, "cpu", False)
    >>> records_from_json(records_to_json([rec])) == [rec], dtype_itemsize(rec.kind, rec.dtype)
    (True, 2)
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .limits import MAX_DIMS, MAX_EXTENT
from .quote import shown

#: The newest tree spec. 2 added ``bytes_blob`` nodes (bytes values kept in the data stream); 3
#: added sparse tensors, tensor attributes, sets, frozensets, bytearrays and meta tensors
#: (format/kinds.py). A tree is written with the oldest version that holds it (1 without any of
#: those), so older readers keep reading what they can.
SPEC_VERSION = 3
SPEC_VERSION_KINDS = 3
SPEC_VERSION_BYTES = 2
SPEC_VERSION_PLAIN = 1
#: A bytes value longer than this goes into the data stream as a uint8 record (checksummed like
#: a tensor, 1 byte per byte) instead of base64 in the manifest (4 characters per 3 bytes).
BYTES_INLINE_MAX_BYTES = 4096
#: The numpy dtype of such a record.
BYTES_RECORD_DTYPE = "|u1"

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
TORCH_DTYPE_NAME: dict[torch.dtype, str] = {d: n for n, d in TORCH_DTYPES.items()}
ITEMSIZE: dict[str, int] = {n: d.itemsize for n, d in TORCH_DTYPES.items()}
NUMPY_KINDS = frozenset("biufcmMSU")
_NUMPY_DTYPE_RE = re.compile(r"[<>|=][biufcmMSU][0-9]{1,6}(?:\[[0-9]{0,9}[a-zA-Z]{1,3}\])?")
DEVICE_RE = re.compile(r"[a-z_][a-z0-9_]{0,31}(?::[0-9]{1,6})?")


@dataclass(slots=True)
class TensorRecord:
    """Where one tensor leaf's bytes live inside a blob, and how to rebuild it.

    `stride` is in elements; `offset_bytes` locates element [0, ..., 0] inside the blob.
    `dtype` is the torch name without "torch." ("bfloat16") or numpy's `dtype.str` ("<f4").
    flatten's native walk sets the slots of the records it makes itself, in field order: a
    field with a default or any `__post_init__` would have to be added there too.

    Example:
        >>> from fastpersist.format.flatten import flatten
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


# ----------------------------------------------------------------------------- geometry


CANONICAL_CACHE: dict[tuple[int, ...], tuple[list[int], list[int]]] = {}


def canonical_layout(shape: Sequence[int]) -> tuple[list[int], list[int]]:
    """`shape` and its C-contiguous strides in elements, cached by shape; do not mutate."""
    stride = [1] * len(shape)
    acc = 1
    for d in range(len(shape) - 1, -1, -1):
        stride[d] = acc
        acc *= max(shape[d], 1)
    cached = (list(shape), stride)
    if len(CANONICAL_CACHE) < 4096:
        CANONICAL_CACHE[tuple(shape)] = cached
    return cached


def span_elems(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements from the first to one past the last addressed element (0 when empty)."""
    span = 1
    for n, s in zip(shape, stride, strict=True):
        if n == 0:
            return 0
        span += (n - 1) * s
    return span


# ----------------------------------------------------------------------------- dtypes and JSON


_NUMPY_DTYPE_CACHE: dict[str, np.dtype[Any]] = {}


def numpy_dtype(s: str) -> np.dtype[Any]:
    """Validate a numpy dtype string read from a file."""
    dt = _NUMPY_DTYPE_CACHE.get(s) if type(s) is str else None
    if dt is not None:
        return dt
    if not (type(s) is str and _NUMPY_DTYPE_RE.fullmatch(s)):
        raise ValueError(f"unknown numpy dtype {shown(s)}")
    try:
        dt = np.dtype(s)
    except (TypeError, ValueError):
        raise ValueError(f"unknown numpy dtype {shown(s)}") from None
    if dt.kind not in NUMPY_KINDS or dt.hasobject or dt.itemsize == 0 or dt.str != s:
        raise ValueError(f"unsupported numpy dtype {shown(s)}")
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
            raise ValueError(f"unknown torch dtype {shown(dtype)}")
        return d.itemsize
    if kind == "numpy":
        return numpy_dtype(dtype).itemsize
    raise ValueError(f"unknown tensor kind {shown(kind)}; expected 'torch' or 'numpy'")


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
        >>> from fastpersist.format.flatten import flatten
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


_RECORD_FIELD_SET = frozenset(_RECORD_FIELDS)


def _is_int(x: object) -> bool:
    return type(x) is int and 0 <= x < MAX_EXTENT


_KNOWN_DEVICES: set[str] = set()


def _known_device(device: str) -> bool:
    """Whether torch parses `device` (a device type it knows, e.g. not 'float128'); cached."""
    if device not in _KNOWN_DEVICES:
        try:
            torch.device(device)
        except (RuntimeError, ValueError):
            return False
        if len(_KNOWN_DEVICES) < 1024:
            _KNOWN_DEVICES.add(device)
    return True


def records_from_json(items: object) -> list[TensorRecord]:
    """Validate JSON record dicts (from an untrusted file) and build TensorRecords.

    Raises ValueError naming the record and field on any malformed entry.

    Example:
        >>> from fastpersist.format.flatten import flatten
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
    if item.keys() != _RECORD_FIELD_SET:
        missing = sorted(set(_RECORD_FIELDS) - set(item))
        extra = sorted(str(k) for k in set(item) - set(_RECORD_FIELDS))
        raise bad(f"wrong fields (missing {missing}, unexpected {shown(extra)})")
    key_path, kind, dtype = item["key_path"], item["kind"], item["dtype"]
    shape, stride, device = item["shape"], item["stride"], item["device"]
    requires_grad, is_parameter = item["requires_grad"], item["is_parameter"]
    blob, offset_bytes = item["blob"], item["offset_bytes"]
    if not isinstance(key_path, str):
        raise bad("key_path must be a string")
    if kind not in ("torch", "numpy"):
        raise bad(f"kind must be 'torch' or 'numpy', got {shown(kind)}")
    try:
        itemsize = dtype_itemsize(kind, dtype)
    except ValueError as e:
        raise bad(str(e)) from None
    for name, dims in (("shape", shape), ("stride", stride)):
        if not (isinstance(dims, list) and len(dims) <= MAX_DIMS and all(map(_is_int, dims))):
            raise bad(f"{name} must be a list of at most {MAX_DIMS} non-negative integers")
    if math.prod(shape) >= MAX_EXTENT:
        raise bad(f"shape {shown(shape)} has too many elements")
    if len(stride) != len(shape):
        raise bad(f"stride {shown(stride)} and shape {shown(shape)} have different lengths")
    if not _is_int(blob) or not _is_int(offset_bytes):
        raise bad("blob and offset_bytes must be non-negative integers")
    if not (isinstance(device, str) and DEVICE_RE.fullmatch(device) and _known_device(device)):
        raise bad(f"malformed device {shown(device)}")
    if type(requires_grad) is not bool or type(is_parameter) is not bool:
        raise bad("requires_grad and is_parameter must be booleans")
    if kind == "numpy":
        if requires_grad or is_parameter or device != "cpu":
            raise bad("a numpy record must be on cpu without requires_grad or is_parameter")
        if stride != canonical_layout(tuple(shape))[1]:
            raise bad(f"numpy stride {shown(stride)} is not C-contiguous for shape {shown(shape)}")
    else:
        if offset_bytes % itemsize:
            raise bad(f"offset_bytes {offset_bytes} is not a multiple of the itemsize {itemsize}")
        d = TORCH_DTYPES[dtype]
        if requires_grad and not (d.is_floating_point or d.is_complex):
            raise bad(f"requires_grad is set on a {dtype} tensor")
    return TensorRecord(key_path, kind, dtype, shape, stride, blob, offset_bytes, device, requires_grad, is_parameter)
