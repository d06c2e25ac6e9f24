"""How value leaves and dict keys are written into the tree spec (the inverse is in unflatten.py).

Ints as decimal strings (hex past Python's digit limit), floats as ``float.hex()`` so inf, nan
and -0.0 survive, bytes as base64, torch.dtype / torch.Size / torch.device by name or value.
See docs/format.md.

Example:
    >>> VALUE_ENCODERS[float](0.5)
    {'t': 'float', 'v': '0x1.0000000000000p-1'}
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from typing import Any

import torch

from .limits import MAX_DIMS, MAX_EXTENT

__all__ = ["KEY_ENCODERS", "VALUE_ENCODERS", "OverLimit"]


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


class OverLimit(ValueError):
    """A value a reader would refuse (see fastpersist.format.limits); `node` adds the key path."""


def _enc_size(x: torch.Size) -> dict[str, Any]:
    if len(x) > MAX_DIMS or not all(-MAX_EXTENT <= n < MAX_EXTENT for n in x):
        raise OverLimit(f"a torch.Size of at most {MAX_DIMS} dimensions below 2**62 loads back; this one has {len(x)}")
    return {"t": "size", "v": list(x)}


def _enc_device(x: torch.device) -> dict[str, Any]:
    return {"t": "device", "v": str(x)}


VALUE_ENCODERS: dict[type, Callable[[Any], dict[str, Any]]] = {
    int: _enc_int,
    float: _enc_float,
    complex: _enc_complex,
    bytes: _enc_bytes,
    torch.dtype: _enc_dtype,
    torch.Size: _enc_size,
    torch.device: _enc_device,
}
#: Every hashable value leaf may be a dict key too (and tuples of them, in flatten.py).
KEY_ENCODERS = VALUE_ENCODERS
