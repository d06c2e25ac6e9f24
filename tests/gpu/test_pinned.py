"""Host memory registration with CUDA (fastpersist.gpu.pinned), through a fake runtime on CPU and
for real where there is a GPU: failures are checked and fall back loudly, registrations end
before their memory is freed, and nothing calls CUDA after the interpreter began to exit."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import ClassVar

import pytest
import torch

import fastpersist as fp
from fastpersist import _core
from fastpersist.gpu import pinned
from fastpersist.gpu.arenas import ARENAS
from fastpersist.gpu.copiers import DeviceCopier, use_copier
from fastpersist.saving import pools

from cuda_marks import cuda_test
from fake_cuda import FakeRuntime


class Owner:
    """An object that owns some memory (weakly referenceable)."""


def _buffers(count: int) -> list[torch.Tensor]:
    return [torch.empty(64 << 10, dtype=torch.uint8) for _ in range(count)]


def test_a_failed_registration_warns_once_copies_unpinned_and_is_never_undone(
    fake_runtime: FakeRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    fake_runtime.code = 2  # cudaErrorMemoryAllocation, as a locked-memory limit gives
    owner = Owner()
    first, second = _buffers(2)
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        assert not pinned.pin_host(first, owner)
        assert not pinned.pin_host(first, owner)  # not retried while its owner lives
        assert not pinned.pin_host(second, owner)
    assert not pinned.is_pinned(first)
    assert fake_runtime.calls == [("register", first.data_ptr()), ("register", second.data_ptr())]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "cudaHostRegister" in warnings[0].getMessage() and "fake error 2" in warnings[0].getMessage()
    assert "ulimit -l" in warnings[0].getMessage()
    del owner
    gc.collect()
    assert [c for c in fake_runtime.calls if c[0] == "unregister"] == []  # nothing of ours to undo


def test_an_empty_buffer_is_never_registered(fake_runtime: FakeRuntime, caplog: pytest.LogCaptureFixture) -> None:
    fake_runtime.code = 1  # cudaErrorInvalidValue, what CUDA answers for a zero-byte range
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        assert pinned.pin_host(torch.empty(0, dtype=torch.uint8), Owner())
    assert fake_runtime.calls == [] and not caplog.records


def test_memory_registered_by_someone_else_is_pinned_but_not_ours_to_undo(fake_runtime: FakeRuntime) -> None:
    fake_runtime.code = pinned.ALREADY_REGISTERED
    owner = Owner()
    (buffer,) = _buffers(1)
    assert pinned.pin_host(buffer, owner) and pinned.is_pinned(buffer)
    del owner
    gc.collect()
    assert fake_runtime.calls == [("register", buffer.data_ptr())]


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


class PinningCopier:
    """A device copier over host memory whose arena is pinned, as CudaCopier's is."""

    needs_pinned_memory: ClassVar[bool] = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def begin(self) -> None:
        pass

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, early: bool = False) -> None:
        for src, dst in pairs:
            assert pinned.is_pinned(_arena_tensor(dst)), "the arena is pinned before any copy"
            dst.copy_(src)

    def wait(self) -> None:
        pass  # each copy is done when copy returns


def _arena_tensor(view: torch.Tensor) -> torch.Tensor:
    """The arena tensor `view` is a view of (what the arena set pinned)."""
    return next(
        k.host for k in ARENAS._kept if k.host.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
    )


def _factory(device: torch.device) -> DeviceCopier:
    return PinningCopier(device)


def test_arenas_are_unregistered_before_their_memory_is_unmapped(workdir: str, fake_runtime: FakeRuntime) -> None:
    # pyo3 drops an arena's memory before it clears weak references: a weakref callback would
    # unregister unmapped (and maybe reused) memory. The arena calls its own callbacks first.
    ARENAS.clear()
    gc.collect()
    still_mapped: list[bool] = []
    fake_runtime.on_unregister = lambda address: still_mapped.append(_mapped(address))
    weight = torch.randn(1 << 20)
    with use_copier(lambda t: t is weight, _factory):
        fp.save({"w": weight}, os.path.join(workdir, "ckpt"), config=fp.Config(chunk_bytes=1 << 20))
    registered = [address for what, address in fake_runtime.calls if what == "register"]
    assert len(registered) == 1 and _mapped(registered[0])
    ARENAS.clear()
    gc.collect()
    assert still_mapped == [True], "an arena was unregistered after its memory was unmapped"
    assert not _mapped(registered[0])


_AT_EXIT = """
import torch
from fastpersist import _core
from fastpersist.gpu import pinned

class Runtime:
    def register(self, address, nbytes):
        return 0
    def unregister(self, address):
        print("unregister", address, flush=True)
        return 0
    def describe(self, code):
        return str(code)

class Owner:
    pass

pinned.use_runtime(Runtime())
pool, owner = _core.Pool(1 << 20, 2 << 20), Owner()
buffers = [torch.zeros(4096, dtype=torch.uint8) for _ in range(2)]
assert pinned.pin_host(buffers[0], pool) and pinned.pin_host(buffers[1], owner)
print("exiting", flush=True)
"""


def test_nothing_is_unregistered_once_the_interpreter_exits(tmp_path: object) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", _AT_EXIT], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["exiting"], done.stdout
    assert "Exception ignored" not in done.stderr, done.stderr


@cuda_test
def test_cuda_a_refused_registration_leaves_no_error_behind() -> None:
    runtime = pinned.CudaRuntime()
    assert runtime.register(0, 4096) != 0  # nothing there to pin: refused by return code
    # The runtime's last error was cleared: the next kernel launch check does not raise it.
    x = torch.ones(1 << 10, device="cuda")
    assert (x * 2).sum().item() == 2 << 10
    torch.cuda.synchronize()


@cuda_test
def test_cuda_registration_round_trip_on_another_thread() -> None:
    owners = [Owner()]
    host = torch.zeros(1 << 20, dtype=torch.uint8)
    src = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device="cuda")
    result: list[bool] = []

    def stage() -> None:  # a new thread, as the staging thread is
        with torch.cuda.device(src.device):
            result.append(pinned.pin_host(host, owners[0]))
            host.copy_(src, non_blocking=True)
            torch.cuda.current_stream().synchronize()

    worker = threading.Thread(target=stage)
    worker.start()
    worker.join()
    assert result == [True] and pinned.is_pinned(host)
    assert torch.equal(host, src.cpu())
    owners.clear()
    gc.collect()
    assert not pinned.is_pinned(host)


def test_pool_supports_callbacks_before_free() -> None:
    calls: list[str] = []
    pool = _core.Pool(1 << 20, 2 << 20)
    pool.call_before_free(lambda: calls.append("first"))
    pool.call_before_free(lambda: calls.append("second"))
    del pool
    gc.collect()
    assert calls == ["first", "second"]


class SpyRuntime:
    """The CUDA runtime, noting which registrations succeeded and whether each address was
    still mapped when it was undone."""

    def __init__(self, runtime: pinned.HostRuntime) -> None:
        self.runtime = runtime
        self.registered: list[int] = []
        self.still_mapped: dict[int, bool] = {}

    def register(self, address: int, nbytes: int) -> int:
        code = self.runtime.register(address, nbytes)
        if code == 0:
            self.registered.append(address)
        return code

    def unregister(self, address: int) -> int:
        self.still_mapped[address] = _mapped(address)
        return self.runtime.unregister(address)

    def describe(self, code: int) -> str:
        return self.runtime.describe(code)


@cuda_test
def test_cuda_pool_slots_are_unregistered_before_the_pool_frees_them(workdir: str) -> None:
    spy = SpyRuntime(pinned.CudaRuntime())
    previous = pinned.use_runtime(spy)
    try:
        chunk = 64 << 20
        config = fp.Config(chunk_bytes=chunk, pool_bytes=2 * chunk)
        fp.save({"w": torch.randn(1 << 20, device="cuda")}, os.path.join(workdir, "ckpt"), config=config)
        assert spy.registered, "the slots were not registered"
        pools.POOLS.take((chunk, 2 * chunk))  # out of the cache: freed once nothing holds it
        gc.collect()
        assert sorted(spy.still_mapped) == sorted(spy.registered)
        assert all(spy.still_mapped.values()), "a slot was unregistered after its memory was freed"
    finally:
        pinned.use_runtime(previous)


_ON_DEVICE_1 = """
import ctypes, os, sys
import torch
import fastpersist as fp

def primary_context_active(index):
    cuda = ctypes.CDLL("libcuda.so.1")
    device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert cuda.cuDeviceGet(ctypes.byref(device), index) == 0
    assert cuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) == 0
    return bool(active.value)

x = torch.randn(1 << 22, device="cuda:1")  # torch's current device stays 0
torch.cuda.synchronize("cuda:1")
if primary_context_active(0):
    print("torch-made-one")
    sys.exit(0)
root = sys.argv[1]
fp.save({"x": x}, os.path.join(root, "a"))
y = fp.load(os.path.join(root, "a"), map_location="cuda:1")["x"]
assert torch.equal(x, y)
print("context-on-0" if primary_context_active(0) else "none-on-0")
"""


@cuda_test
def test_cuda_a_rank_on_another_device_creates_no_context_on_device_0(workdir: str) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [sys.executable, "-c", _ON_DEVICE_1, workdir], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    if done.stdout.split() == ["torch-made-one"]:
        pytest.skip("this torch creates a context on device 0 by itself")
    assert done.stdout.split() == ["none-on-0"], done.stdout
