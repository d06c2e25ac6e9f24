"""Tensors come back through every convert route as they were saved: strides, storage offset,
memory format, complex32 views, and the value kinds of spec version 3 (sparse tensors, sets,
bytearrays, Parameter attributes, meta tensors); hypothesis over random views of random storages."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import fastpersist as fp
from fastpersist.interop.convert import convert, read_any

from budget import examples

#: (source format, then each format converted to in turn); the state is read back from the last.
ROUTES = [
    ("fastpersist", "safetensors", "fastpersist"),
    ("fastpersist", "torch", "fastpersist"),
    ("torch", "fastpersist"),
    ("torch", "safetensors", "torch"),
]
ROUTE_IDS = ["->".join(r) for r in ROUTES]


def _write(state: dict[str, Any], kind: str, path: str) -> str:
    if kind == "fastpersist":
        fp.save(state, path)
    else:
        torch.save(state, path)
    return path


def through(state: dict[str, Any], route: tuple[str, ...], workdir: str) -> Any:
    """`state` written as route[0], converted through the rest of `route`, read back."""
    path = _write(state, route[0], os.path.join(workdir, f"0.{route[0]}"))
    for i, to in enumerate(route[1:], 1):
        out = os.path.join(workdir, f"{i}.{to}")
        convert(path, to, out)  # type: ignore[arg-type]
        path = out
    return read_any(path)


def _values(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t).float() if t.dtype == torch.complex32 else t


def assert_as_saved(a: object, b: object, path: str = "state") -> None:
    """Same structure and types; tensors with the same layout, dtype, shape, device, strides,
    storage offset, values and Parameter attributes."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            assert_as_saved(a[k], b[k], f"{path}.{k}")
        return
    if not isinstance(a, torch.Tensor):
        assert a == b, path
        return
    assert isinstance(b, torch.Tensor)
    assert (a.layout, a.dtype, a.shape, a.device) == (b.layout, b.dtype, b.shape, b.device), path
    assert a.__dict__ == b.__dict__, f"{path}: attributes {a.__dict__} != {b.__dict__}"
    if a.device.type == "meta":
        assert a.stride() == b.stride(), path
    elif a.layout == torch.strided:
        assert (a.stride(), a.storage_offset()) == (b.stride(), b.storage_offset()), path
        assert torch.equal(_values(a), _values(b)), path
    else:
        assert torch.equal(a.to_dense(), b.to_dense()), path


def geometry_state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.ones(3))
    p.note = "kept"  # type: ignore[attr-defined]
    c32 = torch.randn(4, 5, dtype=torch.complex64, generator=gen).to(torch.complex32)
    return {
        "transposed": torch.arange(24, dtype=torch.float32).view(4, 6).t(),
        "offset": torch.arange(30.0).as_strided((3, 4), (5, 1), 2),
        "channels_last": torch.randn(2, 3, 4, 5, generator=gen).to(memory_format=torch.channels_last),
        "expanded": torch.arange(3.0).expand(4, 3),
        "complex32_view": c32[1:, ::2],
        "coo": torch.sparse_coo_tensor([[0, 1], [1, 0]], [3.0, 4.0], (2, 2)),
        "csr": torch.tensor([[0.0, 1.0], [2.0, 0.0]]).to_sparse_csr(),
        "set": {1, 2},
        "frozenset": frozenset({"a"}),
        "bytearray": bytearray(b"xyz"),
        "parameter": p,
        "meta": torch.empty(3, 4, device="meta"),
    }


KEYS = ["transposed", "offset", "channels_last", "expanded", "complex32_view", "coo", "csr", "set", "frozenset"]
KEYS += ["bytearray", "parameter", "meta"]


def test_the_key_list_covers_the_state() -> None:
    assert KEYS == list(geometry_state())


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("key", KEYS)
def test_each_value_comes_back_as_saved_through_every_route(tmp_path: Any, route: tuple[str, ...], key: str) -> None:
    state = {key: geometry_state()[key]}
    assert_as_saved(state, through(state, route, str(tmp_path)))


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.complex64, torch.bool]


@st.composite
def views(draw: st.DrawFn) -> torch.Tensor:
    """A random strided view (shape, strides, offset, possibly overlapping) of a random storage."""
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim)))
    stride = tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
    offset = draw(st.integers(0, 5))
    need = offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1
    base = torch.arange(need + draw(st.integers(0, 3))).to(dtype)
    return base.as_strided(shape, stride, offset)


@pytest.mark.filterwarnings("ignore::UserWarning")
@hsettings(max_examples=examples(25), deadline=None)
@given(view=views(), route=st.sampled_from(ROUTES))
def test_random_views_come_back_with_their_strides_and_offset(
    tmp_path_factory: Any, view: torch.Tensor, route: tuple[str, ...]
) -> None:
    state = {"v": view}
    assert_as_saved(state, through(state, route, str(tmp_path_factory.mktemp("views"))))
