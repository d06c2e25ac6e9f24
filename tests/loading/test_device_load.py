"""Loads to a device (fastpersist.loading.todevice), driven on CPU through the loader seam
(fastpersist.device.use_loader), and on a real GPU where there is one.

The fake loader treats every target whose type is "cuda" as a device but allocates its
destinations on the CPU. Its copies run only when they are waited for (as an asynchronous copy
completes later), so a ring buffer refilled too early would show up as wrong values; it also
checks the contract directly: copies only from registered ring buffers whose previous window
was waited for, every destination byte written once, and window k+1 read before window k's
copies were waited for.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

import fastpersist as fp
from fastpersist.device import DeviceLoader, use_loader
from fastpersist.format.manifest import seal, unseal
from fastpersist.loading import pipeline, todevice
from fastpersist.loading.reading import direct_padded

CHUNK = 64 << 10
WINDOW = 2 * CHUNK


class FakeLoader:
    """A DeviceLoader over CPU memory whose copies complete when waited for."""

    log: ClassVar[list[tuple[str, object]]] = []
    reads: ClassVar[list[int]] = []
    registered: ClassVar[dict[int, int]] = {}
    allocated: ClassVar[dict[int, int]] = {}
    written: ClassVar[dict[int, list[tuple[int, int]]]] = {}
    fail_at_copy: int | None = None
    copies = 0

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pending: dict[int, list[tuple[torch.Tensor, torch.Tensor, int]]] = {0: [], 1: []}
        self.marked = {0: False, 1: False}
        self.begun = False
        FakeLoader.log.append(("new", str(device)))

    def begin(self) -> None:
        self.begun = True

    def register(self, host: torch.Tensor) -> None:
        FakeLoader.registered[host.data_ptr()] = host.numel()

    def empty(self, nbytes: int) -> torch.Tensor:
        assert self.begun, "destinations are allocated after begin()"
        dst = torch.empty(nbytes, dtype=torch.uint8)
        FakeLoader.allocated[dst.untyped_storage().data_ptr()] = nbytes
        return dst

    def copy_to_device(self, host: torch.Tensor, dst: torch.Tensor, slot: int) -> None:
        FakeLoader.copies += 1
        if FakeLoader.fail_at_copy is not None and FakeLoader.copies >= FakeLoader.fail_at_copy:
            raise RuntimeError("the fake device fell off the bus")
        base = host.untyped_storage().data_ptr()
        assert FakeLoader.registered.get(base) == host.untyped_storage().nbytes(), "not from a ring buffer"
        assert not self.marked[slot], f"ring buffer {slot} refilled before its copies were waited for"
        assert host.numel() == dst.numel() and dst.dtype == torch.uint8
        storage = dst.untyped_storage().data_ptr()
        assert storage in FakeLoader.allocated
        FakeLoader.written.setdefault(storage, []).append((dst.storage_offset(), dst.numel()))
        self.pending[slot].append((host, dst, len(FakeLoader.reads) - 1))

    def mark(self, slot: int) -> None:
        self.marked[slot] = True

    def _run(self, slot: int) -> None:
        for host, dst, _ in self.pending[slot]:
            dst.copy_(host)
        self.pending[slot] = []
        self.marked[slot] = False

    def wait(self, slot: int) -> None:
        for _, _, window in self.pending[slot]:
            assert len(FakeLoader.reads) >= window + 2, "window k+1 must be read before window k is waited for"
        FakeLoader.log.append(("wait", slot))
        self._run(slot)

    def finish(self) -> None:
        for slot in self.pending:
            assert not self.pending[slot] or self.marked[slot]
            self._run(slot)
        FakeLoader.log.append(("finish", str(self.device)))


def _install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resets FakeLoader, reads in windows of two chunks and records each window's read."""
    FakeLoader.log, FakeLoader.reads, FakeLoader.registered = [], [], {}
    FakeLoader.allocated, FakeLoader.written, FakeLoader.fail_at_copy, FakeLoader.copies = {}, {}, None, 0
    monkeypatch.setattr(todevice, "DEVICE_WINDOW_BYTES", WINDOW)
    read_window = todevice.read_window

    def spy(root: str, m: Any, lo: int, hi: int, dest: Any, verify: bool, config: fp.Config, stats: Any) -> None:
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


@pytest.fixture
def fake_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeLoader]]:
    """CPU tensors of out= are filled through FakeLoader, as CUDA tensors would be."""
    _install(monkeypatch)
    with use_loader(lambda d: d.type == "cpu", _factory):
        yield FakeLoader


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
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
        elif isinstance(value, np.ndarray):
            assert np.array_equal(loaded[key], value), key
        else:
            assert type(loaded[key]) is type(value) and loaded[key] == value, key


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
    assert FakeLoader.log[-1] == ("finish", "cuda:0")


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
    # Each wait comes after the read of the next window (FakeLoader.wait asserts it per copy),
    # so window k+1 was being read while window k's copies were in flight.
    waits = [i for i, e in enumerate(FakeLoader.log) if e[0] == "wait"]
    assert len(waits) >= len(FakeLoader.reads) - 2


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
    assert FakeLoader.log[-1][0] == "finish"  # copies in flight were let finish


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
    assert FakeLoader.log[-1][0] == "finish"


def test_a_failing_copy_names_the_checkpoint_and_returns_nothing(
    workdir: str, backend: str, fake_cuda: type[FakeLoader]
) -> None:
    path = _saved(workdir, backend)
    FakeLoader.fail_at_copy = 4
    with pytest.raises(fp.FastPersistError, match="fell off the bus") as info:
        fp.load(path)
    assert path in str(info.value) and "cuda:0" in str(info.value)
    assert FakeLoader.log[-1][0] == "finish"
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
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
