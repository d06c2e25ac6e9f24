"""The native walk behind `flatten`: ``fastpersist._core.flatten_walk`` and what it reads.

The walk is an accelerator of ``flatten._Walker``, not a second implementation of the format
(rust/fastpersist-py/src/walk.rs): handed the walker, it appends to the walker's own lists and
dicts, builds the nodes, records and blobs of the common nodes itself (exact dicts,
OrderedDicts, lists and tuples; str, bool, None, int and float leaves; str and int keys; a
non-empty C-contiguous tensor at storage offset 0 that is the first of its storage, on the CPU or
on a device when the walker has copiers, whose choice it asks for, as the Python walk does), and
calls ``walker.node(x, path, depth)`` (the Python walk) for every other node. The Python walk
stays the reference: ``flatten(state, native=False)`` runs it alone, and the tests compare the
two on random states.

Example:
    >>> import torch
    >>> from fastpersist.format.flatten import flatten
    >>> a, b = flatten({"w": torch.ones(2)}), flatten({"w": torch.ones(2)}, native=False)
    >>> a.spec == b.spec and a.tensors == b.tensors
    True
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch

import fastpersist._core as _core

from .blobs import Blob
from .limits import MAX_DEPTH, MAX_DIMS
from .records import CANONICAL_CACHE, ITEMSIZE, TORCH_DTYPE_NAME, TensorRecord, canonical_layout
from .refusals import key_text

__all__ = ["ENV", "NATIVE_WALK"]

#: ``_core.flatten_walk(walker, state, path, ENV)``, or None where the compiled ``_core``
#: predates it (a stale build): `flatten` then walks in Python.
NATIVE_WALK: Callable[[object, object, str, dict[str, Any]], Any] | None = getattr(_core, "flatten_walk", None)

#: What the native walk reads: the very objects the Python walk uses (the same record and blob
#: classes, the same cached shape and stride lists, the same limits).
ENV: dict[str, Any] = {
    "Tensor": torch.Tensor,
    "Parameter": torch.nn.Parameter,
    "OrderedDict": collections.OrderedDict,
    "strided": torch.strided,
    "TORCH_DTYPE_NAME": TORCH_DTYPE_NAME,
    "ITEMSIZE": ITEMSIZE,
    "CANONICAL_CACHE": CANONICAL_CACHE,
    "canonical_layout": canonical_layout,
    "TensorRecord": TensorRecord,
    "Blob": Blob,
    "key_text": key_text,
    "MAX_DEPTH": MAX_DEPTH,
    "MAX_DIMS": MAX_DIMS,
}
