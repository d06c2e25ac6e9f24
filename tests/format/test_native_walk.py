"""The native walk (fastpersist._core.flatten_walk) gives exactly what the Python walk gives.

`flatten(state)` walks the common nodes natively and hands the rest to the Python `_Walker`;
`flatten(state, native=False)` is the Python walk alone, the reference. Random states mix what
the native walk builds itself with everything it must delegate (views, shared storages, numpy
arrays, bytes, sets, namedtuples, tensors with attributes ...); both walks must give the same
spec, records, blobs and leaves, and the same exception for what cannot be saved.
"""

from __future__ import annotations

import collections
import json
import math
import sys
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastpersist import _core
from fastpersist.errors import UnsupportedValueError
from fastpersist.format import flatten as flatten_module
from fastpersist.format.flatten import MAX_DEPTH, TORCH_DTYPES, FlatState, flatten
from fastpersist.format.limits import MAX_DIMS
from fastpersist.format.records import CANONICAL_CACHE
from fastpersist.gpu.copiers import DEVICE_COPIERS, use_copier

from budget import examples

Point = collections.namedtuple("Point", ["x", "y"])

# ----------------------------------------------------------------------------- comparing


def assert_same_flat(a: FlatState, b: FlatState) -> None:
    """Same spec (and JSON text), records, leaves and blobs; `a` native, `b` Python."""
    assert a.spec == b.spec
    assert json.dumps(a.spec) == json.dumps(b.spec)
    assert a.tensors == b.tensors
    for ra, rb in zip(a.tensors, b.tensors, strict=True):
        assert [type(getattr(ra, f)) for f in ra.__slots__] == [type(getattr(rb, f)) for f in rb.__slots__]
    assert len(a.leaves) == len(b.leaves)
    for x, y in zip(a.leaves, b.leaves, strict=True):  # the state's objects; a sparse tensor's parts are new
        assert x is y or (x.layout == y.layout == torch.strided and torch.equal(x, y) and x.stride() == y.stride())
    assert len(a.blobs) == len(b.blobs)
    leaves = {id(x) for x, y in zip(a.leaves, b.leaves, strict=True) if x is y}
    for ba, bb in zip(a.blobs, b.blobs, strict=True):
        assert type(ba) is type(bb)
        assert (ba.nbytes, ba.version, ba.device_copier) == (bb.nbytes, bb.version, bb.device_copier)
        assert (ba._data is None) == (bb._data is None)
        if id(bb.source) in leaves:  # else made by the walk (a shared range, a resolved copy)
            assert ba.source is bb.source
        else:
            assert type(ba.source) is type(bb.source)
        assert [(m.record, id(m.tensor), m.version) for m in ba.members] == [
            (m.record, id(m.tensor), m.version) for m in bb.members
        ]
        if ba.device_copier is None:
            assert ba.data.tobytes() == bb.data.tobytes()


def outcome(state: object, native: bool, **kw: Any) -> FlatState | tuple[type, str]:
    try:
        return flatten(state, native=native, **kw)
    except Exception as e:  # the same exception, or the same result
        return type(e), str(e)


def assert_same_walk(state: object, **kw: Any) -> None:
    a, b = outcome(state, True, **kw), outcome(state, False, **kw)
    if isinstance(b, FlatState):
        assert isinstance(a, FlatState), a
        assert_same_flat(a, b)
    else:
        assert a == b


# ----------------------------------------------------------------------------- strategies


def _pool() -> list[torch.Tensor]:
    """Tensors that random states reach several times, whole and through views."""
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        inference = torch.arange(6.0)  # no version counter
    attrs = torch.ones(2)
    attrs.tag = "kept"  # type: ignore[attr-defined]
    return [
        torch.randn(6, 4, generator=gen),
        torch.nn.Parameter(torch.randn(3, 2, generator=gen)),
        torch.nn.Parameter(torch.randn(4, generator=gen), requires_grad=False),
        torch.randn(5, generator=gen).requires_grad_(),
        torch.arange(12, dtype=torch.int64).reshape(3, 4),
        torch.ones(2, 3, dtype=torch.bfloat16),
        torch.randn(4, 2, dtype=torch.complex64, generator=gen),
        inference,
        attrs,
    ]


POOL = _pool()
VIEWS = ("self", "detach", "view", "offset", "slice", "transpose", "flat1", "odd_stride", "neg", "conj", "copy")


def view(base: torch.Tensor, how: str) -> torch.Tensor:
    """A tensor over `base`'s storage (or a copy), as `how` says; `base` where it does not apply."""
    t = base.detach()
    flat = t.reshape(-1)
    if how == "self":
        return base
    if how == "detach":
        return t
    if how == "view":
        return t.view(t.shape)
    if how == "offset" and flat.numel() > 1:
        return flat[1:]
    if how == "slice" and t.dim() >= 1:
        return t[::2]
    if how == "transpose" and t.dim() == 2:
        return t.t()
    if how == "flat1":
        return flat.reshape(1, -1)
    if how == "odd_stride":  # contiguous, but not the canonical stride on its size-1 dimension
        return flat.as_strided((1, flat.numel()), (7, 1))
    if how == "neg" and not t.is_complex() and t.dtype != torch.bool:
        return torch._neg_view(t)
    if how == "conj" and t.is_complex():
        return t.conj()
    if how == "copy":
        return t.clone()
    return base


@st.composite
def pooled(draw: st.DrawFn) -> torch.Tensor:
    return view(draw(st.sampled_from(POOL)), draw(st.sampled_from(VIEWS)))


@st.composite
def fresh(draw: st.DrawFn) -> torch.Tensor:
    """A new tensor of any dtype and a small shape (empty and 0-d included)."""
    dtype = TORCH_DTYPES[draw(st.sampled_from(sorted(TORCH_DTYPES)))]
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    numel = math.prod(shape)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw &= 1
    t = raw.view(dtype).reshape(shape) if numel else torch.empty(shape, dtype=dtype)
    kind = draw(st.sampled_from(["plain", "param", "grad"]))
    if kind != "plain" and (dtype.is_floating_point or dtype.is_complex) and dtype != torch.complex32:
        try:
            return torch.nn.Parameter(t) if kind == "param" else t.clone().requires_grad_()
        except RuntimeError:  # a dtype autograd refuses
            return t
    return t


surrogate = "\udc80"
key_texts = st.one_of(
    st.text(max_size=6),
    st.sampled_from(["a", "w", "x1", "_", "1x", "", "a b", "layers.0", "é", "ünï", "π2", surrogate, "k" + surrogate]),
)
atom_keys = st.one_of(
    key_texts,
    st.integers(-(2**70), 2**70),
    st.integers(min_value=10**30, max_value=10**40),
    st.floats(),
    st.booleans(),
    st.none(),
    st.binary(max_size=3),
    st.sampled_from([torch.float32, torch.device("cpu")]),
)
dict_keys = st.one_of(atom_keys, st.tuples(atom_keys, atom_keys))
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(min_value=2**63, max_value=2**200),
    st.floats(),
    st.sampled_from([float("nan"), -float("nan"), -0.0, float("inf")]),
    key_texts,
    st.binary(max_size=8),
    st.just(bytes(5000)),
    st.complex_numbers(),
    st.sampled_from([torch.bfloat16, torch.device("meta"), torch.Size([2, 3])]),
    st.sampled_from([{1, 2}, frozenset({"a"}), bytearray(b"ab"), np.float32(1.5), np.int64(-3)]),
    st.sampled_from([np.arange(6.0).reshape(2, 3), np.zeros((2, 2), dtype="<i4").T, np.array(["ab"])]),
    st.sampled_from([torch.empty(2, 3, device="meta"), torch.eye(2).to_sparse()]),
    pooled(),
    fresh(),
)


def odict(items: dict[Any, Any], meta: object, moved: bool) -> collections.OrderedDict[Any, Any]:
    d = collections.OrderedDict(items)
    if moved and d:
        d.move_to_end(next(iter(d)))  # the OrderedDict's order, not its dict's
    if meta is not None:
        d._metadata = meta  # type: ignore[attr-defined]
    return d


states = st.recursive(
    leaves,
    lambda kids: st.one_of(
        st.dictionaries(dict_keys, kids, max_size=4),
        st.builds(odict, st.dictionaries(dict_keys, kids, max_size=4), st.none() | kids, st.booleans()),
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=4).map(tuple),
        st.tuples(kids, kids).map(lambda xy: Point(*xy)),
    ),
    max_leaves=16,
)


# ----------------------------------------------------------------------------- properties


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states)
def test_native_walk_matches_the_python_walk(state: object) -> None:
    assert_same_walk(state)


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(key_texts, st.one_of(pooled(), fresh())), max_size=12), st.booleans())
def test_native_walk_matches_on_many_tensors(items: list[tuple[str, torch.Tensor]], nested: bool) -> None:
    """Ties, views and repeats among many tensors: which is first of its storage decides who walks it."""
    state: object = dict(items)
    if nested:
        state = {"model": state, "opt": [t for _, t in reversed(items)]}
    assert_same_walk(state)


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(pooled(), fresh()), max_size=6))
def test_native_walk_matches_with_a_copier_installed(tensors: list[torch.Tensor]) -> None:
    with use_copier(lambda t: True, lambda device: None):  # type: ignore[arg-type,return-value]
        assert_same_walk({"t": tensors}, copiers=DEVICE_COPIERS)
    # The copier takes some tensors and not others: the others are read in place, still watched.
    with use_copier(lambda t: t.numel() % 2 == 0, lambda device: None):  # type: ignore[arg-type,return-value]
        assert_same_walk({"t": tensors, "meta": torch.empty(3, device="meta")}, copiers=DEVICE_COPIERS)


def test_tensors_a_copier_stages_are_walked_natively(monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"model": {f"w{i}": torch.randn(i + 1, 2) for i in range(20)}, "step": torch.tensor(3)}
    chosen: list[int] = []
    with use_copier(lambda t: chosen.append(id(t)) or t.dim() == 2, lambda device: None):  # type: ignore[arg-type,return-value]
        expected = flatten(state, native=False, copiers=DEVICE_COPIERS)
        calls = []
        node = flatten_module._Walker.node
        monkeypatch.setattr(flatten_module._Walker, "node", lambda self, *a: calls.append(a) or node(self, *a))
        chosen.clear()
        flat = flatten(state, copiers=DEVICE_COPIERS)
    assert calls == []
    assert_same_flat(flat, expected)
    assert len(chosen) == 21  # asked once per tensor
    assert [b.device_copier is not None for b in flat.blobs] == [True] * 20 + [False]


@pytest.mark.parametrize("root_name", ["state", "état", "r" + surrogate, "a b"])
def test_native_walk_matches_under_any_root_name(root_name: str) -> None:
    assert_same_walk({"w": torch.ones(2), "l": [torch.zeros(1)], 3: {"é": 1}}, root_name=root_name)


def test_native_records_share_the_cached_layout_lists() -> None:
    flat = flatten({"a": torch.zeros(7, 3), "b": [torch.ones(7, 3)]})
    cached = CANONICAL_CACHE[(7, 3)]
    assert all(r.shape is cached[0] and r.stride is cached[1] for r in flat.tensors)


def test_the_native_walk_is_built_and_flatten_falls_back_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert callable(_core.flatten_walk)
    state = {"w": torch.ones(2), "n": [1, 2.5]}
    expected = flatten(state, native=False)
    monkeypatch.setattr(flatten_module, "_NATIVE_WALK", None)  # a stale build of _core
    assert_same_flat(flatten(state), expected)


def test_a_large_plain_state_is_walked_natively_without_delegating(monkeypatch: pytest.MonkeyPatch) -> None:
    od = collections.OrderedDict((f"layers.{i}.w", torch.randn(3)) for i in range(50))
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    state = {"model": od, "opt": {"state": {i: {"step": torch.tensor(1.0)} for i in range(50)}}, "lr": [0.1, 3]}
    expected = flatten(state, native=False)
    calls = []
    node = flatten_module._Walker.node
    monkeypatch.setattr(flatten_module._Walker, "node", lambda self, *a: calls.append(a) or node(self, *a))
    assert_same_flat(flatten(state), expected)
    assert calls == []


# ----------------------------------------------------------------------------- errors


def _cycle_dict() -> object:
    d: dict[str, object] = {}
    d["self"] = {"again": d}
    return d


def _cycle_list() -> object:
    lst: list[object] = [1]
    lst.append(lst)
    return lst


def _cycle_through_delegated() -> object:
    d: dict[str, object] = {"w": torch.ones(1)}
    d["p"] = Point(d, 1)  # a namedtuple (the Python walk) back into a dict (the native walk)
    return d


def _cycle_through_metadata() -> object:
    d: collections.OrderedDict[str, object] = collections.OrderedDict(a=1)
    d._metadata = {"": d}  # type: ignore[attr-defined]
    return d


def _nested(depth: int, make: Any) -> object:
    state: object = 1
    for _ in range(depth):
        state = make(state)
    return state


def _key_nested(depth: int) -> object:
    key: object = 1
    for _ in range(depth):
        key = (key,)
    return {key: 1}


ERRORS = {
    "cycle_dict": _cycle_dict(),
    "cycle_list": _cycle_list(),
    "cycle_through_namedtuple": _cycle_through_delegated(),
    "cycle_through_metadata": _cycle_through_metadata(),
    "too_deep_lists": _nested(MAX_DEPTH + 1, lambda s: [s]),
    "too_deep_dicts": _nested(MAX_DEPTH + 1, lambda s: {"k": s}),
    "too_deep_odicts": _nested(MAX_DEPTH + 1, lambda s: collections.OrderedDict(k=s)),
    "too_deep_mixed": _nested(MAX_DEPTH + 1, lambda s: ({1: [s]},)),
    "deepest_allowed": _nested(MAX_DEPTH - 1, lambda s: [s]),
    "unsupported_leaf": {"a": [1, {"f": object()}]},
    "unsupported_function": {"layers.0": {"fn": print}},
    "str_subclass": {"s": type("S", (str,), {})("x")},
    "int_subclass": [type("I", (int,), {})(3)],
    "dict_subclass": {"d": type("D", (dict,), {})()},
    "bad_key_object": {"opt": {object(): 1}},
    "bad_key_tensor": {"opt": {torch.zeros(1): 1}},
    "bad_key_str_subclass": {type("S", (str,), {})("k"): 1},
    "key_too_deep": _key_nested(MAX_DEPTH + 1),
    "quantized": {"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)},
    "too_many_dims": {"t": torch.zeros([1] * (MAX_DIMS + 1))},
    "size_over_limit": {"s": torch.Size([2**62])},
    "tensor_subclass": {"t": torch.ones(2).as_subclass(type("T", (torch.Tensor,), {}))},
    "lazy_parameter": {"p": torch.nn.parameter.UninitializedParameter()},
    "bad_namedtuple_field": {"n": collections.namedtuple("N", ["_x"], rename=True)(1)},
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_errors_are_the_python_walks(name: str) -> None:
    a, b = outcome(ERRORS[name], True), outcome(ERRORS[name], False)
    if name == "deepest_allowed":
        assert isinstance(a, FlatState) and isinstance(b, FlatState)
        assert_same_flat(a, b)
        return
    assert isinstance(b, tuple) and b[0] is UnsupportedValueError, b
    assert a == b


def test_recursion_error_inside_a_delegated_node_is_reported_as_too_deep() -> None:
    limit = sys.getrecursionlimit()
    state = {"p": _nested(MAX_DEPTH - 5, lambda s: Point(s, 0))}
    sys.setrecursionlimit(300)
    try:
        a, b = outcome(state, True), outcome(state, False)
    finally:
        sys.setrecursionlimit(limit)
    assert a == b == (UnsupportedValueError, "at key path 'state': the state is nested too deeply to save")
