"""flatten/unflatten: round trips of every dtype and container, aliasing, hostile input."""

from __future__ import annotations

import collections
import contextlib
import json
import math
import time
import typing

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastpersist.errors import UnsupportedValueError
from fastpersist.format.flatten import (
    MAX_DEPTH,
    TORCH_DTYPES,
    Blob,
    FlatState,
    TensorRecord,
    dtype_itemsize,
    flatten,
    materialize,
    records_from_json,
    records_to_json,
    unflatten,
)
from fastpersist.gpu.copiers import DEVICE_COPIERS, CudaCopier, DeviceCopier, device_bytes, use_copier

from budget import examples

Point = collections.namedtuple("Point", ["x", "y"])


class Typed(typing.NamedTuple):
    lr: float
    name: str = "adam"


# ----------------------------------------------------------------------------- helpers


def disk_buffers(flat: FlatState, *, align: int = 64, skew: int = 0) -> list[torch.Tensor]:
    """Copy every blob into one fresh buffer, as a reader would, and slice it per blob.

    `skew` shifts every blob off alignment to exercise materialize's realignment.
    """
    offsets, total = [], 0
    for blob in flat.blobs:
        total = -(-total // align) * align + skew
        offsets.append(total)
        total += blob.nbytes
    disk = torch.zeros(total, dtype=torch.uint8)
    out = []
    for blob, off in zip(flat.blobs, offsets, strict=True):
        disk[off : off + blob.nbytes] = torch.from_numpy(written_bytes(blob).copy())
        out.append(disk[off : off + blob.nbytes])
    return out


def written_bytes(blob: Blob) -> np.ndarray:
    """The bytes a save writes for `blob`: its host bytes, or for a device-resident blob what its
    copier copies to the host (the save's staging reads `device_bytes(source)`, saving/job.py)."""
    if blob.device_copier is None:
        data = blob.data
        assert data.dtype == np.uint8 and data.ndim == 1 and data.flags.c_contiguous
        assert data.nbytes == blob.nbytes
        return data
    on_device = device_bytes(blob.source_tensor)
    assert on_device.numel() == blob.nbytes
    return on_device.cpu().numpy()


def roundtrip(state: object, **kw: int) -> tuple[object, FlatState]:
    """flatten -> JSON text -> records_from_json -> bytes 'on disk' -> materialize -> unflatten."""
    flat = flatten(state)
    spec = json.loads(json.dumps(flat.spec, allow_nan=False))
    records = records_from_json(json.loads(json.dumps(records_to_json(flat.tensors))))
    assert records == flat.tensors
    back = unflatten(spec, materialize(records, disk_buffers(flat, **kw)), namedtuple_types=[Point, Typed])
    return back, flat


def tensor_bytes(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8).numpy().tobytes()


def same_float(a: float, b: float) -> bool:
    if math.isnan(a):
        return math.isnan(b) and math.copysign(1, a) == math.copysign(1, b)
    return a == b and math.copysign(1, a) == math.copysign(1, b)


def assert_same(a: object, b: object, path: str = "root") -> None:
    """Structure, container types, key types, leaf types and bits all equal."""
    if isinstance(a, tuple) and hasattr(type(a), "_fields") and type(a) is not torch.Size:
        assert type(b).__name__ == type(a).__name__ and type(b)._fields == type(a)._fields, path
    else:
        assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert len(a) == len(b), path
        for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True):
            assert_same(ka, kb, f"{path}.key")
            assert_same(va, vb, f"{path}[{ka!r}]")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), path
    elif isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad), path
        assert tensor_bytes(a) == tensor_bytes(b), path
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype.str == b.dtype.str and a.shape == b.shape, path
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), path
    elif isinstance(a, float):
        assert same_float(a, b), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, complex):
        assert same_float(a.real, b.real) and same_float(a.imag, b.imag), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


# ----------------------------------------------------------------------------- strategies


def random_tensor(dtype: torch.dtype, shape: list[int], seed: int) -> torch.Tensor:
    """Arbitrary bit patterns of `dtype` (bools kept 0/1, which torch assumes)."""
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    rng = np.random.default_rng(seed)
    raw = torch.from_numpy(rng.integers(0, 256, numel * dtype.itemsize, dtype=np.uint8))
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


@st.composite
def torch_tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = TORCH_DTYPES[draw(st.sampled_from(sorted(TORCH_DTYPES)))]
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    t = random_tensor(dtype, shape, draw(st.integers(0, 2**32 - 1)))
    how = draw(st.sampled_from(["plain", "transpose", "slice", "expand", "offset", "conj"]))
    if how == "transpose" and t.dim() >= 2:
        t = t.transpose(0, 1)
    elif how == "slice" and t.dim() >= 1:
        t = t[::2]
    elif how == "expand":
        t = t.unsqueeze(0).expand(2, *t.shape)
    elif how == "offset" and t.dim() >= 1:
        t = t[1:]
    elif how == "conj" and dtype in (torch.complex64, torch.complex128):
        t = t.conj()
    if (dtype.is_floating_point or dtype.is_complex) and dtype not in (
        torch.complex32,
        getattr(torch, "bcomplex32", None),
    ):
        if draw(st.booleans()):
            t = torch.nn.Parameter(t.detach().clone(), requires_grad=draw(st.booleans()))
        elif draw(st.booleans()):
            t = t.detach().clone().requires_grad_(True)
    return t


NUMPY_DTYPES = ["<f4", "<f8", "<f2", "<i8", "|i1", "<u2", "|b1", "<c8", ">f4", "<M8[ns]", "<U3", "|S2"]


@st.composite
def numpy_arrays(draw: st.DrawFn) -> np.ndarray:
    dt = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    raw = rng.integers(0, 256, math.prod(shape) * dt.itemsize, dtype=np.uint8)
    if dt.kind == "b":
        raw &= 1
    if dt.kind == "U":
        raw = (raw.view("<u4") % 0x10000).astype("<u4").view(np.uint8) if raw.size else raw
    a = raw.view(dt).reshape(shape)
    if draw(st.booleans()) and a.ndim >= 2:
        a = a.T
    return a


numpy_scalars = st.one_of(
    st.floats(width=32).map(np.float32),
    st.floats().map(np.float64),
    st.integers(-(2**63), 2**63 - 1).map(np.int64),
    st.integers(0, 255).map(np.uint8),
    st.booleans().map(np.bool_),
    st.complex_numbers(width=64).map(np.complex64),
    st.just(np.datetime64("2024-03-01T12:00")),
    st.text(max_size=3).map(np.str_),
    st.binary(max_size=3).map(np.bytes_),
)
atom_keys = st.one_of(
    st.text(max_size=8),
    st.integers(),
    st.integers(min_value=10**30, max_value=10**40),
    st.floats(),
    st.booleans(),
    st.none(),
    st.binary(max_size=4),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
    st.lists(st.integers(0, 5), max_size=3).map(torch.Size),
    st.sampled_from([torch.device("cpu"), torch.device("cuda", 1)]),
    st.complex_numbers(),
)
dict_keys = st.one_of(atom_keys, st.tuples(atom_keys, atom_keys))
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**64),
    st.floats(),
    st.text(),
    st.binary(max_size=8),
    # Past BYTES_INLINE_MAX_BYTES (4096): a uint8 record in the data stream.
    st.integers(4095, 9000).map(lambda n: bytes(range(n % 251, n % 251 + 5)) * (n // 5)),
    st.complex_numbers(),
    st.sampled_from([torch.float8_e4m3fn, torch.bool, torch.complex64, torch.qint8]),
    st.lists(st.integers(0, 5), max_size=3).map(torch.Size),
    st.sampled_from([torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")]),
    numpy_scalars,
    torch_tensors(),
    numpy_arrays(),
)
states = st.recursive(
    leaves,
    lambda kids: st.one_of(
        st.dictionaries(dict_keys, kids, max_size=4),
        st.dictionaries(dict_keys, kids, max_size=4).map(collections.OrderedDict),
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=4).map(tuple),
        st.tuples(kids, kids).map(lambda xy: Point(*xy)),
        st.tuples(st.floats(), kids).map(lambda ab: Typed(ab[0], ab[1])),  # type: ignore[arg-type]
    ),
    max_leaves=12,
)


# ----------------------------------------------------------------------------- round trips


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states)
def test_roundtrip_random_states(state: object) -> None:
    back, _ = roundtrip(state)
    assert_same(state, back)


@settings(max_examples=examples(40), deadline=None)
@given(st.lists(torch_tensors(), max_size=4), st.integers(1, 15))
def test_roundtrip_unaligned_buffers(tensors: list[torch.Tensor], skew: int) -> None:
    back, _ = roundtrip(tensors, skew=skew)
    assert_same(tensors, back)


def test_every_torch_dtype_is_covered() -> None:
    for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "complex64", "uint16", "uint64", "bool"):
        assert name in TORCH_DTYPES
    state = {name: random_tensor(d, [2, 3], i) for i, (name, d) in enumerate(TORCH_DTYPES.items())}
    back, flat = roundtrip(state)
    assert_same(state, back)
    assert [r.dtype for r in flat.tensors] == list(TORCH_DTYPES)
    for r in flat.tensors:
        assert dtype_itemsize("torch", r.dtype) == TORCH_DTYPES[r.dtype].itemsize


def test_value_leaves_roundtrip_exactly() -> None:
    state = {
        "floats": [math.inf, -math.inf, math.nan, -math.nan, -0.0, 0.0, 5e-324, 1.7976931348623157e308],
        "ints": [0, -1, 2**63, -(2**200), 10**5000, True, False],
        "misc": (None, "héllo\u2028", b"\x00\xff", 1 + 2j, complex(math.nan, -0.0)),
        "torch": [torch.bfloat16, torch.Size([2, 0, 3]), torch.device("cuda:3"), torch.quint8],
        "numpy": [
            np.float32(1.5),
            np.int8(-3),
            np.bool_(True),
            np.float16(-0.0),
            np.uint64(2**64 - 1),
            np.str_("a\x00"),
            np.bytes_(b"\x00"),
            np.datetime64("NaT"),
            np.timedelta64(5, "ms"),
        ],
        "keys": {
            1: "a",
            -(10**40): "b",
            2.5: "c",
            None: "d",
            b"k": "e",
            (1, ("x", None)): "f",
            torch.float16: "h",
            math.inf: "i",
        },
        "bool_keys": {True: 1, False: 0},
        "point": Point(1, [2, 3]),
        "typed": Typed(0.1),
        "odict": collections.OrderedDict([("z", 1), ("a", 2)]),
    }
    back, _ = roundtrip(state)
    assert_same(state, back)
    assert type(back["point"]) is Point and type(back["typed"]) is Typed  # type: ignore[index]
    assert type(back["ints"][5]) is bool  # type: ignore[index]


def test_tensor_metadata_roundtrip() -> None:
    p = torch.nn.Parameter(torch.randn(3, 4))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    grad = torch.randn(5, requires_grad=True)
    scalar = torch.tensor(7, dtype=torch.int64)
    state = {"p": p, "frozen": frozen, "grad": grad, "scalar": scalar, "empty": torch.empty(0, 3)}
    back, flat = roundtrip(state)
    assert_same(state, back)
    assert type(back["p"]) is torch.nn.Parameter and back["p"].requires_grad  # type: ignore[index]
    assert type(back["frozen"]) is torch.nn.Parameter and not back["frozen"].requires_grad  # type: ignore[index]
    assert type(back["grad"]) is torch.Tensor and back["grad"].requires_grad  # type: ignore[index]
    assert back["scalar"].shape == () and back["scalar"].item() == 7  # type: ignore[index]
    assert flat.blobs[2].version == grad._version


def test_key_paths_are_readable() -> None:
    state = {
        "optimizer": {"state": {3: {"exp_avg": torch.zeros(1)}}},
        "model": {"layers.0.weight": torch.zeros(1)},
        "pairs": [(None, torch.zeros(1))],
        "tk": {(1, "a"): torch.zeros(1)},
    }
    paths = [r.key_path for r in flatten(state, root_name="ckpt").tensors]
    assert paths == [
        "ckpt.optimizer.state[3].exp_avg",
        "ckpt.model['layers.0.weight']",
        "ckpt.pairs[0][1]",
        "ckpt.tk[(1, 'a')]",
    ]


def test_cpu_tensors_are_not_copied_and_keep_their_storage_offset() -> None:
    t = torch.arange(12, dtype=torch.float32)[2:]  # storage_offset > 0, still contiguous
    b = torch.zeros(4, dtype=torch.bfloat16)
    a = np.arange(6, dtype=np.int16).reshape(2, 3)
    odd = torch.arange(10, dtype=torch.int32)[::3][1:2]  # contiguous, yet stride 3
    odd_bits = torch.zeros(6, dtype=torch.bits16)[::3][:1]
    flat = flatten([t, b, a, torch.tensor(1.0), odd, odd_bits])
    # Each blob views its storage from the base, so the storage offset comes back.
    assert flat.blobs[0].data.ctypes.data == t.data_ptr() - 8 and flat.blobs[0].nbytes == 48
    assert flat.blobs[1].data.ctypes.data == b.data_ptr()
    assert flat.blobs[2].data.ctypes.data == a.ctypes.data
    assert flat.blobs[3].nbytes == 4
    assert flat.blobs[4].data.ctypes.data == odd.data_ptr() - 12 and flat.blobs[4].nbytes == 16
    assert flat.blobs[5].data.ctypes.data == odd_bits.data_ptr() and flat.blobs[5].nbytes == 2
    assert [r.offset_bytes for r in flat.tensors] == [8, 0, 0, 0, 12, 0]
    assert flat.tensors[4].stride == [3] and flat.tensors[5].stride == [3]
    t.add_(1)  # a view: the blob sees later writes, which the version guard reports
    assert flat.blobs[0].data.view(np.float32)[2] == 3.0
    assert flat.blobs[0].version == 0 and t._version == 1


def test_non_contiguous_tensors_keep_strides_over_their_storage() -> None:
    base = torch.arange(100, dtype=torch.float64).reshape(10, 10)
    t = base[::3, 1::4]
    flat = flatten({"t": t})
    rec = flat.tensors[0]
    assert rec.stride == [30, 4] and rec.offset_bytes == 8
    assert flat.blobs[0].nbytes == (1 + 9 * 10 + 2 * 4 + 1) * 8  # base to the last element
    assert flat.blobs[0].version == t._version  # a view of the storage: watched


def test_numpy_arrays_come_back_as_views() -> None:
    a = np.arange(12, dtype=">f4").reshape(3, 4).T
    (back,), flat = roundtrip([a])  # type: ignore[misc]
    assert type(back) is np.ndarray and back.dtype.str == ">f4" and (back == a).all()
    assert flat.tensors[0].kind == "numpy" and flat.tensors[0].stride == [3, 1]


# ----------------------------------------------------------------------------- aliasing


class TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def test_tied_parameter_is_saved_once_and_stays_one_object() -> None:
    m = TiedLM()
    state = {"emb": m.emb.weight, "head": m.head.weight}
    back, flat = roundtrip(state)
    assert len(flat.tensors) == 1 and len(flat.blobs) == 1
    assert back["emb"] is back["head"]  # type: ignore[index]
    assert type(back["emb"]) is torch.nn.Parameter  # type: ignore[index]


def test_tied_state_dict_weights_share_storage() -> None:
    sd = TiedLM().state_dict()
    back, flat = roundtrip(sd)
    assert_same(sd, back)
    tied = {r.key_path: r.blob for r in flat.tensors}
    assert tied["state['emb.weight']"] == tied["state['head.weight']"]
    assert len(flat.blobs) == len(sd) - 1
    emb, head = back["emb.weight"], back["head.weight"]  # type: ignore[index]
    assert emb.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()
    emb.add_(1.0)
    assert torch.equal(emb, head)
    assert type(back) is collections.OrderedDict and back._metadata == sd._metadata  # type: ignore[attr-defined]
    m2 = TiedLM()
    m2.load_state_dict(back)
    assert torch.equal(m2.head.weight, emb)


def test_views_of_one_storage_keep_their_aliasing() -> None:
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    state = {
        "rows": base[1:3],
        "cols": base.t()[2:5],
        "bits": base.view(torch.int32)[4],
        "bytes": base.view(torch.uint8).reshape(-1)[37:45],  # odd byte offset
        "halves": base.view(torch.bfloat16)[5, 3:9],
    }
    back, flat = roundtrip(state)
    assert_same(state, back)
    assert len(flat.blobs) == 1
    assert flat.blobs[0].nbytes <= base.nbytes
    ptrs = {t.untyped_storage().data_ptr() for t in back.values()}  # type: ignore[attr-defined]
    assert len(ptrs) == 1
    for d in (state, back):
        d["rows"].mul_(-1)  # type: ignore[index]
        d["bytes"].add_(3)  # type: ignore[index]
    assert_same(state, back)


def test_far_apart_slices_of_one_storage_share_a_range_blob() -> None:
    base = torch.arange(1000, dtype=torch.int16)
    state = [base[10:20], base[900:910]]
    back, flat = roundtrip(state)
    assert_same(state, back)
    (blob,) = flat.blobs
    assert blob.nbytes == 910 * 2  # from the storage's base, so each keeps its storage offset
    assert [r.offset_bytes for r in flat.tensors] == [20, 1800]


def test_conj_view_sharing_storage_is_saved_resolved() -> None:
    z = torch.randn(4, dtype=torch.complex64)
    state = {"z": z, "zc": z.conj()}
    back, _ = roundtrip(state)
    assert_same(state, back)
    assert not back["zc"].is_conj()  # type: ignore[index]


# ----------------------------------------------------------------------------- optimizer


def test_adamw_state_dict_roundtrip_and_load() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    back, flat = roundtrip({"optimizer": sd, "model": model.state_dict(), "step": 2})
    assert_same(sd, back["optimizer"])  # type: ignore[index]
    assert all(type(k) is int for k in back["optimizer"]["state"])  # type: ignore[index]
    assert "state.optimizer.state[0].exp_avg" in [r.key_path for r in flat.tensors]
    opt2 = torch.optim.AdamW(model.parameters(), lr=1.0)
    opt2.load_state_dict(back["optimizer"])  # type: ignore[index]
    assert opt2.param_groups[0]["lr"] == 1e-3
    model(torch.randn(3, 4)).sum().backward()
    opt2.step()


# ----------------------------------------------------------------------------- unsupported


class Subclass(torch.Tensor):
    pass


class Color(int):
    pass


def unsupported_cases() -> list[tuple[str, object]]:
    cases: list[tuple[str, object]] = [
        ("lambda", lambda: 0),
        ("object", object()),
        ("set_of_objects", {object()}),
        ("object_array", np.array([1, "a"], dtype=object)),
        ("structured", np.zeros(2, dtype=[("a", "<i4")])),
        ("quantized", torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)),
        ("nested", torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])),
        ("subclass", torch.ones(2).as_subclass(Subclass)),
        ("defaultdict", collections.defaultdict(int)),
        ("int_subclass", Color(3)),
        ("matrix", np.asmatrix(np.eye(2))),
        ("module", torch.nn.Linear(1, 1)),
    ]
    return cases


@pytest.mark.parametrize(("name", "value"), unsupported_cases())
def test_unsupported_leaf_names_its_key_path(name: str, value: object) -> None:
    state = {"a": {"b": [0, 1, value]}}
    with pytest.raises(UnsupportedValueError, match=r"state\.a\.b\[2\]") as err:
        flatten(state)
    assert isinstance(err.value, TypeError)


def test_every_hashable_value_leaf_is_a_dict_key_of_its_own_type() -> None:
    """torch.Size keys stay torch.Size (not the equal tuple), devices and complex numbers too."""
    state = {
        torch.Size([2, 3]): "size",
        (2, 3, 4): "tuple",
        (torch.Size([]), torch.device("cuda", 1)): "nested",
        torch.device("cpu"): "device",
        complex(1.5, -0.0): "complex",
        torch.bfloat16: "dtype",
    }
    back, _ = roundtrip({"shapes": state})
    assert_same(back, {"shapes": state})
    assert [type(k) for k in back["shapes"]] == [torch.Size, tuple, tuple, torch.device, complex, torch.dtype]  # type: ignore[index]
    assert type(next(iter(back["shapes"]))) is torch.Size  # type: ignore[index]


def test_a_dtensor_leaf_says_to_gather_it_or_use_dcp(workdir: str) -> None:
    """A DTensor (plain, or an FSDP2-style Parameter around one) on a real one-rank gloo group."""
    from dist_workers import run
    from gloo import run_ranks

    (result,) = run_ranks(run, 1, ("dtensor_leaf", workdir, "threads"), workdir, 120)
    assert "traceback" not in result, result
    for message in result["raised"].values():
        assert message.startswith("UnsupportedValueError: at key path 'state.model.w':"), message
        assert "DTensor" in message and ".full_tensor()" in message and ".to_local()" in message
        assert "fastpersist.integrations.dcp" in message
        assert "convert it with .as_subclass(torch.Tensor)" not in message  # that gives a DTensor again
    assert result["written"] == ["init-store"]  # nothing was written


def test_tensor_as_dict_key_is_rejected() -> None:
    with pytest.raises(UnsupportedValueError, match=r"state\.opt.*dict key of type torch\.Tensor"):
        flatten({"opt": {torch.zeros(1): 1}})


def test_cycles_are_rejected() -> None:
    d: dict[str, object] = {}
    d["self"] = {"again": d}
    with pytest.raises(UnsupportedValueError, match="cyclic"):
        flatten(d)
    lst: list[object] = []
    lst.append(lst)
    with pytest.raises(UnsupportedValueError, match=r"state\[0\]"):
        flatten(lst)


def test_shared_subtree_without_cycle_is_fine() -> None:
    shared = {"x": 1}
    back, _ = roundtrip([shared, shared, (shared,)])
    assert back == [shared, shared, (shared,)]


def test_too_deep_state_is_rejected() -> None:
    state: object = 1
    for _ in range(MAX_DEPTH + 1):
        state = [state]
    with pytest.raises(UnsupportedValueError, match="deeper"):
        flatten(state)
    ok: object = 1
    for _ in range(MAX_DEPTH - 1):
        ok = [ok]
    assert roundtrip(ok)[0] == ok


# ----------------------------------------------------------------------------- hostile specs


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=6)
    | st.sampled_from(
        [
            "dict",
            "odict",
            "list",
            "tuple",
            "ntuple",
            "tensor",
            "int",
            "float",
            "complex",
            "bytes",
            "dtype",
            "size",
            "device",
            "np",
            "t",
            "v",
            "k",
            "i",
        ]
    ),
    lambda kids: (
        st.lists(kids, max_size=4)
        | st.dictionaries(
            st.sampled_from(["t", "v", "k", "i", "re", "im", "meta", "name", "module", "fields", "dtype", "x"]),
            kids,
            max_size=4,
        )
    ),
    max_leaves=20,
)


def check_spec(spec: object, tensors: list[object]) -> None:
    try:
        unflatten(spec, tensors)  # type: ignore[arg-type]
    except ValueError:
        pass


@settings(max_examples=examples(400), deadline=None)
@given(json_values, st.integers(0, 3))
def test_random_json_specs_raise_only_value_error(node: object, n: int) -> None:
    check_spec({"spec_version": 1, "root": node}, [torch.zeros(1)] * n)
    check_spec(node, [])


def mutate(node: object, path: list[int], replacement: object) -> object:
    """Replace one sub-node of a JSON tree, picking children by the indices in `path`."""
    if not path or not isinstance(node, (dict, list)) or not node:
        return replacement
    items = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
    k, v = items[path[0] % len(items)]
    child = mutate(v, path[1:], replacement)
    if isinstance(node, dict):
        return {**node, k: child}
    return [child if i == k else x for i, x in enumerate(node)]


@settings(max_examples=examples(300), deadline=None)
@given(states, st.lists(st.integers(0, 10), max_size=8), json_values)
def test_mutated_valid_specs_raise_only_value_error(state: object, path: list[int], junk: object) -> None:
    flat = flatten(state)
    spec = json.loads(json.dumps(flat.spec, allow_nan=False))
    tensors = materialize(flat.tensors, disk_buffers(flat))
    check_spec(mutate(spec, path, junk), tensors)


@pytest.mark.parametrize(
    ("root", "match"),
    [
        ({"t": "pickle", "v": "x"}, "unknown node tag"),
        ({"t": "tensor", "i": 5}, "out of range"),
        ({"t": "tensor", "i": -1}, "out of range"),
        ({"t": "tensor", "i": True}, "out of range"),
        ({"t": "tensor", "i": 0, "x": 1}, "exactly the fields"),
        ({"t": "list", "v": [1]}, "must be an object, string"),
        ({"t": "list", "v": [{"t": "float", "v": "1.2.3"}]}, r"\[\"v\"\]\[0\]': malformed float"),
        ({"t": "int", "v": "1_000"}, "malformed integer"),
        ({"t": "int", "v": "0X1F"}, "malformed integer"),
        ({"t": "int", "v": " 12"}, "malformed integer"),
        ({"t": "int", "v": "1" * 5000}, "too many decimal digits"),
        ({"t": "bytes", "v": "!!"}, "base64"),
        ({"t": "dtype", "v": "onnx"}, "unknown torch dtype"),
        ({"t": "dtype", "v": "__class__"}, "unknown torch dtype"),
        ({"t": "device", "v": "cpu; rm -rf"}, "malformed device"),
        ({"t": "np", "dtype": "|O8", "v": ""}, "numpy dtype"),
        ({"t": "np", "dtype": "<f4", "v": "AAA="}, "needs 4 bytes"),
        ({"t": "size", "v": [2**70]}, "size"),
        ({"t": "dict", "k": ["a", "a"], "v": ["x", "y"]}, "duplicate"),
        ({"t": "dict", "k": [[1]], "v": ["x"]}, r"\[\"k\"\]\[0\]': a dict key"),
        ({"t": "dict", "k": [{"t": "list", "v": []}], "v": ["x"]}, "dict key"),  # unhashable when loaded
        ({"t": "dict", "k": ["a"], "v": []}, "equal length"),
        ({"t": "ntuple", "module": "os", "name": "P", "fields": ["import os"], "v": ["x"]}, "identifiers"),
        ({"t": "ntuple", "module": "os", "name": "P", "fields": ["__class__"], "v": ["x"]}, "identifiers"),
        ({"t": "ntuple", "module": "os", "name": "P", "fields": ["a", "a"], "v": ["x", "y"]}, "identifiers"),
        ({"t": "ntuple", "module": "os", "name": "P", "fields": ["a"], "v": []}, "identifiers"),
        ({"t": "odict", "k": [], "v": [], "meta": {"t": "nope"}}, r'\["meta"\]'),
        ({"t": "odict", "k": [], "v": [], "meta": "x"}, "must be a dict"),
    ],
)
def test_malformed_spec_nodes(root: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        unflatten({"spec_version": 1, "root": root}, [torch.zeros(1)])


def test_spec_envelope_is_checked() -> None:
    with pytest.raises(ValueError, match="spec_version"):
        unflatten({"spec_version": 4, "root": None}, [])
    with pytest.raises(ValueError, match="spec_version"):
        unflatten({"spec_version": True, "root": None}, [])
    with pytest.raises(ValueError, match="exactly"):
        unflatten({"root": None}, [])
    with pytest.raises(ValueError, match="exactly"):
        unflatten([], [])  # type: ignore[arg-type]


def test_deep_hostile_spec_is_capped() -> None:
    for tag in ("list", "tuple", "dict"):
        node: object = None
        for _ in range(100_000):
            node = {"t": tag, "v": [node]} if tag != "dict" else {"t": "dict", "k": ["a"], "v": [node]}
        with pytest.raises(ValueError, match="nested deeper"):
            unflatten({"spec_version": 1, "root": node}, [])
    key: object = None
    for _ in range(100_000):
        key = {"t": "tuple", "v": [key]}
    with pytest.raises(ValueError, match="nested deeper"):
        unflatten({"spec_version": 1, "root": {"t": "dict", "k": [key], "v": ["x"]}}, [])


def test_namedtuple_never_imports_and_falls_back() -> None:
    import sys

    node = {
        "t": "ntuple",
        "module": "fastpersist_not_a_module_xyz",
        "name": "Pair",
        "fields": ["a", "b"],
        "v": ["x", None],
    }
    spec = {"spec_version": 1, "root": node}
    back = unflatten(spec, [])
    assert back == ("x", None) and type(back).__name__ == "Pair" and back.b is None  # type: ignore[attr-defined]
    assert "fastpersist_not_a_module_xyz" not in sys.modules
    # A class that exists but has other fields is not used, allow-listed or not.
    spec["root"].update(module=__name__, name="Point")  # type: ignore[union-attr]
    back = unflatten(spec, [], namedtuple_types=[Point])
    assert type(back) is not Point and back._fields == ("a", "b")  # type: ignore[attr-defined]
    # A matching, imported class is used only when the caller allow-lists it.
    spec["root"].update(fields=["x", "y"])  # type: ignore[union-attr]
    assert type(unflatten(spec, [])) is not Point
    assert type(unflatten(spec, [], namedtuple_types=[Point])) is Point
    with pytest.raises(TypeError, match="namedtuple classes"):
        unflatten(spec, [], namedtuple_types=[tuple])
    # Lazy torch submodules are not imported through module-level __getattr__.
    spec["root"].update(module="torch", name="onnx.Foo")  # type: ignore[union-attr]
    was_loaded = "torch.onnx" in sys.modules
    unflatten(spec, [])
    assert ("torch.onnx" in sys.modules) == was_loaded


# ----------------------------------------------------------------------------- records


def good_record() -> dict[str, object]:
    return records_to_json(flatten({"w": torch.zeros(2, 3)}).tensors)[0]


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("dtype", "float128", "unknown torch dtype"),
        ("dtype", 7, "unknown torch dtype"),
        ("kind", "pickle", "kind"),
        ("shape", [2, -3], "shape"),
        ("shape", [2, True], "shape"),
        ("shape", "2,3", "shape"),
        ("shape", [2**40, 2**40], "too many elements"),
        ("stride", [3, "1"], "stride"),
        ("stride", [1], "different lengths"),
        ("blob", -1, "blob"),
        ("blob", 1.0, "blob"),
        ("offset_bytes", 2, "multiple of the itemsize"),
        ("device", "cuda:0;x", "device"),
        ("device", None, "device"),
        ("requires_grad", 1, "booleans"),
        ("is_parameter", "yes", "booleans"),
        ("key_path", 3, "key_path"),
    ],
)
def test_records_from_json_rejects_bad_fields(field: str, value: object, match: str) -> None:
    rec = good_record()
    rec[field] = value
    with pytest.raises(ValueError, match=match):
        records_from_json([rec])


def test_records_from_json_rejects_bad_shapes_of_input() -> None:
    rec = good_record()
    with pytest.raises(ValueError, match="list"):
        records_from_json({"0": rec})
    with pytest.raises(ValueError, match="record 1"):
        records_from_json([rec, "x"])
    with pytest.raises(ValueError, match="missing"):
        records_from_json([{k: v for k, v in rec.items() if k != "device"}])
    with pytest.raises(ValueError, match="unexpected"):
        records_from_json([{**rec, "pickle": True}])
    with pytest.raises(ValueError, match="requires_grad"):
        records_from_json([{**rec, "dtype": "int64", "requires_grad": True}])
    np_rec = {**rec, "kind": "numpy", "dtype": "<f4"}
    assert records_from_json([np_rec])[0].dtype == "<f4"
    for bad in ("|O8", "<V8", "f4", "<f4 ", "<U0", "(2,)<f4"):
        with pytest.raises(ValueError, match="numpy dtype"):
            records_from_json([{**np_rec, "dtype": bad}])
    with pytest.raises(ValueError, match="C-contiguous"):
        records_from_json([{**np_rec, "stride": [1, 2]}])


@settings(max_examples=examples(300), deadline=None)
@given(st.dictionaries(st.sampled_from(list(good_record())), json_values, max_size=4))
def test_random_records_raise_only_value_error(changes: dict[str, object]) -> None:
    try:
        (rec,) = records_from_json([{**good_record(), **changes}])
    except ValueError:
        return
    buf = torch.zeros(64, dtype=torch.uint8)
    try:
        materialize([rec], [buf])
    except ValueError:
        pass


def test_materialize_checks_bounds() -> None:
    flat = flatten({"w": torch.zeros(4)})
    with pytest.raises(ValueError, match="past the end"):
        materialize(flat.tensors, [torch.zeros(15, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="does not exist"):
        materialize(flat.tensors, [])
    with pytest.raises(ValueError, match="uint8"):
        materialize(flat.tensors, [torch.zeros(4)])
    assert isinstance(flat.tensors[0], TensorRecord) and isinstance(flat.blobs[0], Blob)


def test_dtype_itemsize_rejects_unknown() -> None:
    assert dtype_itemsize("numpy", "<M8[ns]") == 8
    with pytest.raises(ValueError):
        dtype_itemsize("torch", "qint8")
    with pytest.raises(ValueError):
        dtype_itemsize("jax", "float32")


# ----------------------------------------------------------------------------- speed and devices


def test_flatten_of_10k_tensors_is_fast() -> None:
    sd = {f"layers.{i // 10}.mlp{i % 10}.weight": torch.zeros(8, 8) for i in range(10_000)}
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        flat = flatten(sd)
        best = min(best, time.perf_counter() - start)
    assert len(flat.blobs) == 10_000
    assert best < 0.25, f"flatten of 10k tensors took {best * 1e3:.1f} ms"  # generous for CI


def _never_called(device: torch.device) -> DeviceCopier:
    raise AssertionError("flatten only records the copier's factory; the save calls it")


@pytest.mark.parametrize(
    "device",
    [
        "fake",  # CPU tensors that use_copier makes device-resident
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
    ],
)
def test_device_tensors_stay_on_their_device_until_staged(device: str) -> None:
    on = "cpu" if device == "fake" else "cuda"
    w = torch.randn(4, 4, device=on)
    state = {"w": w, "wt": w.t(), "half": torch.randn(3, device=on).half()[::2]}
    seam = use_copier(lambda t: True, _never_called) if device == "fake" else contextlib.nullcontext()
    with seam:
        flat = flatten(state, copiers=DEVICE_COPIERS)
        host = flatten(state)  # without a save's copiers: copied to the host when first read
    assert [r.device for r in flat.tensors] == [str(w.device)] * 3
    assert all(b.device_copier is None and (b.version is None or device == "fake") for b in host.blobs)
    assert np.array_equal(host.blobs[0].data.view(np.float32), w.cpu().reshape(-1).numpy())
    assert len(flat.blobs) == 2  # w and its transpose share one
    for blob in flat.blobs:
        assert blob.device_copier is (_never_called if device == "fake" else CudaCopier)
        assert blob.source_tensor.device == w.device
        with pytest.raises(RuntimeError, match="its copier stages it"):
            _ = blob.data  # no host copy was made at flatten
    back = unflatten(flat.spec, materialize(flat.tensors, disk_buffers(flat)))
    assert torch.equal(back["w"], w.cpu()) and torch.equal(back["wt"], w.t().cpu())  # type: ignore[index]
    assert torch.equal(back["half"], state["half"].cpu())  # type: ignore[index]
