"""Loads to a device (fastpersist.loading.todevice), driven on CPU through the loader seam
(fastpersist.gpu.loaders.use_loader), and on a real GPU where there is one.

The fake loader treats every target whose type is "cuda" as a device but allocates its
destinations on the CPU. Its copies run in order on one queue, only when a fence after them is
waited for or the test synchronizes the fake device (as an asynchronous copy completes some time
later, and ``finish`` does not block the host), so a ring buffer refilled too early, in this
load or the next, shows up as wrong values; the tests also check the contract directly: no read
into a ring buffer that copies not yet run read from, copies only from registered ring buffers,
every destination byte written once, and window k+1 read before window k's copies were waited
for.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

import fastpersist as fp
from fastpersist.format.seal import seal, unseal
from fastpersist.gpu import copiers, loaders, pinned
from fastpersist.gpu.loaders import DeviceLoader, use_loader
from fastpersist.loading import pipeline, todevice
from fastpersist.loading.reading import direct_padded

from cuda_marks import cuda_test
from fake_cuda import FakeCuda, FakeRuntime

CHUNK = 64 << 10
WINDOW = 2 * CHUNK


class FakeQueue:
    """The fake device's copy queue (one stream): copies run in the order they were queued, and
    only when a fence after them is waited for or the device is synchronized, as an
    asynchronous copy completes some time after it was queued."""

    def __init__(self) -> None:
        self.pending: collections.deque[tuple[torch.Tensor, torch.Tensor, int]] = collections.deque()
        self.queued = 0
        self.done = 0
        self.log = FakeLoader.log  # a stale fence (a ring cached by an earlier test) logs elsewhere

    def push(self, host: torch.Tensor, dst: torch.Tensor, window: int) -> None:
        self.pending.append((host, dst, window))
        self.queued += 1

    def run_until(self, count: int) -> None:
        """Runs the copies queued before the `count`-th one."""
        while self.done < count:
            host, dst, window = self.pending.popleft()
            dst.copy_(host)
            self.done += 1
            self.log.append(("ran", window))

    def reads_from(self, base: int) -> bool:
        """Whether a copy not yet run reads from the host buffer that starts at `base`."""
        return any(host.untyped_storage().data_ptr() == base for host, _, _ in self.pending)


class FakeFence:
    """The end of the copies queued on `queue` before the `count`-th."""

    def __init__(self, queue: FakeQueue, count: int) -> None:
        self.queue, self.count = queue, count

    def synchronize(self) -> None:
        self.queue.log.append(("wait", self.count))
        self.queue.run_until(self.count)


class FakeLoader:
    """A DeviceLoader over CPU memory whose copies complete only when waited for."""

    log: ClassVar[list[tuple[str, object]]] = []
    reads: ClassVar[list[int]] = []
    registered: ClassVar[dict[int, int]] = {}
    allocated: ClassVar[dict[int, int]] = {}
    written: ClassVar[dict[int, list[tuple[int, int]]]] = {}
    #: Ring buffers read into while copies from them had not run (the read spy notes them).
    busy_refills: ClassVar[list[int]] = []
    queue: FakeQueue
    fail_at_copy: int | None = None
    copies = 0

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.begun = False
        FakeLoader.log.append(("new", str(device)))

    @staticmethod
    def synchronize() -> None:
        """Runs every queued copy (``torch.cuda.synchronize()``, or using the loaded tensors on
        the stream that was current during the load)."""
        FakeLoader.queue.run_until(FakeLoader.queue.queued)

    def begin(self) -> None:
        self.begun = True

    def register(self, host: torch.Tensor) -> None:
        FakeLoader.registered[host.data_ptr()] = host.numel()

    def empty(self, nbytes: int) -> torch.Tensor:
        assert self.begun, "destinations are allocated after begin()"
        dst = torch.empty(nbytes, dtype=torch.uint8)
        FakeLoader.allocated[dst.untyped_storage().data_ptr()] = nbytes
        return dst

    def copy_to_device(self, host: torch.Tensor, dst: torch.Tensor) -> None:
        FakeLoader.copies += 1
        if FakeLoader.fail_at_copy is not None and FakeLoader.copies >= FakeLoader.fail_at_copy:
            raise RuntimeError("the fake device fell off the bus")
        base = host.untyped_storage().data_ptr()
        assert FakeLoader.registered.get(base) == host.untyped_storage().nbytes(), "not from a ring buffer"
        assert host.numel() == dst.numel() and dst.dtype == torch.uint8
        storage = dst.untyped_storage().data_ptr()
        assert storage in FakeLoader.allocated
        FakeLoader.written.setdefault(storage, []).append((dst.storage_offset(), dst.numel()))
        FakeLoader.queue.push(host, dst, len(FakeLoader.reads) - 1)

    def fence(self) -> FakeFence:
        return FakeFence(FakeLoader.queue, FakeLoader.queue.queued)

    def finish(self) -> None:
        # The caller's stream waits for the copies; the host does not: nothing runs here.
        FakeLoader.log.append(("finish", str(self.device)))


def _install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resets FakeLoader, reads in windows of two chunks and records each window's read."""
    FakeLoader.log, FakeLoader.reads, FakeLoader.registered = [], [], {}
    FakeLoader.allocated, FakeLoader.written, FakeLoader.fail_at_copy, FakeLoader.copies = {}, {}, None, 0
    FakeLoader.busy_refills, FakeLoader.queue = [], FakeQueue()
    monkeypatch.setattr(todevice, "DEVICE_WINDOW_BYTES", WINDOW)
    read_window = todevice.read_window

    def spy(root: str, m: Any, lo: int, hi: int, dest: Any, verify: bool, config: fp.Config, stats: Any) -> None:
        if FakeLoader.queue.reads_from(torch.frombuffer(dest, dtype=torch.uint8).data_ptr()):
            FakeLoader.busy_refills.append(lo)
        FakeLoader.reads.append(lo)
        FakeLoader.log.append(("read", lo))
        read_window(root, m, lo, hi, dest, verify, config, stats)

    monkeypatch.setattr(todevice, "read_window", spy)


def _factory(device: torch.device) -> DeviceLoader:
    return FakeLoader(device)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeLoader]]:
    """Targets of type "cuda" load through FakeLoader (into CPU memory)."""
    _install(monkeypatch)
    with use_loader(lambda d: d.type == "cuda", _factory):
        yield FakeLoader
    assert FakeLoader.busy_refills == [], "a ring buffer was refilled while copies from it had not run"


@pytest.fixture
def fake_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeLoader]]:
    """CPU tensors of out= are filled through FakeLoader, as CUDA tensors would be."""
    _install(monkeypatch)
    with use_loader(lambda d: d.type == "cpu", _factory):
        yield FakeLoader
    assert FakeLoader.busy_refills == [], "a ring buffer was refilled while copies from it had not run"


def _config(backend: str) -> fp.Config:
    return fp.Config(backend=backend, chunk_bytes=CHUNK, pool_bytes=4 * CHUNK, queue_depth=2)


def _record_device(path: str, device: str, keys: set[str] | None = None) -> None:
    """Rewrites the manifest as if the tensors at `keys` (all: None) had been saved from `device`
    (on a machine without a GPU, the save records "cpu"), resealing it."""
    manifest = os.path.join(path, "manifest.json")
    with open(manifest, "rb") as f:
        body, _ = unseal(f.read(), manifest)
    doc = json.loads(body)
    for rec in doc["tensors"]:
        if rec["kind"] == "torch" and (keys is None or rec["key_path"] in keys):
            rec["device"] = device
    with open(manifest, "wb") as f:
        f.write(seal(json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()))


def _state() -> dict[str, Any]:
    torch.manual_seed(14)  # the same values each call
    big = torch.randn(100_000)  # 400 KB: spans several windows
    emb = torch.nn.Parameter(torch.randn(300, 40))
    return {
        "big": big,
        "view": big[1000:1500],  # a view with a storage offset into a shared storage
        "emb": emb,
        "head": emb,  # tied weights
        "bf16": torch.randn(7000).to(torch.bfloat16),
        "half": torch.randn(33).half(),
        "i64": torch.arange(5000),
        "mask": torch.rand(999) > 0.5,
        "c64": torch.randn(10, dtype=torch.complex64),
        "u8": torch.randint(0, 255, (70_001,), dtype=torch.uint8),
        "empty": torch.zeros(0, 3),
        "np": np.arange(12.0),
        "tokenizer": bytes(range(256)) * 20,  # over 4 KiB: a host-only record among device blobs
        "step": 7,
    }


def _saved(workdir: str, backend: str, device: str | None = "cuda:0", keys: set[str] | None = None) -> str:
    path = os.path.join(workdir, "ckpt")
    fp.save(_state(), path, config=_config(backend))
    if device is not None:
        _record_device(path, device, keys)
    return path


def _on_fake(t: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() in FakeLoader.allocated


def _assert_equal(loaded: dict[str, Any], expected: dict[str, Any]) -> None:
    """Compares on the caller's stream: the load's queued copies run first."""
    FakeLoader.synchronize()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
        elif isinstance(value, np.ndarray):
            assert np.array_equal(loaded[key], value), key
        else:
            assert type(loaded[key]) is type(value) and loaded[key] == value, key


def _last_call() -> tuple[str, object]:
    """The last call the load made to a loader (the queue's own runs left out)."""
    return next(e for e in reversed(FakeLoader.log) if e[0] != "ran")


def _assert_every_byte_once() -> None:
    for storage, pieces in FakeLoader.written.items():
        at = 0
        for offset, nbytes in sorted(pieces):
            assert offset == at, (
                f"bytes [{at}, {offset}) of a destination written {'twice' if offset < at else 'never'}"
            )
            at = offset + nbytes
        assert at == FakeLoader.allocated[storage]


def test_round_trip_to_the_saved_device(
    workdir: str, backend: str, fake_cuda: type[FakeLoader], monkeypatch: Any
) -> None:
    path = _saved(workdir, backend)
    monkeypatch.setattr(pipeline, "read_stream", None)  # the device path never reads the whole stream
    phases: dict[str, float] = {}
    loaded = fp.load(path, phases=phases)  # map_location=None: each tensor back to "cuda:0"
    _assert_equal(loaded, _state())
    assert 0 < phases["crc32c"] <= phases["read"], phases  # every window's checksums, inside read
    torch_keys = [k for k, v in loaded.items() if isinstance(v, torch.Tensor) and v.numel()]
    assert all(_on_fake(loaded[k]) for k in torch_keys)
    assert not _on_fake(torch.from_numpy(loaded["np"]))
    assert loaded["head"] is loaded["emb"] and isinstance(loaded["emb"], torch.nn.Parameter)
    assert loaded["view"].untyped_storage().data_ptr() == loaded["big"].untyped_storage().data_ptr()
    assert loaded["view"].storage_offset() == 1000
    _assert_every_byte_once()
    assert [e for e in FakeLoader.log if e[0] == "new"] == [("new", "cuda:0")]
    assert _last_call() == ("finish", "cuda:0")


def test_host_memory_is_two_windows_and_reads_overlap_copies(
    workdir: str, backend: str, fake_cuda: type[FakeLoader]
) -> None:
    path = _saved(workdir, backend)
    total = fp.inspect(path)["total_bytes"]
    fp.load(path)
    assert len(FakeLoader.registered) == 2
    assert all(n == direct_padded(WINDOW) for n in FakeLoader.registered.values())
    assert len(FakeLoader.reads) == -(-total // WINDOW) >= 4
    assert FakeLoader.reads == list(range(0, total, WINDOW))
    # Window k's copies ran (were waited for) only after window k+1 had been read: the read of
    # one window overlapped the copies of the one before.
    log = FakeLoader.log
    read_at = [i for i, e in enumerate(log) if e[0] == "read"]
    ran_at = {e[1]: i for i, e in reversed(list(enumerate(log))) if e[0] == "ran"}  # first run of each
    assert set(ran_at) == set(range(len(read_at) - 2))  # the last two are still in flight
    assert all(ran_at[k] > read_at[k + 1] for k in ran_at)


@pytest.mark.parametrize(
    ("location", "saved"),
    [("cuda", None), (torch.device("cuda:0"), None), ({"cpu": "cuda:1"}, None), ({"cuda:1": "cuda:0"}, "cuda:1")],
)
def test_map_location_forms(
    workdir: str, backend: str, fake_cuda: type[FakeLoader], location: Any, saved: str | None
) -> None:
    path = _saved(workdir, backend, saved)
    loaded = fp.load(path, location)
    _assert_equal(loaded, _state())
    assert _on_fake(loaded["big"]) and _on_fake(loaded["emb"])
    news = [e for e in FakeLoader.log if e[0] == "new"]
    expected = {"cuda": "cuda", "cuda:0": "cuda:0"}.get(str(location), "cuda:1" if saved is None else "cuda:0")
    assert news == [("new", expected)]


def test_callable_and_cpu_targets_keep_the_host_path(workdir: str, backend: str, fake_cuda: type[FakeLoader]) -> None:
    path = _saved(workdir, backend)
    seen: list[str] = []

    def keep(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        seen.append(location)
        return storage

    for location in (keep, "cpu", {"cuda:0": "cpu"}):
        loaded = fp.load(path, location)
        _assert_equal(loaded, _state())
        assert not _on_fake(loaded["big"])
    assert seen and set(seen) == {"cuda:0"}
    assert FakeLoader.log == [] and FakeLoader.reads == []


def test_mixed_state_cpu_blobs_land_in_host_memory(workdir: str, backend: str, fake_cuda: type[FakeLoader]) -> None:
    path = _saved(workdir, backend, "cuda:0", {"state.big", "state.view", "state.bf16", "state.u8"})
    loaded = fp.load(path)
    _assert_equal(loaded, _state())
    assert _on_fake(loaded["big"]) and _on_fake(loaded["view"]) and _on_fake(loaded["u8"])
    assert not _on_fake(loaded["emb"]) and not _on_fake(loaded["i64"]) and not _on_fake(loaded["mask"])
    assert loaded["head"] is loaded["emb"]
    _assert_every_byte_once()


def _damage_last_window(path: str) -> str:
    """Flips one byte of a chunk in the stream's last window; returns that data file's path."""
    info = fp.inspect(path)
    files = sorted(info["files"], key=lambda f: f["bytes"])
    target = files[-1]["path"]
    with open(target, "r+b") as f:
        f.seek(files[-1]["bytes"] - 1000)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return str(target)


def test_a_corrupt_chunk_in_a_later_window_names_file_and_tensor(
    workdir: str, backend: str, fake_cuda: type[FakeLoader]
) -> None:
    path = _saved(workdir, backend)
    damaged = _damage_last_window(path)
    with pytest.raises(fp.ChecksumMismatchError, match="checksum mismatch") as info:
        fp.load(path)
    assert info.value.filename == damaged and damaged in str(info.value)
    assert info.value.tensors and "u8" in str(info.value)
    assert len(FakeLoader.reads) > 2  # found in a later window, after copies were queued
    assert _last_call()[0] == "finish"  # copies in flight were let finish


def test_a_file_missing_at_read_time_is_a_corrupt_checkpoint(
    workdir: str, backend: str, fake_cuda: type[FakeLoader], monkeypatch: pytest.MonkeyPatch
) -> None:
    stripes = [os.path.join(workdir, f"ssd{i}") for i in range(2)]
    for s in stripes:
        os.mkdir(s)
    path = os.path.join(workdir, "striped")
    fp.save(_state(), path, config=fp.Config(backend=backend, chunk_bytes=CHUNK, stripes=stripes))
    _record_device(path, "cuda:0")
    last = max(fp.inspect(path)["files"], key=lambda f: f["path"])["path"]
    monkeypatch.setattr(pipeline, "check_data_files", lambda *args: None)  # it would catch this first
    os.unlink(last)
    with pytest.raises(fp.CorruptCheckpointError, match="missing") as info:
        fp.load(path)
    assert str(last) in str(info.value) and len(FakeLoader.reads) > 1
    assert _last_call()[0] == "finish"


def test_a_failing_copy_names_the_checkpoint_and_returns_nothing(
    workdir: str, backend: str, fake_cuda: type[FakeLoader]
) -> None:
    path = _saved(workdir, backend)
    FakeLoader.fail_at_copy = 4
    with pytest.raises(fp.FastPersistError, match="fell off the bus") as info:
        fp.load(path)
    assert path in str(info.value) and "cuda:0" in str(info.value)
    assert _last_call()[0] == "finish"
    FakeLoader.fail_at_copy = None
    _assert_equal(fp.load(path), _state())  # the ring is reusable after a failed load


def test_out_fills_device_tensors_in_place_through_the_loader(
    workdir: str, backend: str, fake_cpu: type[FakeLoader]
) -> None:
    path = _saved(workdir, backend, None)
    expected = _state()
    out = {
        k: torch.empty_like(v) for k, v in expected.items() if isinstance(v, torch.Tensor) and k not in ("view", "head")
    }
    out["i64"] = torch.empty(10_000, dtype=torch.int64)[::2]  # not contiguous: filled on the host path
    for t in out.values():
        FakeLoader.allocated[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    state = fp.load(path, out=out)
    _assert_equal(state, expected)
    assert all(state[k] is t for k, t in out.items())
    written = set(FakeLoader.written)
    ptr = {k: t.untyped_storage().data_ptr() for k, t in out.items()}
    assert {ptr["emb"], ptr["bf16"], ptr["u8"], ptr["c64"], ptr["mask"]} <= written
    # "view" is not in out, so its storage ("big") and the strided i64 take the host path
    assert ptr["big"] not in written and ptr["i64"] not in written
    assert {k for k, n in FakeLoader.allocated.items() if k in written} == written
    FakeLoader.allocated = {k: n for k, n in FakeLoader.allocated.items() if k in written}
    _assert_every_byte_once()
    assert len(FakeLoader.registered) == 2


def test_a_failed_out_load_through_the_loader_leaves_out_as_it_was(
    workdir: str, backend: str, fake_cpu: type[FakeLoader]
) -> None:
    """The ring copies straight into `out`'s device tensors, so every checksum is checked in a
    first pass, before the first copy is queued."""
    path = _saved(workdir, backend, None)
    damaged = _damage_last_window(path)
    out = {k: torch.full_like(v, 7) for k, v in _state().items() if isinstance(v, torch.Tensor) and k != "view"}
    out.pop("head")
    for t in out.values():
        FakeLoader.allocated[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    before = {k: t.clone() for k, t in out.items()}
    with pytest.raises(fp.ChecksumMismatchError) as info:
        fp.load(path, out=out)
    assert info.value.filename == damaged
    assert FakeLoader.reads == [] and FakeLoader.copies == 0  # the ring never started
    for key, t in out.items():
        assert torch.equal(t, before[key]), f"out[{key!r}] was modified"


def _saved_one(workdir: str, name: str, value: torch.Tensor, config: fp.Config) -> str:
    path = os.path.join(workdir, name)
    fp.save({"w": value}, path, config=config)
    _record_device(path, "cuda:0")
    return path


def test_a_load_does_not_refill_the_ring_under_the_last_loads_copies(
    workdir: str, backend: str, fake_cuda: type[FakeLoader]
) -> None:
    # A load returns once its copies are queued (the caller's stream waits for them, the host
    # does not), and its ring goes back to the cache: the next load must not read into a
    # buffer the last window's copies still read from, or A ends up holding B's bytes.
    a, b = torch.full((20_000,), 1.0), torch.full((20_000,), 2.0)  # each fits in one window
    a_path = _saved_one(workdir, "a", a, _config(backend))
    b_path = _saved_one(workdir, "b", b, _config(backend))
    loaded_a = fp.load(a_path)
    loaded_b = fp.load(b_path)
    FakeLoader.synchronize()  # the caller uses both on its stream
    assert torch.equal(loaded_a["w"], a) and torch.equal(loaded_b["w"], b)
    assert FakeLoader.busy_refills == []


def test_a_dropped_ring_is_unpinned_only_once_its_copies_ran(
    workdir: str, backend: str, fake_cuda: type[FakeLoader], monkeypatch: pytest.MonkeyPatch
) -> None:
    unpinned: list[tuple[int, bool]] = []

    def spy(host: torch.Tensor) -> None:
        unpinned.append((host.data_ptr(), FakeLoader.queue.reads_from(host.data_ptr())))

    todevice.RINGS.clear()  # rings of earlier tests go before the spy counts
    monkeypatch.setattr(todevice, "unpin_host", spy)
    values = [torch.full((20_000,), float(k)) for k in range(4)]
    paths = [_saved_one(workdir, f"s{k}", v, _config(backend)) for k, v in enumerate(values)]
    loaded = []
    for k, path in enumerate(paths):  # a ring size per load: the cache keeps two, drops the rest
        monkeypatch.setattr(todevice, "DEVICE_WINDOW_BYTES", WINDOW << k)
        loaded.append(fp.load(path))
    assert len(unpinned) == 2 * (len(paths) - todevice.RINGS.keep)  # two buffers per dropped ring
    assert not any(busy for _, busy in unpinned), "a ring buffer was unpinned while copies from it were queued"
    FakeLoader.synchronize()
    for got, value in zip(loaded, values, strict=True):
        assert torch.equal(got["w"], value)


def test_cuda_loader_calls_cuda_with_the_target_device_current(
    fake_runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The caller's current device may be another GPU: registering the ring or queueing copies
    # there would create a context on it (or pin for the wrong one).
    cuda = FakeCuda()
    monkeypatch.setattr(copiers, "cuda", cuda)
    fake_runtime.current = lambda: cuda.current
    loader = loaders.CudaLoader(torch.device("cuda", 2))
    loader.begin()
    host = torch.arange(256, dtype=torch.uint8)
    dst = torch.empty(256, dtype=torch.uint8)
    loader.register(host)
    loader.copy_to_device(host, dst)
    loader.fence().synchronize()
    loader.finish()
    pinned.unpin_host(host)
    assert torch.equal(dst, host)
    assert fake_runtime.devices == [2]
    assert cuda.calls and all(index == 2 for _, index in cuda.calls), cuda.calls
    assert cuda.current == 0


@cuda_test
def test_cuda_load_round_trip(workdir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(todevice, "DEVICE_WINDOW_BYTES", 1 << 20)  # several windows
    state = {k: v for k, v in _state().items() if k != "np"}
    state["gpu"] = torch.randn(3_000_000, device="cuda")
    state["gpu_tied"] = state["gpu"]
    path = os.path.join(workdir, "gpu")
    fp.save(state, path)
    loaded = fp.load(path, map_location="cuda")
    # Read on the current stream at once: the load's copies are ordered before this.
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].is_cuda, key
            assert torch.equal(loaded[key], value.to("cuda")), key
    assert loaded["gpu_tied"] is loaded["gpu"]
    assert loaded["view"].untyped_storage().data_ptr() == loaded["big"].untyped_storage().data_ptr()
    again = fp.load(path)  # None: the saved devices (CPU tensors stay on the CPU)
    assert again["gpu"].is_cuda and not again["big"].is_cuda
    assert torch.equal(again["gpu"].sum(), state["gpu"].sum())


@cuda_test
def test_cuda_out_is_filled_in_place(workdir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(todevice, "DEVICE_WINDOW_BYTES", 1 << 20)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.BatchNorm1d(512)).cuda()
    path = os.path.join(workdir, "gpu-out")
    fp.save({"model": model.state_dict()}, path)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    for p in model.parameters():
        p.data.zero_()
    out = {"model": model.state_dict()}
    state = fp.load(path, out=out)
    for key, value in expected.items():
        assert state["model"][key] is out["model"][key]
        assert torch.equal(model.state_dict()[key], value), key


@cuda_test
def test_a_failed_cuda_out_load_leaves_the_model_as_it_was(workdir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(todevice, "DEVICE_WINDOW_BYTES", 1 << 20)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)).cuda()
    path = os.path.join(workdir, "gpu-out-damaged")
    fp.save({"model": model.state_dict()}, path)
    _damage_last_window(path)
    for p in model.parameters():
        p.data.fill_(3.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(fp.ChecksumMismatchError):
        fp.load(path, out={"model": model.state_dict()})
    torch.cuda.synchronize()
    for key, value in before.items():
        assert torch.equal(model.state_dict()[key], value), key


@cuda_test
def test_cuda_a_load_does_not_refill_the_ring_under_the_last_loads_copies(
    workdir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Load A's copies wait for the caller's stream (busy here), so they have not run when the
    # load returns; load B then takes the same ring and must wait for them before its read.
    monkeypatch.setattr(todevice, "DEVICE_WINDOW_BYTES", 1 << 20)
    a, b = torch.full((100_000,), 1.0, device="cuda"), torch.full((100_000,), 2.0, device="cuda")
    a_path, b_path = os.path.join(workdir, "a"), os.path.join(workdir, "b")
    fp.save({"w": a}, a_path)
    fp.save({"w": b}, b_path)
    for _ in range(3):
        torch.cuda._sleep(1 << 30)  # type: ignore[no-untyped-call]  # about a second of GPU time
        loaded_a = fp.load(a_path, map_location="cuda")
        loaded_b = fp.load(b_path, map_location="cuda")
        assert torch.equal(loaded_a["w"], a) and torch.equal(loaded_b["w"], b)
