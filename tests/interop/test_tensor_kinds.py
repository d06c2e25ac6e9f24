"""Every kind of tensor torch makes, through the overlapped saves.

``fp.torch_save(_async)`` is sold as a drop-in for ``torch.save``: whatever torch.save writes, it
writes, and ``torch.load`` reads back the values at the call. ``fp.save_async`` writes its own
format: a kind it holds comes back exactly, a kind it does not is refused at the call with an
error naming the key path. Either way, a tensor modified in place right after the call, before
its bytes are staged, is never committed torn: the save holds the values at the call or fails
with ``SaveCancelledError``. Inference tensors keep no version counter, so they are copied at
the call (docs/overlap.md, "What the version guard sees").
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastpersist as fp

from budget import examples

#: Large enough that a 256 KiB pool is still staging it when the caller modifies it.
BIG = 1 << 20


class _Tagged(torch.Tensor):
    """A tensor subclass (module-level, so that pickle finds it)."""


def _plain(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32)


def _inference(n: int) -> torch.Tensor:
    with torch.inference_mode():
        return torch.arange(n, dtype=torch.float32)


KINDS: dict[str, Callable[[int], torch.Tensor]] = {
    "plain": _plain,
    "inference": _inference,
    "parameter": lambda n: torch.nn.Parameter(_plain(n)),
    "strided_view": lambda n: _plain(2 * n)[::2],
    "conj": lambda n: torch.complex(_plain(n), -_plain(n)).conj(),
    "sparse_coo": lambda n: torch.eye(min(n, 64)).to_sparse(),
    "sparse_csr": lambda n: torch.eye(min(n, 64)).to_sparse_csr(),
    "quantized": lambda n: torch.quantize_per_tensor(_plain(n) / n, 0.01, 0, torch.qint8),
    "quantized_per_channel": lambda n: torch.quantize_per_channel(
        torch.rand(4, 8), torch.rand(4) + 0.1, torch.zeros(4, dtype=torch.long), 0, torch.quint8
    ),
    "nested": lambda n: torch.nested.nested_tensor([_plain(3), _plain(5)]),
    "nested_jagged": lambda n: torch.nested.nested_tensor([_plain(3), _plain(5)], layout=torch.jagged),
    "subclass": lambda n: _plain(n).as_subclass(_Tagged),
}
#: The kinds fp.save refuses, by design (docs: supported leaves): their error names the key path.
FP_REFUSES = {"quantized", "quantized_per_channel", "nested", "nested_jagged", "subclass"}
#: Kinds an in-place op right after the call can reach (dense, strided, not sparse).
MODIFIABLE = {"plain", "inference", "parameter", "strided_view", "subclass"}


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _values(t: torch.Tensor) -> object:
    """What a loaded tensor holds, comparable across kinds."""
    if t.is_quantized:
        return (t.int_repr().tolist(), t.qscheme(), t.dtype)
    if t.is_nested:
        return [c.tolist() for c in t.unbind()]
    if t.layout != torch.strided:
        return t.to_dense().tolist()
    return t.resolve_conj().tolist()


def _modify(t: torch.Tensor) -> None:
    with torch.inference_mode(t.is_inference()), torch.no_grad():
        t.add_(1)


@settings(
    max_examples=examples(30),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    kinds=st.lists(st.sampled_from(sorted(KINDS)), min_size=1, max_size=4, unique=True),
    modified=st.sets(st.sampled_from(sorted(MODIFIABLE))),
    api=st.sampled_from(["torch_save_async", "save_async"]),
    backend=st.sampled_from(["threads", "io_uring"]),
)
def test_every_tensor_kind_comes_back_as_it_was_at_the_call(
    tmp_path_factory: pytest.TempPathFactory, kinds: list[str], modified: set[str], api: str, backend: str
) -> None:
    state = {kind: KINDS[kind](BIG // 4) for kind in kinds}
    at_call = {kind: _values(_snapshot(t)) for kind, t in state.items()}
    path = os.path.join(tmp_path_factory.mktemp("kinds"), "state.pt")
    config = fp.Config(backend=backend, pool_bytes=256 << 10, chunk_bytes=64 << 10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own warnings about quantized and nested tensors
        if api == "save_async" and FP_REFUSES & set(kinds):
            with pytest.raises(fp.UnsupportedValueError) as refused:
                fp.save_async(state, path, config=config)
            assert any(f"'state.{kind}'" in str(refused.value) for kind in FP_REFUSES & set(kinds)), refused.value
            assert not os.path.exists(path)
            return
        save = fp.torch_save_async if api == "torch_save_async" else fp.save_async
        fut = save(state, path, config=config)
        for kind in modified & set(kinds):
            _modify(state[kind])
        try:
            fut.wait()
        except fp.SaveCancelledError:
            # Only a tensor with a version counter may fail the save; an inference tensor is copied.
            assert modified & set(kinds) - {"inference"}, "a save failed with only inference tensors modified"
            assert not os.path.exists(path)
            return
        loaded = torch.load(path, weights_only=False) if api == "torch_save_async" else fp.load(path)
    assert {kind: _values(t) for kind, t in loaded.items()} == at_call


@pytest.mark.parametrize("api", ["torch_save", "torch_save_async"])
def test_states_torch_refuses_to_compose_without_data_are_written_by_torch_save(tmp_path: str, api: str) -> None:
    """torch will not compose a quantized or nested tensor's archive under ``skip_data``: the
    drop-in writes such a state with torch.save itself, atomically, and torch.load reads it."""
    state = {"q": KINDS["quantized"](64), "n": KINDS["nested"](0), "w": _plain(16)}
    path = os.path.join(tmp_path, "state.pt")
    with open(path, "wb") as f:
        f.write(b"the previous file")
    if api == "torch_save":
        result = fp.torch_save(state, path)
    else:
        result = fp.torch_save_async(state, path).wait()
    assert result.backend == "torch.save"
    loaded = torch.load(path, weights_only=False)
    assert {k: _values(v) for k, v in loaded.items()} == {k: _values(v) for k, v in state.items()}
    assert [n for n in os.listdir(tmp_path) if ".fptmp-" in n] == []


def test_an_object_torch_save_refuses_raises_torchs_error_and_keeps_the_file(tmp_path: str) -> None:
    path = os.path.join(tmp_path, "state.pt")
    with open(path, "wb") as f:
        f.write(b"the previous file")
    with pytest.raises((AttributeError, TypeError, pickle_error())):
        fp.torch_save({"q": KINDS["quantized"](64), "f": lambda: 0}, path)
    with open(path, "rb") as f:
        assert f.read() == b"the previous file"
    assert sorted(os.listdir(tmp_path)) == ["state.pt"]


def pickle_error() -> type[Exception]:
    import pickle

    return pickle.PicklingError


@pytest.mark.parametrize("api", ["save_async", "torch_save_async"])
def test_an_inference_tensor_modified_before_staging_is_saved_as_it_was_at_the_call(
    tmp_path: str, backend: str, api: str
) -> None:
    """An inference tensor keeps no version counter: the overlapped save copies it at the call,
    so an in-place op right after the call (16 MiB behind a 1 MiB pool: still staging) cannot
    reach the checkpoint."""
    config = fp.Config(backend=backend, pool_bytes=1 << 20, chunk_bytes=256 << 10)
    for trial in range(3):
        with torch.inference_mode():
            t = torch.zeros(16 << 20, dtype=torch.uint8)
        path = os.path.join(tmp_path, f"{api}-{trial}")
        save = fp.save_async if api == "save_async" else fp.torch_save_async
        fut = save({"t": t}, path, config=config)
        with torch.inference_mode():
            t.add_(1)
        fut.wait()
        got = fp.load(path)["t"] if api == "save_async" else torch.load(path, weights_only=True)["t"]
        assert got.unique().tolist() == [0], f"trial {trial}: the save holds values written after the call"
