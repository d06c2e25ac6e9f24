"""The device staging path, driven on CPU through the copier seam (fastpersist.device), and on a
real GPU where there is one."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from typing import ClassVar

import pytest
import torch

import fastpersist as fp
from fastpersist import _core, device
from fastpersist.device import DeviceCopier, use_copier
from fastpersist.saving.pools import pool_for

from cuda_marks import cuda_test
from fake_cuda import FakeCuda, FakeRuntime

CHUNK = 64 << 10


class FakeCopier:
    """Copies host tensors as an asynchronous device copier would: a copy is checked and
    recorded when asked for, and runs only at the next wait() (reading its source then, as a
    queued copy does), so a job that read a slot before waiting would stage stale bytes. Can be
    held back, and made to fail."""

    pending: ClassVar[list[tuple[torch.Tensor, torch.Tensor]]] = []

    calls: ClassVar[list[tuple[int, int]]] = []
    begun = 0
    gate: threading.Event | None = None
    fail_after_bytes: int | None = None
    slots_owners: ClassVar[list[object]] = []

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def begin(self, slots_owner: object) -> None:
        FakeCopier.begun += 1
        FakeCopier.slots_owners.append(slots_owner)

    def copy_to_host(self, src: torch.Tensor, slot: memoryview, start: int, end: int) -> None:
        if FakeCopier.gate is not None:
            FakeCopier.gate.wait(30)
        copied = sum(n for _, n in FakeCopier.calls)
        if FakeCopier.fail_after_bytes is not None and copied >= FakeCopier.fail_after_bytes:
            raise RuntimeError("the fake device fell off the bus")
        assert src.dtype == torch.uint8 and src.dim() == 1 and src.numel() == end - start
        FakeCopier.pending.append((torch.frombuffer(slot, dtype=torch.uint8)[start:end], src))
        FakeCopier.calls.append((start, end - start))

    def wait(self) -> None:
        for dst, src in FakeCopier.pending:
            dst.copy_(src)
        FakeCopier.pending = []


@pytest.fixture
def fake_device() -> Iterator[set[int]]:
    """Tensors whose storage is in `on_device` are staged by FakeCopier, as GPU tensors would be."""
    FakeCopier.calls, FakeCopier.begun, FakeCopier.gate, FakeCopier.fail_after_bytes = [], 0, None, None
    FakeCopier.slots_owners, FakeCopier.pending = [], []
    on_device: set[int] = set()

    def selects(t: torch.Tensor) -> bool:
        return t.numel() > 0 and t.untyped_storage().data_ptr() in on_device

    def factory(device: torch.device) -> DeviceCopier:
        return FakeCopier(device)

    with use_copier(selects, factory):
        yield on_device


def _put_on_device(on_device: set[int], *tensors: torch.Tensor) -> None:
    for t in tensors:
        on_device.add(t.untyped_storage().data_ptr())


def _config(backend: str) -> fp.Config:
    return fp.Config(backend=backend, chunk_bytes=CHUNK, pool_bytes=4 * CHUNK, queue_depth=2)


def test_device_tensors_are_copied_chunk_by_chunk_into_slots(workdir: str, backend: str, fake_device: set[int]) -> None:
    weight = torch.randn(300_000)
    tied = {"emb": torch.randn(50_000, 4)}
    tied["head"] = tied["emb"]
    host = torch.arange(1000.0)
    _put_on_device(fake_device, weight, tied["emb"])
    path = os.path.join(workdir, "ckpt")
    fp.save({"w": weight, "tied": tied, "host": host}, path, config=_config(backend))
    assert FakeCopier.begun == 1
    assert all(n <= CHUNK for _, n in FakeCopier.calls)
    assert sum(n for _, n in FakeCopier.calls) == weight.nbytes + tied["emb"].nbytes
    state = fp.load(path)
    assert torch.equal(state["w"], weight) and torch.equal(state["host"], host)
    assert torch.equal(state["tied"]["emb"], tied["emb"])
    assert state["tied"]["head"].data_ptr() == state["tied"]["emb"].data_ptr()


def test_save_async_returns_before_any_device_copy(workdir: str, backend: str, fake_device: set[int]) -> None:
    weight = torch.randn(500_000)
    _put_on_device(fake_device, weight)
    FakeCopier.gate = threading.Event()
    fut = fp.save_async({"w": weight}, os.path.join(workdir, "ckpt"), config=_config(backend))
    assert FakeCopier.calls == [] and not fut.done()
    FakeCopier.gate.set()
    fut.wait()
    assert torch.equal(fp.load(fut.path)["w"], weight)


def test_guard_covers_device_tensors_and_small_ones_are_copied_on_device(
    workdir: str, backend: str, fake_device: set[int]
) -> None:
    big = torch.zeros(500_000)
    stats = torch.zeros(16)  # a BatchNorm statistic on the device
    _put_on_device(fake_device, big, stats)
    FakeCopier.gate = threading.Event()
    path = os.path.join(workdir, "ckpt")
    fut = fp.save_async({"big": big, "stats": stats}, path, config=_config(backend))
    stats.add_(1)  # the next forward: allowed, it was copied on its device at the call
    big[:1].add_(1)  # optimizer.step() before its bytes were staged: fails the save
    FakeCopier.gate.set()
    with pytest.raises(fp.SaveCancelledError, match=r"state\.big"):
        fut.wait()
    assert not os.path.exists(path)

    big.zero_()
    stats.zero_()
    fut = fp.save_async({"big": big, "stats": stats}, path, config=_config(backend))
    stats.add_(1)
    fut.wait()
    assert fp.load(path)["stats"].sum().item() == 0


def test_a_failing_device_copy_fails_the_save_and_commits_nothing(
    workdir: str, backend: str, fake_device: set[int]
) -> None:
    weight = torch.randn(500_000)
    _put_on_device(fake_device, weight)
    FakeCopier.fail_after_bytes = 3 * CHUNK
    path = os.path.join(workdir, "ckpt")
    fut = fp.save_async({"w": weight}, path, config=_config(backend))
    with pytest.raises(RuntimeError, match="fell off the bus"):
        fut.wait()
    assert not os.path.exists(path)
    assert not [n for n in os.listdir(workdir) if ".fptmp-" in n]


@cuda_test
def test_cuda_state_round_trip(workdir: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64)).cuda().to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    path = os.path.join(workdir, "gpu")
    fut = fp.save_async(state, path)
    fut.wait()
    loaded = fp.load(path)
    for key, value in state["model"].items():
        assert loaded["model"][key].device == value.device and torch.equal(loaded["model"][key], value), key


def test_pinned_memory_is_unregistered_when_its_owner_goes(fake_runtime: FakeRuntime) -> None:
    # CUDA keeps a registration by address: one outliving its memory would make later copies
    # to that address land in the old pages. Each registration is undone with its owner.
    pool = _core.Pool(1 << 20, 4 << 20)
    slots = [torch.empty(1 << 20, dtype=torch.uint8) for _ in range(2)]
    for slot in slots + slots:
        assert device.pin_host(slot, pool)
    assert fake_runtime.calls == [("register", s.data_ptr()) for s in slots]  # once per buffer
    del pool
    gc.collect()
    assert fake_runtime.calls[2:] == [("unregister", s.data_ptr()) for s in slots]
    device.pin_host(slots[0], slots[0])  # a new owner: registered again
    device.unpin_host(slots[0])
    assert fake_runtime.calls[4:] == [("register", slots[0].data_ptr()), ("unregister", slots[0].data_ptr())]


def test_device_copies_go_into_slots_owned_by_the_saves_pool(workdir: str, fake_device: set[int]) -> None:
    big = torch.randn(3 << 20)
    fake_device.add(big.untyped_storage().data_ptr())
    ck = fp.Checkpointer(os.path.join(workdir, "ck"))  # snapshot mode: a pool of its own
    ck.save(1, {"w": big})
    ck.wait()
    config = fp.Config(chunk_bytes=CHUNK)
    fp.save({"w": big}, os.path.join(workdir, "plain"), config=config)
    assert len(FakeCopier.slots_owners) == 2
    assert all(isinstance(owner, _core.Pool) for owner in FakeCopier.slots_owners)
    assert FakeCopier.slots_owners[1] is pool_for(config)  # the process-wide pool of that config
    assert FakeCopier.slots_owners[0] is not FakeCopier.slots_owners[1]


def test_cuda_copier_registers_and_copies_with_the_sources_device_current(
    fake_runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The staging thread is new per save, so CUDA's current device there is 0: a registration
    # or copy made before switching to cuda:3 would create a context on device 0.
    cuda = FakeCuda()
    monkeypatch.setattr(device, "cuda", cuda)
    fake_runtime.current = lambda: cuda.current
    copier = device.CudaCopier(torch.device("cuda", 3))
    pool = _core.Pool(1 << 20, 2 << 20)
    copier.begin(pool)
    slot = bytearray(4096)
    src = torch.arange(200, dtype=torch.uint8)
    staged = threading.Thread(target=copier.copy_to_host, args=(src, memoryview(slot), 100, 300))
    staged.start()
    staged.join()
    assert bytes(slot[100:300]) == bytes(src.numpy())
    assert fake_runtime.devices == [3]
    assert cuda.calls and all(index == 3 for _, index in cuda.calls), cuda.calls
    assert cuda.current == 0  # the thread's device is left as it was


def test_a_device_tensor_resized_before_its_copy_fails_the_save(
    workdir: str, backend: str, fake_device: set[int]
) -> None:
    weight = torch.randn(500_000)
    _put_on_device(fake_device, weight)
    FakeCopier.gate = threading.Event()
    path = os.path.join(workdir, "ckpt")
    fut = fp.save_async({"w": weight}, path, config=_config(backend))
    weight.resize_(1000)  # as a host blob's, its size is checked when its bytes are read
    FakeCopier.gate.set()
    with pytest.raises(RuntimeError, match=r"'state\.w' of 2000000 bytes was resized"):
        fut.wait()
    assert not os.path.exists(path)


def test_a_shared_device_storage_shrunk_before_its_copy_fails_the_save(
    workdir: str, backend: str, fake_device: set[int]
) -> None:
    # FSDP frees a flat parameter's storage (resize_(0)) between uses; the blob of a shared
    # storage is a view made at the call, which would read past the storage's new end. (Halved
    # here, not freed: on the CPU a read past a freed storage would crash the test run.)
    buf = torch.randn(400_000)
    _put_on_device(fake_device, buf)
    state = {"a": buf[:200_000], "b": buf[200_000:]}
    FakeCopier.gate = threading.Event()
    fut = fp.save_async(state, os.path.join(workdir, "ckpt"), config=_config(backend))
    buf.untyped_storage().resize_(buf.nbytes // 2)
    FakeCopier.gate.set()
    with pytest.raises(RuntimeError, match=r"resized .* in a storage of 800000"):
        fut.wait()


def test_copy_guard_finishes_the_device_copies_before_save_async_returns(
    workdir: str, backend: str, fake_device: set[int]
) -> None:
    weight = torch.randn(500_000)
    expected = weight.clone()
    _put_on_device(fake_device, weight)
    path = os.path.join(workdir, "ckpt")
    config = fp.Config(backend=backend, chunk_bytes=CHUNK, pool_bytes=64 * CHUNK, queue_depth=2, guard="copy")
    fut = fp.save_async({"w": weight}, path, config=config)
    assert sum(n for _, n in FakeCopier.calls) == weight.nbytes  # every byte is on the host
    weight.data.fill_(7.0)  # invisible to the version counter: cannot reach the checkpoint now
    fut.wait()
    assert torch.equal(fp.load(path)["w"], expected)


@cuda_test
def test_cuda_copy_guard_and_resized_tensors(workdir: str) -> None:
    weight = torch.randn(16 << 20, device="cuda")  # 64 MiB
    expected = weight.clone()
    path = os.path.join(workdir, "copy")
    config = fp.Config(chunk_bytes=1 << 20, pool_bytes=128 << 20, guard="copy")
    fut = fp.save_async({"w": weight}, path, config=config)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # another stream, through .data: nothing the guard could see
        weight.data.fill_(7.0)
    fut.wait()
    assert torch.equal(fp.load(path, map_location="cuda")["w"], expected)

    flat = torch.randn(64 << 20, device="cuda")  # 256 MiB through a 2 MiB pool: staging is slow
    params = {"a": flat[: 32 << 20], "b": flat[32 << 20 :]}
    bounded = fp.Config(chunk_bytes=1 << 20, pool_bytes=2 << 20, queue_depth=2)
    torch.cuda.synchronize()
    fut = fp.save_async(params, os.path.join(workdir, "freed"), config=bounded)
    flat.untyped_storage().resize_(0)  # FSDP frees the flat parameter between uses
    with pytest.raises(RuntimeError, match="resized"):
        fut.wait()


@cuda_test
def test_cuda_chunks_copied_ahead_of_their_checksum_round_trip(workdir: str) -> None:
    # Each chunk's device-to-host copy is queued while the chunk before it is checksummed: a
    # slot read before its copy completed would show as a checksum or value mismatch here.
    state = {f"w{k}": torch.randn(8 << 20, device="cuda") for k in range(4)}  # 4 x 32 MiB
    for name, config in {
        "snapshot": fp.Config(chunk_bytes=4 << 20, pool_bytes=256 << 20),
        "bounded": fp.Config(chunk_bytes=4 << 20, pool_bytes=16 << 20, queue_depth=2),
    }.items():
        path = os.path.join(workdir, name)
        fp.save_async(state, path, config=config).wait()
        fp.verify(path)
        loaded = fp.load(path, map_location="cuda")
        for key, value in state.items():
            assert torch.equal(loaded[key], value), (name, key)
