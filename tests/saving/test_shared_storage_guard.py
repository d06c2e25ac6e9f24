"""The mutation guard on storages shared by several tensors: every tensor of the storage is
watched by its own version counter, on the host and on a device (through the copier seam)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from typing import ClassVar

import pytest
import torch

import fastpersist as fp
from fastpersist.gpu.copiers import DeviceCopier, use_copier

from cuda_marks import cuda_test

#: Big enough that a bounded pool keeps staging busy while the test mutates.
ELEMS = (4 << 20) // 4


def _bounded(backend: str) -> fp.Config:
    return fp.Config(backend=backend, chunk_bytes=64 << 10, pool_bytes=256 << 10, queue_depth=2)


def _flat_params(count: int) -> tuple[torch.Tensor, list[torch.nn.Parameter]]:
    """Parameters that are views of one flat buffer, as FSDP, DeepSpeed and Megatron make them:
    ``p.data = buf[a:b]`` gives each a version counter of its own, not the buffer's."""
    buf = torch.zeros(count * ELEMS)
    params = []
    for k in range(count):
        p = torch.nn.Parameter(torch.empty(0))
        p.data = buf[k * ELEMS : (k + 1) * ELEMS]
        params.append(p)
    return buf, params


def test_a_write_to_any_parameter_of_a_flat_buffer_is_seen(workdir: str, backend: str) -> None:
    _, params = _flat_params(3)
    path = os.path.join(workdir, "ckpt")
    fut = fp.save_async({f"p{k}": p for k, p in enumerate(params)}, path, config=_bounded(backend))
    with torch.no_grad():
        params[2][:1].add_(1)  # optimizer.step() on the last one, before it was staged
    with pytest.raises(fp.SaveCancelledError, match=r"state\.p2"):
        fut.wait()
    assert not os.path.exists(path)


def test_flat_buffer_parameters_untouched_during_staging_are_saved(workdir: str, backend: str) -> None:
    buf, params = _flat_params(3)
    buf.copy_(torch.randn(buf.numel()))
    path = os.path.join(workdir, "ckpt")
    fp.save_async({f"p{k}": p for k, p in enumerate(params)}, path, config=_bounded(backend)).wait()
    loaded = fp.load(path)
    for k, p in enumerate(params):
        assert torch.equal(loaded[f"p{k}"], p.detach())
    assert loaded["p0"].untyped_storage().data_ptr() == loaded["p2"].untyped_storage().data_ptr()


class GatedCopier:
    """A device copier over host memory whose copies land at wait(), once `gate` is set."""

    needs_pinned_memory: ClassVar[bool] = False
    gate: threading.Event | None = None

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def begin(self) -> None:
        pass

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, early: bool = False) -> None:
        if early:  # ordered before the caller's later work
            for src, dst in pairs:
                dst.copy_(src)
            return
        self.pending.extend(pairs)

    def wait(self) -> None:
        if GatedCopier.gate is not None:
            GatedCopier.gate.wait(30)
        for src, dst in self.pending:
            dst.copy_(src)
        self.pending = []


@pytest.fixture
def fake_device() -> Iterator[set[int]]:
    """Tensors whose storage is in the set are staged by GatedCopier, as GPU tensors would be."""
    GatedCopier.gate = None
    on_device: set[int] = set()

    def selects(t: torch.Tensor) -> bool:
        return t.numel() > 0 and t.untyped_storage().data_ptr() in on_device

    def factory(device: torch.device) -> DeviceCopier:
        return GatedCopier(device)

    with use_copier(selects, factory):
        yield on_device


def test_a_fresh_device_tensor_and_its_view_save(workdir: str, backend: str, fake_device: set[int]) -> None:
    # The blob of a shared storage is a new tensor over it, with a counter of its own: a guard
    # comparing it with the owner's counter rejected a fresh {"w": w, "w0": w[0]} as torn.
    w = torch.randn(ELEMS // 8, 8)
    fake_device.add(w.untyped_storage().data_ptr())
    path = os.path.join(workdir, "ckpt")
    fp.save_async({"w": w, "w0": w[0]}, path, config=_bounded(backend)).wait()
    loaded = fp.load(path)
    assert torch.equal(loaded["w"], w) and torch.equal(loaded["w0"], w[0])


@pytest.mark.parametrize("which", ["view", "data"])
def test_a_write_to_any_tensor_of_a_shared_device_storage_is_seen(
    workdir: str, backend: str, fake_device: set[int], which: str
) -> None:
    if which == "view":
        w = torch.zeros(ELEMS // 8, 8)
        state, write, named = {"w": w, "w0": w[0]}, w[5], "state.w"
    else:
        buf, params = _flat_params(2)
        w = buf
        state, write, named = {"p0": params[0], "p1": params[1]}, params[1], "state.p1"
    fake_device.add(w.untyped_storage().data_ptr())
    GatedCopier.gate = threading.Event()
    path = os.path.join(workdir, "ckpt")
    fut = fp.save_async(state, path, config=_bounded(backend))
    with torch.no_grad():
        write[:1].add_(1)  # before the copier staged it
    GatedCopier.gate.set()
    with pytest.raises(fp.SaveCancelledError, match="modified in place") as info:
        fut.wait()
    assert f"'{named}'" in str(info.value)
    assert not os.path.exists(path)


@cuda_test
def test_cuda_shared_storages_save_and_their_writes_are_seen(workdir: str) -> None:
    w = torch.randn(1 << 20, 8, device="cuda")
    lstm = torch.nn.LSTM(256, 256, num_layers=2).cuda()  # its flat weights share one buffer
    state = {"w": w, "w0": w[0], "lstm": lstm.state_dict()}
    path = os.path.join(workdir, "fresh")
    fp.save_async(state, path).wait()
    loaded = fp.load(path)
    assert torch.equal(loaded["w"], w) and torch.equal(loaded["w0"], w[0])
    for key, value in state["lstm"].items():
        assert torch.equal(loaded["lstm"][key], value), key

    buf = torch.zeros(16 << 20, device="cuda")  # 64 MiB through a 2 MiB pool: staging takes a while
    params = [torch.nn.Parameter(torch.empty(0, device="cuda")) for _ in range(2)]
    for k, p in enumerate(params):
        p.data = buf[k * (8 << 20) : (k + 1) * (8 << 20)]
    config = fp.Config(chunk_bytes=1 << 20, pool_bytes=2 << 20, queue_depth=2)
    torch.cuda.synchronize()
    fut = fp.save_async({"p0": params[0], "p1": params[1]}, os.path.join(workdir, "torn"), config=config)
    with torch.no_grad():
        params[1][:1].add_(1)  # before the bounded pool let it be staged
    with pytest.raises(fp.SaveCancelledError, match=r"state\.p1"):
        fut.wait()
