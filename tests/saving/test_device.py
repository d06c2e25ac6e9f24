"""The device staging path, driven on CPU through the copier seam (fastpersist.gpu.copiers), and
on a real GPU where there is one: every copy of an arena window asked for in one call, queued
asynchronously, waited for once; the engine writes straight from the arena."""

from __future__ import annotations

import gc
import os
import re
import threading
import time
from collections.abc import Iterator, Sequence
from typing import ClassVar

import pytest
import torch

import fastpersist as fp
from fastpersist import _core
from fastpersist.gpu import copiers
from fastpersist.gpu.arenas import ARENAS, Arenas, min_pinned_bytes
from fastpersist.gpu.copiers import DeviceCopier, use_copier
from fastpersist.gpu.device_side import arena_views
from fastpersist.gpu.pinned import pin_host, unpin_host

from cuda_marks import cuda_test
from fake_cuda import FakeCuda, FakeRuntime, InstantCopier

CHUNK = 64 << 10


class FakeCopier:
    """Copies host tensors as an asynchronous device copier would: ``copy`` records the pairs
    and hands them to a thread of its own, which copies them after a short delay (or once
    ``gate`` is set), as a queued DMA lands later; ``wait`` joins it. A job that read, checksummed
    or wrote arena bytes before waiting would see stale ones. Can be made to fail."""

    needs_pinned_memory: ClassVar[bool] = False
    #: The number of pairs of each copy call, in order.
    calls: ClassVar[list[int]] = []
    copied_bytes: ClassVar[list[int]] = []
    waits: ClassVar[int] = 0
    early_pairs: ClassVar[int] = 0
    begun: ClassVar[int] = 0
    gate: ClassVar[threading.Event | None] = None
    #: Holds back wait() (after the copies landed) until set.
    wait_gate: ClassVar[threading.Event | None] = None
    fail_after_calls: ClassVar[int | None] = None

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.threads: list[threading.Thread] = []

    def begin(self) -> None:
        FakeCopier.begun += 1

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, early: bool = False) -> None:
        if early:  # ordered before the caller's later work: done before the save call returns
            FakeCopier.early_pairs += len(pairs)
            for src, dst in pairs:
                dst.copy_(src)
            return
        if FakeCopier.fail_after_calls is not None and len(FakeCopier.calls) >= FakeCopier.fail_after_calls:
            raise RuntimeError("the fake device fell off the bus")
        for src, dst in pairs:
            assert src.dtype == torch.uint8 and src.dim() == 1 and src.numel() == dst.numel()
        FakeCopier.calls.append(len(pairs))
        gate = FakeCopier.gate

        def land() -> None:
            if gate is not None:
                gate.wait(30)
            time.sleep(0.005)
            for src, dst in pairs:
                dst.copy_(src)
                FakeCopier.copied_bytes.append(src.numel())

        thread = threading.Thread(target=land)
        thread.start()
        self.threads.append(thread)

    def wait(self) -> None:
        FakeCopier.waits += 1
        for thread in self.threads:
            thread.join()
        self.threads = []
        if FakeCopier.wait_gate is not None:
            FakeCopier.wait_gate.wait(30)


@pytest.fixture
def fake_device() -> Iterator[set[int]]:
    """Tensors whose storage is in `on_device` are staged by FakeCopier, as GPU tensors would be."""
    FakeCopier.calls, FakeCopier.copied_bytes, FakeCopier.waits, FakeCopier.begun = [], [], 0, 0
    FakeCopier.early_pairs = 0
    FakeCopier.gate, FakeCopier.wait_gate, FakeCopier.fail_after_calls = None, None, None
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


def test_a_state_is_copied_in_one_call_one_piece_per_tensor(workdir: str, backend: str, fake_device: set[int]) -> None:
    weight = torch.randn(300_000)
    tied = {"emb": torch.randn(50_000, 4)}
    tied["head"] = tied["emb"]
    host = torch.arange(1000.0)
    _put_on_device(fake_device, weight, tied["emb"])
    path = os.path.join(workdir, "ckpt")
    fp.save({"w": weight, "tied": tied, "host": host}, path, config=_config(backend))
    assert FakeCopier.begun == 1
    assert FakeCopier.calls == [2], "one call, a piece per tensor"
    assert FakeCopier.waits == 1
    assert sum(FakeCopier.copied_bytes) == weight.nbytes + tied["emb"].nbytes
    state = fp.load(path)
    assert torch.equal(state["w"], weight) and torch.equal(state["host"], host)
    assert torch.equal(state["tied"]["emb"], tied["emb"])
    assert state["tied"]["head"].data_ptr() == state["tied"]["emb"].data_ptr()
    fp.verify(path)


def test_python_calls_do_not_grow_with_the_chunks(workdir: str, backend: str, fake_device: set[int]) -> None:
    # 8 tensors over 512 chunks of 64 KiB: still one copy call and one wait per save.
    state = {f"w{k}": torch.randn(1 << 20) for k in range(8)}
    _put_on_device(fake_device, *state.values())
    staged: list[int] = []
    for rep in range(2):
        FakeCopier.calls, FakeCopier.waits = [], 0
        path = os.path.join(workdir, f"ckpt{rep}")
        fut = fp.save_async(state, path, config=_config(backend))
        fut.wait()
        staged.append(len(FakeCopier.calls) + FakeCopier.waits)
        assert FakeCopier.calls == [8] and FakeCopier.waits == 1
        loaded = fp.load(path)
        assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert staged == [2, 2]


def test_save_async_returns_with_the_copies_queued_not_landed(
    workdir: str, backend: str, fake_device: set[int]
) -> None:
    weight = torch.randn(500_000)
    _put_on_device(fake_device, weight)
    FakeCopier.gate = threading.Event()
    fut = fp.save_async({"w": weight}, os.path.join(workdir, "ckpt"), config=_config(backend))
    assert FakeCopier.calls == [1], "the copies are queued before save_async returns"
    assert FakeCopier.copied_bytes == [] and not fut.done()
    with pytest.raises(TimeoutError):
        fut.wait_staged(timeout=0.2)  # staged only once they landed
    FakeCopier.gate.set()
    fut.wait_staged()
    assert sum(FakeCopier.copied_bytes) == weight.nbytes
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
    FakeCopier.gate = None
    fut = fp.save_async({"big": big, "stats": stats}, path, config=_config(backend))
    stats.add_(1)
    fut.wait_staged()
    big.add_(1)  # after wait_staged(): allowed, the copy has landed
    fut.wait()
    loaded = fp.load(path)
    assert loaded["stats"].sum().item() == 0 and loaded["big"].sum().item() == 0


def test_one_early_copy_budget_for_host_and_device_tensors(workdir: str, fake_device: set[int]) -> None:
    from fastpersist.format.flatten import flatten
    from fastpersist.gpu.early import EARLY_COPY_BUDGET_BYTES, EARLY_COPY_MAX_BYTES, choose_early_copies

    per = EARLY_COPY_MAX_BYTES // 4  # 256 KiB tensors: 256 of them fill the 64 MiB budget
    count = EARLY_COPY_BUDGET_BYTES // per * 3 // 4  # 192 host and 192 device tensors
    host = [torch.zeros(per // 4) for _ in range(count)]
    device = [torch.zeros(per // 4) for _ in range(count)]
    _put_on_device(fake_device, *device)
    blobs = flatten({"host": host, "device": device}, copiers=copiers.DEVICE_COPIERS).blobs
    chosen = choose_early_copies(blobs)
    assert sum(blobs[i].nbytes for i in chosen) <= EARLY_COPY_BUDGET_BYTES
    assert len(chosen) == EARLY_COPY_BUDGET_BYTES // per < 2 * count  # one budget, not two
    assert any(blobs[i].device_copier is not None for i in chosen)
    assert any(blobs[i].device_copier is None for i in chosen)


def test_a_failing_device_copy_fails_the_save_and_commits_nothing(
    workdir: str, backend: str, fake_device: set[int]
) -> None:
    weight = torch.randn(500_000)
    _put_on_device(fake_device, weight)
    FakeCopier.fail_after_calls = 0
    path = os.path.join(workdir, "ckpt")
    fut = fp.save_async({"w": weight}, path, config=_config(backend))
    with pytest.raises(RuntimeError, match="fell off the bus"):
        fut.wait()
    assert not os.path.exists(path)
    assert not [n for n in os.listdir(workdir) if ".fptmp-" in n]
    assert not any(kept.arena.leased for kept in ARENAS._kept), "the arena is free again"


def test_a_state_beyond_pinned_bytes_stages_in_windows(workdir: str, backend: str, fake_device: set[int]) -> None:
    # 12 MiB of device tensors through arenas bounded at 4 MiB: three or more windows, the
    # arena reused only after each window's writes completed (or the files would be wrong).
    ARENAS.clear()
    state = {f"w{k}": torch.randn(3 << 18) for k in range(4)}  # 4 x 3 MiB
    host = torch.arange(10_000.0)
    _put_on_device(fake_device, *state.values())
    config = fp.Config(backend=backend, chunk_bytes=1 << 20, queue_depth=2, pinned_bytes=4 << 20)
    path = os.path.join(workdir, "ckpt")
    fp.save_async({**state, "host": host}, path, config=config).wait()
    assert len(FakeCopier.calls) >= 3 and FakeCopier.waits == len(FakeCopier.calls)
    assert ARENAS.total_bytes() <= 4 << 20
    loaded = fp.load(path)
    assert all(torch.equal(loaded[k], v) for k, v in state.items()) and torch.equal(loaded["host"], host)
    fp.verify(path)
    ARENAS.clear()


def test_arenas_are_reused_and_bounded_across_many_saves(workdir: str, fake_device: set[int]) -> None:
    ARENAS.clear()
    state = {"w": torch.randn(1 << 20)}
    _put_on_device(fake_device, *state.values())
    config = fp.Config(chunk_bytes=1 << 20, pinned_bytes=16 << 20)
    futures = []
    for k in range(20):
        futures.append(fp.save_async(state, os.path.join(workdir, f"s{k % 3}"), config=config))
        if len(futures) > 2:
            futures.pop(0).wait()
    for fut in futures:
        fut.wait()
    assert ARENAS.total_bytes() <= 3 * (4 << 20), "a few arenas, reused: none made per save"
    assert torch.equal(fp.load(os.path.join(workdir, "s1"))["w"], state["w"])
    ARENAS.clear()


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 2 << 20])
def test_a_save_completes_with_the_least_pinned_bytes_its_chunk_allows(
    workdir: str, fake_device: set[int], chunk_bytes: int
) -> None:
    ARENAS.clear()  # other tests' free arenas would serve it, whatever the bound
    state = {"w": torch.randn(5 << 18)}  # 5 MiB: windows of one 2 MiB arena
    _put_on_device(fake_device, *state.values())
    config = fp.Config(chunk_bytes=chunk_bytes, pinned_bytes=min_pinned_bytes(chunk_bytes))
    path = os.path.join(workdir, "ckpt")
    fp.save_async(state, path, config=config).wait(timeout=60)
    assert torch.equal(fp.load(path)["w"], state["w"]) and ARENAS.total_bytes() == 2 << 20
    ARENAS.clear()


def test_an_arena_bound_below_one_chunk_is_refused_not_waited_for(caplog: pytest.LogCaptureFixture) -> None:
    # Config refuses such an integer; "auto" (a quarter of memory per local rank) can still be that small.
    with pytest.raises(ValueError, match=r"Config\.pinned_bytes \(4194304 bytes\).*chunk_bytes=8388608"):
        Arenas().lease(32 << 20, cap_bytes=4 << 20, min_bytes=8 << 20, pin=False)
    assert "waits" not in caplog.text


def test_free_arenas_smaller_than_a_chunk_give_their_room_to_one_that_is_not() -> None:
    arenas = Arenas()
    small = [arenas.lease(2 << 20, cap_bytes=8 << 20, min_bytes=1 << 20, pin=False) for _ in range(4)]
    del small  # four free arenas of 2 MiB fill the bound; a save of 8 MiB chunks can use none of them
    lease, _ = arenas.lease(16 << 20, cap_bytes=8 << 20, min_bytes=8 << 20, pin=False, wait=False)
    assert lease.arena.len_bytes == 8 << 20 and arenas.total_bytes() == 8 << 20


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
    arena = _core.Arena(4 << 20)
    host = torch.frombuffer(arena, dtype=torch.uint8)
    parts = [host[: 1 << 20], host[2 << 20 :]]
    for part in parts + parts:
        assert pin_host(part, arena)
    assert fake_runtime.calls == [("register", p.data_ptr()) for p in parts]  # once per buffer
    del arena, host, parts, part
    gc.collect()
    assert [c[0] for c in fake_runtime.calls[2:]] == ["unregister", "unregister"]
    other = torch.empty(1 << 20, dtype=torch.uint8)
    pin_host(other, other)  # an owner that supports weak references
    unpin_host(other)
    assert fake_runtime.calls[4:] == [("register", other.data_ptr()), ("unregister", other.data_ptr())]


def test_arenas_for_cuda_copiers_are_pinned_once(
    workdir: str, fake_runtime: FakeRuntime, fake_device: set[int]
) -> None:
    class PinningCopier(FakeCopier):
        needs_pinned_memory: ClassVar[bool] = True

    ARENAS.clear()
    big = torch.randn(3 << 20)
    with use_copier(lambda t: t.untyped_storage().data_ptr() == big.untyped_storage().data_ptr(), PinningCopier):
        for k in range(3):
            fp.save({"w": big}, os.path.join(workdir, f"p{k}"), config=fp.Config(chunk_bytes=1 << 20))
    registered = [c for c in fake_runtime.calls if c[0] == "register"]
    assert len(registered) == 1 and fp.gpu.pinned_bytes() >= big.nbytes
    ARENAS.clear()
    gc.collect()
    assert fp.gpu.pinned_bytes() == 0


def test_cuda_copier_queues_every_copy_with_the_sources_device_current(
    fake_runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The save's thread is new per save, so CUDA's current device there is 0: a copy queued
    # before switching to cuda:3 would create a context on device 0.
    cuda = FakeCuda()
    monkeypatch.setattr(copiers, "cuda", cuda)
    monkeypatch.setattr(copiers, "_side_streams", {})
    fake_runtime.current = lambda: cuda.current
    recorded: list[tuple[int, object]] = []  # CPU tensors here: record what the allocator would be told
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: recorded.append((t.data_ptr(), stream)))
    copier = copiers.CudaCopier(torch.device("cuda", 3))
    copier.begin()
    dst = torch.zeros(300, dtype=torch.uint8)
    src = torch.arange(200, dtype=torch.uint8)
    pairs = [(src[:100], dst[:100]), (src[100:], dst[200:])]
    staged = threading.Thread(target=lambda: (copier.copy(pairs), copier.wait()))
    staged.start()
    staged.join()
    assert bytes(dst[:100].numpy()) == bytes(src[:100].numpy()) and bytes(dst[200:].numpy()) == bytes(src[100:].numpy())
    assert cuda.calls and all(index == 3 for _, index in cuda.calls), cuda.calls
    assert cuda.current == 0  # the thread's device is left as it was
    # Each source's block stays the side stream's until its copy ran (freed storages, repro 44).
    assert recorded == [(s.data_ptr(), copier.stream) for s, _ in pairs]


def test_a_device_tensor_resized_before_its_copy_fails_the_save(
    workdir: str, backend: str, fake_device: set[int]
) -> None:
    weight = torch.randn(500_000)
    _put_on_device(fake_device, weight)
    path = os.path.join(workdir, "ckpt")
    FakeCopier.wait_gate = threading.Event()
    fut = fp.save_async({"w": weight}, path, config=_config(backend))
    while not FakeCopier.copied_bytes:  # the copy has landed; the job has not yet checked it
        time.sleep(0.001)
    weight.resize_(1000)  # its size is checked once its copies landed: they may have read freed memory
    FakeCopier.wait_gate.set()
    with pytest.raises(RuntimeError, match=r"'state\.w' of 2000000 bytes was resized"):
        fut.wait()
    assert not os.path.exists(path)


def test_a_shared_device_storage_shrunk_before_its_copy_fails_the_save(
    workdir: str, backend: str, fake_device: set[int]
) -> None:
    # FSDP frees a flat parameter's storage (resize_(0)) between uses; the copies were queued
    # at the call, and may have read memory the allocator handed on: the save fails. (Halved
    # after the fake's copy landed: on the CPU a read of a freed storage could crash the run.)
    buf = torch.randn(400_000)
    _put_on_device(fake_device, buf)
    state = {"a": buf[:200_000], "b": buf[200_000:]}
    FakeCopier.wait_gate = threading.Event()
    fut = fp.save_async(state, os.path.join(workdir, "ckpt"), config=_config(backend))
    while not FakeCopier.copied_bytes:
        time.sleep(0.001)
    buf.untyped_storage().resize_(buf.nbytes // 2)
    FakeCopier.wait_gate.set()
    with pytest.raises(RuntimeError, match=r"resized .* in a storage of 800000"):
        fut.wait()


def _free_and_reallocate(t: torch.Tensor) -> None:
    """FSDP's pattern between uses: the storage freed (``resize_(0)``), re-allocated at its size
    and written by an all-gather (no version bump). A block of that size taken meanwhile keeps
    the new allocation from landing where the old one was, as a caching allocator may not."""
    storage = t.untyped_storage()
    nbytes, address = storage.nbytes(), t.data_ptr()
    storage.resize_(0)
    squatter = torch.empty(nbytes, dtype=torch.uint8)
    storage.resize_(nbytes)
    storage.fill_(9)
    del squatter
    assert t.data_ptr() != address, "the allocator handed the same block back"


def test_a_device_storage_freed_and_reallocated_before_its_copy_fails_the_save(
    workdir: str, backend: str, fake_device: set[int]
) -> None:
    path = os.path.join(workdir, "ckpt")
    flat = torch.full((500_000,), 5.0)
    _put_on_device(fake_device, flat)
    fp.save({"flat": flat}, path, config=_config(backend))
    FakeCopier.gate = threading.Event()
    fut = fp.save_async({"flat": flat}, path, config=_config(backend))
    _free_and_reallocate(flat)  # same size, same version: only its address says it is not the same memory
    FakeCopier.gate.set()
    with pytest.raises(RuntimeError, match=r"tensor 'state\.flat' of 2000000 bytes moved .* freed and re-allocated"):
        fut.wait()
    assert torch.equal(fp.load(path)["flat"], torch.full((500_000,), 5.0)), "the previous checkpoint stays"
    assert not [n for n in os.listdir(workdir) if ".fptmp-" in n]


class ReallocatingCopier(InstantCopier):
    """A copy engine whose copies land after their sources' storages were freed and re-allocated,
    as when the caller's later work runs while the copies are queued."""

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, early: bool = False) -> None:
        for src, _ in pairs:
            _free_and_reallocate(src)
        super().copy(pairs, early=early)


def test_torch_save_of_a_device_storage_freed_and_reallocated_under_its_copy_fails(workdir: str) -> None:
    # fp.torch_save (as the DCP writer's files) stages device tensors through the same staging.
    target = os.path.join(workdir, "model.pt")
    weight = torch.full((500_000,), 5.0)
    torch.save({"w": weight}, target)
    address = weight.untyped_storage().data_ptr()
    with use_copier(lambda t: t.numel() > 0 and t.untyped_storage().data_ptr() == address, ReallocatingCopier):
        with pytest.raises(RuntimeError, match=rf"tensor '{re.escape(target)}: extent \d+' .* freed and re-allocated"):
            fp.torch_save({"w": weight}, target)
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.full((500_000,), 5.0))
    assert os.listdir(workdir) == ["model.pt"]


def test_copy_guard_finishes_the_device_copies_before_save_async_returns(
    workdir: str, backend: str, fake_device: set[int]
) -> None:
    weight = torch.randn(500_000)
    expected = weight.clone()
    _put_on_device(fake_device, weight)
    path = os.path.join(workdir, "ckpt")
    config = fp.Config(backend=backend, chunk_bytes=CHUNK, pool_bytes=64 * CHUNK, queue_depth=2, guard="copy")
    fut = fp.save_async({"w": weight}, path, config=config)
    assert sum(FakeCopier.copied_bytes) == weight.nbytes  # every byte is on the host
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
def test_cuda_storage_freed_and_reallocated_under_its_queued_copy_fails_the_save(workdir: str) -> None:
    """On a real caching allocator: the side stream's copies hold their source blocks
    (record_stream), so a storage freed and re-allocated at once lands elsewhere, and the save
    fails naming the tensor instead of committing the new allocation's bytes."""
    path = os.path.join(workdir, "fsdp")
    flat = torch.full((64 << 20,), 5.0, device="cuda")  # 256 MiB through a 2 MiB pool
    fp.save({"flat": flat}, path)
    bounded = fp.Config(chunk_bytes=1 << 20, pool_bytes=2 << 20, queue_depth=2)
    torch.cuda.synchronize()
    fut = fp.save_async({"flat": flat}, path, config=bounded)
    storage = flat.untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)
    storage.resize_(nbytes)
    storage.fill_(9)  # the all-gather's bytes
    with pytest.raises(RuntimeError, match=r"freed and re-allocated|resized"):
        fut.wait()
    assert torch.equal(fp.load(path)["flat"], torch.full((64 << 20,), 5.0)), "the previous checkpoint stays"


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


@pytest.mark.parametrize("on_device", [False, True])
def test_a_gated_save_is_staged_at_once_and_written_when_the_gate_opens(
    workdir: str, backend: str, fake_device: set[int], on_device: bool
) -> None:
    # A Checkpointer's snapshot waiting for the disk: staged (host tensors too) into an arena at
    # once, its writes held back; cancelled while it waits, it commits nothing.
    from fastpersist.futures import SaveFuture
    from fastpersist.saving.start import start_save

    state = {"w": torch.randn(300_000), "b": torch.arange(10.0)}
    expected = {k: v.clone() for k, v in state.items()}
    if on_device:
        _put_on_device(fake_device, state["w"])
    config = fp.Config(backend=backend, chunk_bytes=CHUNK).resolved_for(workdir)
    for cancel in (False, True):
        path = os.path.join(workdir, f"gated-{cancel}")
        gate = _core.WriteGate()
        fut = SaveFuture(start_save(state, path, config, write_gate=gate))
        fut.wait_staged()
        for t in state.values():
            t.add_(1)  # after wait_staged(): the snapshot is taken
        time.sleep(0.05)
        assert not fut.done() and not os.path.exists(path)
        assert any(kept.arena.leased for kept in ARENAS._kept)
        if cancel:
            assert fut.cancel()
            with pytest.raises(fp.SaveCancelledError):
                fut.wait()
            assert not os.path.exists(path)
        else:
            gate.open()
            fut.wait()
            loaded = fp.load(path)
            assert all(torch.equal(loaded[k], v) for k, v in expected.items())
        for t in state.values():
            t.sub_(1)
        deadline = time.monotonic() + 5
        while any(kept.arena.leased for kept in ARENAS._kept) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(kept.arena.leased for kept in ARENAS._kept)


@pytest.mark.parametrize(
    ("offsets", "lengths"),
    [([0, 10, 30], [10, 5, 2]), ([4, 100], [96, 28]), ([0], [128]), ([50, 0], [10, 20]), ([0, 5], [10, 10])],
)
def test_arena_views_are_the_slices_of_their_pieces(offsets: list[int], lengths: list[int]) -> None:
    host = torch.zeros(128, dtype=torch.uint8)
    views = arena_views(host, offsets, lengths)
    for view, offset, n in zip(views, offsets, lengths, strict=True):
        assert view.numel() == n and view.data_ptr() == host.data_ptr() + offset  # a view, not a copy
