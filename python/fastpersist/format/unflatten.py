"""The read side: rebuild a state from its spec and the tensor bytes read back from a file.

The spec comes from a possibly hostile file. Nothing here pickles, imports by name or
evaluates text: the spec is data, validated node by node, and every value it can produce is
built from a fixed list of types. `materialize` turns validated records (`records_from_json`)
and blob buffers into tensors; `unflatten` puts them back in the tree.

Example:
    >>> import torch
    >>> from fastpersist.format.flatten import flatten
    >>> flat = flatten({"w": torch.ones(2), "step": 3})
    >>> bufs = [torch.tensor(b.data.copy()) for b in flat.blobs]   # as if read from disk
    >>> unflatten(flat.spec, materialize(flat.tensors, bufs))
    {'w': tensor([1., 1.]), 'step': 3}
"""

from __future__ import annotations

import base64
import collections
import keyword
import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from .kinds import build_sparse, set_attrs
from .limits import MAX_DEPTH, MAX_DIMS, MAX_EXTENT, namedtuple_problem
from .quote import shown
from .records import (
    DEVICE_RE,
    SPEC_VERSION,
    SPEC_VERSION_BYTES,
    SPEC_VERSION_KINDS,
    SPEC_VERSION_PLAIN,
    TORCH_DTYPES,
    TensorRecord,
    dtype_itemsize,
    numpy_dtype,
    span_elems,
)

# Every torch.dtype, for dtype-valued leaves; vars() so no lazy torch submodule is imported.
_ANY_TORCH_DTYPE: dict[str, torch.dtype] = {n: d for n, d in vars(torch).items() if isinstance(d, torch.dtype)}
_DEC_INT_RE = re.compile(r"-?(?:0|[1-9][0-9]*)")
_HEX_INT_RE = re.compile(r"-?0x[0-9a-f]+")

_Parameter = torch.nn.Parameter


# ----------------------------------------------------------------------------- materialize


def materialize(records: list[TensorRecord], blob_buffers: list[torch.Tensor]) -> list[object]:
    """Build each record's tensor or array as a zero-copy view into its blob buffer.

    `blob_buffers[b]` is a 1-D uint8 tensor holding blob b: on the CPU, or (a blob of torch
    tensors only) on the device its tensors are loaded to. Records of one blob share its
    storage, so tied weights stay tied. Moving CPU tensors to devices is left to the caller.

    Example:
        >>> from fastpersist.format.flatten import flatten
        >>> flat = flatten({"w": torch.arange(3.0)})
        >>> materialize(flat.tensors, [torch.tensor(b.data.copy()) for b in flat.blobs])
        [tensor([0., 1., 2.])]
    """
    bufs = list(blob_buffers)
    for b, buf in enumerate(bufs):
        if not (isinstance(buf, torch.Tensor) and buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()):
            raise ValueError(f"blob buffer {b} must be a 1-D contiguous uint8 tensor")
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
            raise ValueError(f"tensor record {i} ({shown(r.key_path)}): blob {r.blob} does not exist")
        buf = bufs[r.blob]
        itemsize = dtype_itemsize(r.kind, r.dtype)
        if r.device == "meta" and r.kind == "torch":  # no bytes: shape, strides and dtype only
            out.append(_meta_tensor(r, itemsize))
            continue
        end = r.offset_bytes + span_elems(r.shape, r.stride) * itemsize
        if end > buf.numel():
            raise ValueError(
                f"tensor record {i} ({shown(r.key_path)}): bytes [{r.offset_bytes}, {end}) run past "
                f"the end of blob {r.blob} ({buf.numel()} bytes)"
            )
        raw = buf[r.offset_bytes : end]
        if r.kind == "numpy":
            if not buf.is_cpu:
                raise ValueError(f"tensor record {i} ({shown(r.key_path)}): a numpy array's blob must be on the CPU")
            out.append(raw.numpy().view(numpy_dtype(r.dtype)).reshape(r.shape))
            continue
        t = raw.view(TORCH_DTYPES[r.dtype]).as_strided(r.shape, r.stride)
        if r.is_parameter:
            t = _Parameter(t, requires_grad=r.requires_grad)
        elif r.requires_grad:
            t.requires_grad_(True)
        out.append(t)
    return out


def _meta_tensor(r: TensorRecord, itemsize: int) -> torch.Tensor:
    start = r.offset_bytes // itemsize
    t = torch.empty(start + span_elems(r.shape, r.stride), dtype=TORCH_DTYPES[r.dtype], device="meta")
    t = t.as_strided(r.shape, r.stride, start)
    return _Parameter(t, requires_grad=r.requires_grad) if r.is_parameter else t.requires_grad_(r.requires_grad)


# ----------------------------------------------------------------------------- unflatten


_MISSING = object()


class _SpecError(ValueError):
    """A malformed spec node; `where` collects the JSON path while unwinding."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why
        self.where: list[str] = []


_NtKey = tuple[str, str, tuple[str, ...]]


def allowed_namedtuples(types: Iterable[type]) -> dict[_NtKey, type]:
    """Index an allow-list of namedtuple classes by (module, qualified name, fields).

    Raises:
        TypeError: an entry is not a namedtuple class.
    """
    allowed: dict[_NtKey, type] = {}
    for cls in types:
        fields = getattr(cls, "_fields", None)
        if not (
            isinstance(cls, type)
            and issubclass(cls, tuple)
            and isinstance(fields, tuple)
            and all(type(f) is str for f in fields)
        ):
            raise TypeError(f"namedtuple_types must hold namedtuple classes, not {shown(cls)}")
        allowed[(cls.__module__, cls.__qualname__, fields)] = cls
    return allowed


def unflatten(spec: dict[str, Any], tensors: list[object], *, namedtuple_types: Iterable[type] = ()) -> object:
    """Rebuild the state described by `spec`, taking tensor leaf i from `tensors[i]`.

    The spec is treated as untrusted: any malformed node raises ValueError naming its JSON
    path; nothing is imported, no class is looked up by a name from the spec, and no code from
    the spec runs. A saved namedtuple comes back as the class in `namedtuple_types` (an
    allow-list; its ``_make`` runs) with the same module, qualified name and fields, else as a
    fresh ``collections.namedtuple`` with the saved name and fields.

    Example:
        >>> from fastpersist.format.flatten import flatten
        >>> flat = flatten({"a": [1, (2.0, None)]})
        >>> unflatten(flat.spec, [])
        {'a': [1, (2.0, None)]}
    """
    if not isinstance(spec, dict) or set(spec) != {"spec_version", "root"}:
        raise ValueError("spec must be an object with exactly 'spec_version' and 'root'")
    version = spec["spec_version"]
    if type(version) is not int or not SPEC_VERSION_PLAIN <= version <= SPEC_VERSION:
        raise ValueError(
            f"spec_version {shown(version)} is not supported (this reader knows {SPEC_VERSION_PLAIN} to "
            f"{SPEC_VERSION}); upgrade fastpersist"
        )
    builder = _Builder(tensors, allowed_namedtuples(namedtuple_types), version)
    try:
        return builder.node(spec["root"], 0)
    except _SpecError as e:
        where = '["root"]' + "".join(reversed(e.where))
        raise ValueError(f"invalid spec at {shown(where, 300)}: {e.why}") from None


def _fields(node: dict[str, Any], *names: str) -> list[Any]:
    if len(node) != len(names) + 1 or not all(n in node for n in names):
        raise _SpecError(f"a {shown(node['t'])} node must have exactly the fields t, {', '.join(names)}")
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
    raise _SpecError(f"malformed integer {shown(v)}")


def _dec_float(v: object) -> float:
    if isinstance(v, str) and len(v) <= 64:
        try:
            return float.fromhex(v)
        except (ValueError, OverflowError):
            pass
    raise _SpecError(f"malformed float {shown(v)}")


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
        raise _SpecError(f"unknown torch dtype {shown(v)}")
    return d


def _child(e: _SpecError, where: str) -> _SpecError:
    e.where.append(where)
    return e


#: The nodes of spec version 3 (format/kinds.py).
_KINDS_TAGS = ("set", "frozenset", "bytearray", "tensor_attrs", "sparse")
#: The value leaves that may also be dict keys (flatten's _KEY_ENCODERS writes them).
_KEY_TAGS = ("int", "float", "complex", "bytes", "dtype", "size", "device")


class _Builder:
    """Recursive spec reader with a depth cap; `tensors` supplies the tensor leaves."""

    __slots__ = ("_bytes", "_bytes_in_stream", "_kinds", "_ntuples", "_sparse", "_tensors")

    def __init__(self, tensors: list[object], allowed: dict[_NtKey, type], version: int) -> None:
        self._tensors = tensors
        self._ntuples: dict[_NtKey, type] = dict(allowed)
        #: Spec version 2: ``bytes_blob`` nodes name a uint8 record holding a bytes value.
        self._bytes_in_stream = version >= SPEC_VERSION_BYTES
        #: Spec version 3: the nodes of format/kinds.py.
        self._kinds = version >= SPEC_VERSION_KINDS
        self._bytes: dict[int, bytes] = {}  # one bytes object per record, as saved
        self._sparse: dict[int, torch.Tensor] = {}  # by its first part's record: one object, as saved

    def node(self, node: object, depth: int) -> object:
        if node is None or type(node) is str or type(node) is bool:
            return node
        if type(node) is not dict:
            raise _SpecError(f"a node must be an object, string, boolean or null, not {type(node).__name__}")
        tag = node.get("t")
        if tag == "tensor":
            (i,) = _fields(node, "i")
            if type(i) is not int or not 0 <= i < len(self._tensors):
                raise _SpecError(f"tensor index {shown(i)} out of range (have {len(self._tensors)})")
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
        if self._kinds and tag in _KINDS_TAGS:
            return self._kind(node, tag, depth)
        return self.leaf(node, tag)

    def _kind(self, node: dict[str, Any], tag: str, depth: int) -> object:
        """A node of spec version 3 (format/kinds.py), built from validated parts only."""
        if tag in ("set", "frozenset"):
            (values,) = _fields(node, "v")
            if type(values) is not list:
                raise _SpecError("'v' must be a list")
            self._deeper(depth)
            items = [self.key(v, depth + 1) for v in values]
            return set(items) if tag == "set" else frozenset(items)
        if tag == "bytearray":
            (inner,) = _fields(node, "v")
            value = self.node(inner, depth + 1)
            if type(value) is not bytes:
                raise _SpecError("a bytearray node must hold a bytes node")
            return bytearray(value)
        if tag == "tensor_attrs":
            i, attrs = _fields(node, "i", "a")
            t = self.node({"t": "tensor", "i": i}, depth)
            values = self.node(attrs, depth + 1)
            if not isinstance(t, torch.Tensor) or type(values) is not dict:
                raise _SpecError("tensor_attrs needs a torch tensor record and a dict of attributes")
            try:
                set_attrs(t, values)
            except ValueError as e:
                raise _SpecError(str(e)) from None
            return t
        layout, size, coalesced, grad, param, values = _fields(
            node, "layout", "size", "coalesced", "requires_grad", "parameter", "v"
        )
        parts = self._list(values, depth)
        first = values[0].get("i") if values and type(values[0]) is dict else None
        found = self._sparse.get(first) if type(first) is int else None
        if found is None:
            if type(grad) is not bool or type(param) is not bool:
                raise _SpecError("a sparse node's 'requires_grad' and 'parameter' must be booleans")
            try:
                found = build_sparse(layout, size, coalesced, parts)
            except ValueError as e:
                raise _SpecError(str(e)) from None
            found = _Parameter(found, requires_grad=grad) if param else found.requires_grad_(grad)
            if type(first) is int:
                self._sparse[first] = found
        return found

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
        if tag in _KEY_TAGS:
            return self.leaf(node, tag)  # type: ignore[arg-type]
        if tag == "tuple":
            (values,) = _fields(node, "v")  # type: ignore[arg-type]
            if type(values) is not list:
                raise _SpecError("'v' must be a list")
            self._deeper(depth)
            return tuple(self.key(v, depth + 1) for v in values)
        kinds = ", ".join(_KEY_TAGS)
        raise _SpecError(f"a dict key must be a string, boolean, null, or a node of type {kinds} or tuple")

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
                or len(v) > MAX_DIMS
                or not all(type(n) is int and -MAX_EXTENT <= n < MAX_EXTENT for n in v)
            ):
                raise _SpecError("a size must be a list of at most 64 integers")
            return torch.Size(v)
        if tag == "device":
            (v,) = _fields(node, "v")
            if isinstance(v, str) and DEVICE_RE.fullmatch(v):
                try:
                    return torch.device(v)
                except (RuntimeError, ValueError):
                    pass
            raise _SpecError(f"malformed device {shown(v)}")
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
                dt = numpy_dtype(dtype)
            except ValueError as e:
                raise _SpecError(str(e)) from None
            raw = _dec_b64(v)
            if len(raw) != dt.itemsize:
                raise _SpecError(f"numpy scalar of dtype {shown(dtype)} needs {dt.itemsize} bytes, got {len(raw)}")
            return np.frombuffer(raw, dtype=dt)[0]
        if tag == "bytes_blob" and self._bytes_in_stream:
            return self._bytes_blob(*_fields(node, "i"))
        raise _SpecError(f"unknown node tag {shown(tag)}")

    def _bytes_blob(self, i: object) -> bytes:
        value = self._tensors[i] if type(i) is int and 0 <= i < len(self._tensors) else None
        if not (isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 1):
            raise _SpecError(f"bytes_blob {shown(i)} does not name a 1-D uint8 record ({len(self._tensors)} records)")
        assert type(i) is int
        found = self._bytes.get(i)
        if found is None:
            found = self._bytes[i] = value.tobytes()
        return found

    def _ntuple(self, module: object, name: object, fields: object, values: list[Any]) -> object:
        if not isinstance(module, str):
            raise _SpecError("namedtuple 'module' and 'name' must be strings")
        problem = namedtuple_problem(name, fields)
        if problem is not None:
            raise _SpecError(problem)
        assert isinstance(name, str) and isinstance(fields, list)
        if len(fields) != len(values):
            raise _SpecError(f"namedtuple 'fields' must be identifiers, one per value ({len(fields)} != {len(values)})")
        key = (module, name, tuple(fields))
        cls = self._ntuples.get(key)
        if cls is None:
            cls = self._ntuples[key] = _fresh_namedtuple(name, key[2])
        try:
            return cls._make(values)  # type: ignore[attr-defined]
        except (TypeError, ValueError) as e:
            raise _SpecError(f"namedtuple {shown(name)} rejected its values: {shown(str(e), 200)}") from None


def _fresh_namedtuple(qualname: str, fields: tuple[str, ...]) -> type:
    """A new namedtuple class with the saved name and fields; nothing user-defined is touched."""
    short = qualname.rsplit(".", 1)[-1]
    if not short.isidentifier() or keyword.iskeyword(short):
        short = "NamedTuple"
    try:
        return collections.namedtuple(short, fields)
    except (ValueError, TypeError) as e:
        raise _SpecError(f"cannot build namedtuple {shown(short)}: {shown(str(e), 200)}") from None
