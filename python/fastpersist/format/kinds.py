"""Value kinds built from other nodes: sparse tensors, tensor attributes, sets, bytearrays.

Spec version 3 added them (docs/format.md). A sparse tensor is its component tensors (each an
ordinary tensor record) plus its layout and size; a tensor's plain attributes are a dict node
next to its record; a set or frozenset holds key-like elements (what a dict key may be); a
bytearray wraps a bytes node. The read side rebuilds each from validated parts only: sparse
tensors through torch's constructors with their invariants checked, attributes written into
the tensor's ``__dict__`` (no setter or descriptor runs), nothing imported or called by name.

Example:
    >>> import torch
    >>> layout, parts = sparse_parts(torch.eye(2).to_sparse())
    >>> layout, [name for name, _ in parts]
    ('coo', ['indices', 'values'])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import UnsupportedValueError
from .quote import shown
from .records import ITEMSIZE, TensorRecord
from .refusals import type_name, unsupported

__all__ = [
    "SPARSE_LAYOUTS",
    "attr_name_problem",
    "build_sparse",
    "checked_attrs",
    "meta_record",
    "set_attrs",
    "set_node",
    "sparse_node",
    "sparse_parts",
]

#: Layout name in the spec -> (torch layout, names of its component tensors, in order).
SPARSE_LAYOUTS: dict[str, tuple[torch.layout, tuple[str, ...]]] = {
    "coo": (torch.sparse_coo, ("indices", "values")),
    "csr": (torch.sparse_csr, ("crow_indices", "col_indices", "values")),
    "csc": (torch.sparse_csc, ("ccol_indices", "row_indices", "values")),
    "bsr": (torch.sparse_bsr, ("crow_indices", "col_indices", "values")),
    "bsc": (torch.sparse_bsc, ("ccol_indices", "row_indices", "values")),
}
_LAYOUT_NAME = {layout: name for name, (layout, _) in SPARSE_LAYOUTS.items()}


def sparse_parts(x: torch.Tensor) -> tuple[str, list[tuple[str, torch.Tensor]]]:
    """The layout name and the named component tensors of sparse tensor `x` (detached).

    Raises:
        ValueError: a layout the format does not hold (the caller names the key path).
    """
    name = _LAYOUT_NAME.get(x.layout)
    if name is None:
        raise ValueError(f"layout {x.layout}; convert it with .to_dense()")
    if name == "coo":  # the raw parts: an uncoalesced tensor has no .indices()
        parts = [x._indices(), x._values()]
    else:
        parts = [getattr(x, part)() for part in SPARSE_LAYOUTS[name][1]]
    return name, [(n, p.detach()) for n, p in zip(SPARSE_LAYOUTS[name][1], parts, strict=True)]


def sparse_node(x: torch.Tensor, path: str, part_node: Callable[[torch.Tensor, str], Any]) -> dict[str, Any]:
    """The spec node of sparse tensor `x` at `path`; `part_node(tensor, name)` records a component.

    Raises:
        UnsupportedValueError: a layout the format does not hold, naming `path`.
    """
    try:
        layout, parts = sparse_parts(x)
    except ValueError as e:
        raise unsupported(path, x, str(e)) from None
    return {
        "t": "sparse",
        "layout": layout,
        "size": list(x.shape),
        "coalesced": layout == "coo" and x.is_coalesced(),
        "requires_grad": x.requires_grad,
        "parameter": type(x) is torch.nn.Parameter,
        "v": [part_node(part, name) for name, part in parts],
    }


def set_node(x: set[Any] | frozenset[Any], path: str, key_node: Callable[[object], Any]) -> dict[str, Any]:
    """The spec node of a set or frozenset; `key_node` encodes an element as a dict key.

    Raises:
        UnsupportedValueError: an element a dict key may not be, naming `path` and its type.
    """
    values = []
    for e in x:
        try:
            values.append(key_node(e))
        except UnsupportedValueError:
            why = f"it holds a {type_name(type(e))}; set elements may be what a dict key may be"
            raise unsupported(path, x, why) from None
    return {"t": type(x).__name__, "v": values}


def checked_attrs(x: torch.Tensor, path: str) -> dict[str, Any]:
    """A copy of tensor `x`'s plain attributes, their names checked (:func:`attr_name_problem`)."""
    attrs = dict(x.__dict__)
    for name in attrs:
        problem = attr_name_problem(type(x), name)
        if problem is not None:
            raise unsupported(path, x, f"{problem}; it cannot be loaded back")
    return attrs


def meta_record(x: torch.Tensor, path: str, dtype: str, blob: int) -> TensorRecord:
    """The record of a meta tensor: shape, strides and dtype, no bytes (it loads back on meta)."""
    offset = int(x.storage_offset()) * ITEMSIZE[dtype]
    return TensorRecord(
        path,
        "torch",
        dtype,
        list(x.shape),
        list(x.stride()),
        blob,
        offset,
        "meta",
        x.requires_grad,
        type(x) is torch.nn.Parameter,
    )


def build_sparse(layout: object, size: object, coalesced: object, parts: list[object]) -> torch.Tensor:
    """The sparse tensor of `layout` and `size` from its validated component tensors.

    Every argument comes from a possibly hostile file: torch checks the invariants (index
    ranges, compressed index order) before the tensor is returned.

    Raises:
        ValueError: naming what is malformed.
    """
    found = SPARSE_LAYOUTS.get(layout) if isinstance(layout, str) else None
    if found is None:
        raise ValueError(f"unknown sparse layout {shown(layout)} (expected one of {', '.join(SPARSE_LAYOUTS)})")
    torch_layout, names = found
    if not (type(size) is list and all(type(n) is int and n >= 0 for n in size)):
        raise ValueError(f"a sparse size must be a list of non-negative integers, not {shown(size)}")
    if type(coalesced) is not bool:
        raise ValueError("a sparse tensor's 'coalesced' must be a boolean")
    if len(parts) != len(names) or not all(type(p) is torch.Tensor for p in parts):
        raise ValueError(f"a {layout} tensor needs {len(names)} tensors ({', '.join(names)})")
    tensors: list[torch.Tensor] = parts  # type: ignore[assignment]
    try:
        if layout == "coo":
            out = torch.sparse_coo_tensor(
                tensors[0], tensors[1], size, is_coalesced=coalesced or None, check_invariants=True
            )
        else:
            out = torch.sparse_compressed_tensor(
                tensors[0], tensors[1], tensors[2], size, layout=torch_layout, check_invariants=True
            )
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        raise ValueError(f"malformed {layout} tensor: {shown(str(e), 200)}") from None
    return out


def attr_name_problem(cls: type, name: object) -> str | None:
    """Why `name` cannot be a saved attribute of a tensor of class `cls`, or None.

    An attribute name must be an identifier the class does not define itself (a name such as
    ``data`` or ``grad`` would run a setter, or shadow a method, on load).
    """
    if not (isinstance(name, str) and name.isidentifier()):
        return f"attribute name {shown(name)} is not an identifier"
    if name.startswith("__") or hasattr(cls, name):
        return f"attribute name {shown(name)} is one {cls.__name__} defines itself"
    return None


def set_attrs(t: torch.Tensor, attrs: dict[Any, Any]) -> None:
    """Writes validated attributes into `t.__dict__` (no descriptor or setter runs).

    Raises:
        ValueError: a name :func:`attr_name_problem` refuses.
    """
    for name in attrs:
        problem = attr_name_problem(type(t), name)
        if problem is not None:
            raise ValueError(problem)
    t.__dict__.update(attrs)
