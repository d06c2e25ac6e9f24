"""Interop: torch_save files torch.load reads, and bit-identical conversions in every direction.

test_torch_save.py holds torch_save's drop-in behaviour (every kind of f and argument, CRCs)."""

from __future__ import annotations

import collections
import fractions
import os
from typing import Any

import numpy as np
import pytest
import torch

import fastpersist as fp
from fastpersist.interop.convert import convert, detect_format, read_any


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(10, 7, generator=gen)
    return {
        "model": collections.OrderedDict(
            [
                ("layers.0.weight", w),
                ("big", torch.randn(600, 600, generator=gen)),
                ("bf", torch.randn(33, generator=gen).to(torch.bfloat16)),
                ("fp8", torch.randn(5, generator=gen).to(torch.float8_e4m3fn)),
            ]
        ),
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, generator=gen)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}],
        },
        "view": w[2:5],
        "t": w.t(),
        "col": w[:, 3],
        "empty": torch.zeros(0, 5),
        "i8": torch.arange(4097, dtype=torch.int8),
        "c64": torch.randn(3, dtype=torch.complex64, generator=gen),
        "c128": torch.randn(3, dtype=torch.complex128, generator=gen),
        "flags": torch.tensor([True, False, True]),
        "step": 7,
        "lr": float("inf"),
        "name": "run-1",
        "dtype": torch.float16,
    }


def assert_same(a: object, b: object, path: str = "state") -> None:
    """Same structure, types, values; tensors with the same dtype, shape, strides and bytes."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), path
        assert a.contiguous().view(-1).view(torch.uint8).tolist() == b.contiguous().view(-1).view(torch.uint8).tolist()
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    else:
        assert a == b, path


def shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("kwargs", [{}, {"weights_only": True}, {"weights_only": True, "mmap": True}])
def test_torch_load_reads_torch_save_output(workdir: str, kwargs: dict[str, bool]) -> None:
    state = _state()
    path = os.path.join(workdir, "state.pt")
    fp.torch_save(state, path)
    loaded = torch.load(path, **kwargs)
    assert_same(state, loaded)
    assert shares(loaded["view"], loaded["model"]["layers.0.weight"]) and shares(loaded["t"], loaded["col"])
    assert not [p for p in os.listdir(workdir) if p != "state.pt"]  # no temporary left behind


def test_checkpoint_to_torch_and_back_is_bit_identical(workdir: str) -> None:
    state = _state()
    ckpt, pt, back = (os.path.join(workdir, n) for n in ("ckpt", "state.pt", "back"))
    fp.save(state, ckpt)
    assert convert(ckpt, "torch", pt)["src_format"] == "fastpersist"
    assert detect_format(pt) == "torch"
    loaded = torch.load(pt, weights_only=True, mmap=True)
    assert_same(state, loaded)
    # each storage of its own, as saved: not one shared read buffer
    assert loaded["model"]["big"].untyped_storage().nbytes() == 600 * 600 * 4
    convert(pt, "fastpersist", back)
    again = fp.load(back)
    assert_same(state, again)
    assert shares(again["view"], again["model"]["layers.0.weight"]) and shares(again["t"], again["col"])


def test_checkpoint_to_safetensors_and_back_is_bit_identical(workdir: str) -> None:
    import safetensors.torch

    state: dict[str, Any] = _state()
    state["arr"] = np.arange(6, dtype=np.int32).reshape(2, 3)
    state["tied"] = state["model"]["layers.0.weight"]
    ckpt, st, back = (os.path.join(workdir, n) for n in ("ckpt", "state.safetensors", "back"))
    fp.save(state, ckpt)
    convert(ckpt, "safetensors", st)
    assert detect_format(st) == "safetensors"
    flat = safetensors.torch.load_file(st)
    assert torch.equal(flat["model.layers.0.weight"], state["model"]["layers.0.weight"])
    assert torch.equal(flat["optimizer.state.0.exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert torch.equal(flat["t"], state["t"]) and torch.equal(flat["model.bf"].float(), state["model"]["bf"].float())
    assert flat["c128"].dtype == torch.uint8  # a dtype safetensors cannot name is kept as raw bytes
    convert(st, "fastpersist", back)
    again = fp.load(back)
    assert_same(state, again)
    assert again["tied"] is again["model"]["layers.0.weight"]
    assert shares(again["view"], again["model"]["layers.0.weight"]) and shares(again["t"], again["col"])


def test_torch_file_to_safetensors_to_torch(workdir: str) -> None:
    state = _state()
    pt, st, pt2 = (os.path.join(workdir, n) for n in ("a.pt", "b.safetensors", "c.pt"))
    torch.save(state, pt)
    convert(pt, "safetensors", st)
    convert(st, "torch", pt2)
    assert_same(state, torch.load(pt2, weights_only=True))


def test_plain_safetensors_file_imports_as_a_flat_dict(workdir: str) -> None:
    import safetensors.torch

    st, ckpt = os.path.join(workdir, "m.safetensors"), os.path.join(workdir, "ckpt")
    tensors = {"a.weight": torch.randn(3, 2), "b": torch.arange(5)}
    safetensors.torch.save_file(tensors, st)
    convert(st, "fastpersist", ckpt)
    assert_same(tensors, fp.load(ckpt))


def test_convert_refuses_what_it_cannot_read_safely(workdir: str) -> None:
    pt = os.path.join(workdir, "evil.pt")
    torch.save({"obj": fractions.Fraction(1, 3)}, pt)
    with pytest.raises(fp.FastPersistError, match="weights_only=False") as info:
        read_any(pt)
    assert pt in str(info.value) and "--unsafe-pickle" in str(info.value)
    junk = os.path.join(workdir, "junk.bin")
    with open(junk, "wb") as f:
        f.write(b"hello world")
    with pytest.raises(fp.FastPersistError, match="neither"):
        detect_format(junk)
    with pytest.raises(ValueError, match="to="):
        convert(pt, "onnx", junk)  # type: ignore[arg-type]
    broken = os.path.join(workdir, "broken.pt")
    with open(broken, "wb") as f:
        f.write(b"PK\x03\x04" + bytes(40))  # a zip header and nothing after it
    with pytest.raises(fp.FastPersistError, match="could not read it") as bad:
        read_any(broken, unsafe_pickle=True)
    assert broken in str(bad.value)


def _needs_unpickling(workdir: str) -> tuple[str, dict[str, Any]]:
    """A .pt file weights_only=True refuses (numpy arrays), holding only values fastpersist keeps."""
    state = {"w": torch.arange(6.0).reshape(2, 3), "rng": np.arange(5, dtype=np.uint32), "step": 3}
    pt = os.path.join(workdir, "numpy.pt")
    torch.save(state, pt)
    return pt, state


def test_convert_reads_a_file_that_needs_unpickling_only_when_told(
    workdir: str, caplog: pytest.LogCaptureFixture
) -> None:
    pt, state = _needs_unpickling(workdir)
    out = os.path.join(workdir, "ckpt")
    with pytest.raises(fp.FastPersistError, match="--unsafe-pickle") as info:
        convert(pt, "fastpersist", out)
    assert pt in str(info.value) and "numpy" in str(info.value)  # names the file and what torch refused
    assert not os.path.exists(out)
    with caplog.at_level("WARNING", logger="fastpersist"):
        assert convert(pt, "fastpersist", out, unsafe_pickle=True)["tensors"] == 2
    assert "weights_only=False" in caplog.text
    assert_same(state, fp.load(out))
    evil = os.path.join(workdir, "evil.pt")  # unpickled, but not a value a checkpoint keeps
    torch.save({"obj": fractions.Fraction(1, 3)}, evil)
    with pytest.raises(fp.UnsupportedValueError, match="Fraction"):
        convert(evil, "fastpersist", os.path.join(workdir, "evil-ckpt"), unsafe_pickle=True)
    back = os.path.join(workdir, "back.pt")
    convert(evil, "torch", back, unsafe_pickle=True)  # torch's own format keeps it, pickled
    assert torch.load(back, weights_only=False) == {"obj": fractions.Fraction(1, 3)}
