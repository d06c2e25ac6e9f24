"""Why a value cannot be saved: the messages flatten raises, naming the key path and the type.

Example:
    >>> import torch
    >>> str(unsupported("state.f", print, "")).startswith("at key path 'state.f': cannot save value of type")
    True
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from ..errors import UnsupportedValueError
from .limits import MAX_DIMS
from .quote import shown
from .records import numpy_dtype

__all__ = ["DTENSOR_FIX", "SUPPORTED", "is_dtensor", "key_text", "loadable", "tensor_error", "type_name", "unsupported"]

#: What the format holds, appended to every refusal.
SUPPORTED = (
    "Supported: torch tensors and Parameters (strided, sparse COO/CSR/CSC/BSR/BSC or meta, "
    "non-quantized, any plain dtype, with plain attributes), numpy arrays of "
    "numeric/bool/datetime/string dtypes, dict, OrderedDict, list, tuple, namedtuple, set, frozenset, "
    "None, bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.Size, torch.device "
    "and numpy scalars"
)


def type_name(cls: type) -> str:
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def unsupported(path: str, x: object, why: str = "") -> UnsupportedValueError:
    why = f" ({why})" if why else ""
    return UnsupportedValueError(
        f"at key path {shown(path)}: cannot save value of type {type_name(type(x))}{why}. {SUPPORTED}."
    )


def key_text(k: object) -> str:
    """A non-str dict key as it appears inside a key path (whole: a key path is data, and
    messages bound it with :func:`~fastpersist.format.quote.shown`)."""
    try:
        return repr(k)
    except ValueError:  # an int past sys.get_int_max_str_digits()
        return hex(k) if isinstance(k, int) else f"<{type(k).__name__}>"


DTENSOR_FIX = (
    "a DTensor is one rank's part of a distributed tensor, and .as_subclass() would keep it one: "
    "save .full_tensor() (the whole tensor, gathered on every rank) or .to_local() (this rank's "
    "shard, e.g. with sharded=True), or save the state with torch.distributed.checkpoint through "
    "fastpersist.integrations.dcp"
)


def is_dtensor(x: object) -> bool:
    # Only a process that imported torch.distributed.tensor can hold a DTensor: no import here.
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return isinstance(dtensor, type) and isinstance(x, dtensor)


def loadable(dt: np.dtype[Any]) -> bool:
    """Whether a reader accepts this numpy dtype (records.numpy_dtype: the one rule for both sides)."""
    try:
        numpy_dtype(dt.str)
    except ValueError:
        return False
    return True


def tensor_error(t: torch.Tensor, path: str) -> UnsupportedValueError:
    if t.layout is not torch.strided:
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
    return unsupported(path, t, why)
