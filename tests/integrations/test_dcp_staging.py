"""``dcp.async_save`` through ``FastPersistWriter.stage``: the state copied into one of the
process's staging arenas (device tensors through their copiers, queued at once and waited for
once), written from there, and the arena handed back once written; DCP's own stager takes what
the arena path does not (tensor subclasses, a state beyond ``Config.pinned_bytes``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import SavePlan

import fastpersist as fp
from fastpersist.gpu.arenas import ARENAS
from fastpersist.gpu.copiers import DeviceCopier, use_copier
from fastpersist.gpu.snapshots import snapshot_tensors
from fastpersist.integrations.dcp import FastPersistReader, FastPersistWriter
from fastpersist.integrations.dcp_staging import stage_state_dict


def _leased() -> int:
    return sum(kept.arena.leased for kept in ARENAS._kept)


class QueuedCopier:
    """A device copier whose copies land on a thread of their own, after `copy` returned."""

    needs_pinned_memory: ClassVar[bool] = False
    calls: ClassVar[list[int]] = []
    fail: ClassVar[bool] = False

    def __init__(self, device: torch.device) -> None:
        self.threads: list[threading.Thread] = []

    def begin(self) -> None:
        pass

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, early: bool = False) -> None:
        if QueuedCopier.fail:
            raise RuntimeError("the fake device fell off the bus")
        QueuedCopier.calls.append(len(pairs))
        thread = threading.Thread(target=lambda: [dst.copy_(src) for src, dst in pairs])
        thread.start()
        self.threads.append(thread)

    def wait(self) -> None:
        for thread in self.threads:
            thread.join()
        self.threads = []


@pytest.fixture
def on_device() -> Iterator[set[int]]:
    """Tensors whose storage is in the set are staged by QueuedCopier, as GPU tensors would be."""
    QueuedCopier.calls, QueuedCopier.fail = [], False
    chosen: set[int] = set()

    def factory(device: torch.device) -> DeviceCopier:
        return QueuedCopier(device)

    with use_copier(lambda t: t.untyped_storage().data_ptr() in chosen, factory):
        yield chosen


def _state() -> dict[str, Any]:
    return {
        "model": {"w": torch.randn(64, 32), "b": torch.randn(32).to(torch.bfloat16), "n": torch.tensor(7)},
        "opt": {"state": {0: {"exp_avg": torch.randn(64, 32)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "t": (torch.arange(5), "tag"),
        "empty": torch.zeros(0, 3),
    }


def test_async_save_stages_into_an_arena_and_hands_it_back_once_written(tmp_path: Any, on_device: set[int]) -> None:
    base = _leased()  # arenas other tests' saves may still hold
    state = _state()
    on_device.add(state["model"]["w"].untyped_storage().data_ptr())
    on_device.add(state["opt"]["state"][0]["exp_avg"].untyped_storage().data_ptr())
    expected = {"w": state["model"]["w"].clone(), "exp_avg": state["opt"]["state"][0]["exp_avg"].clone()}
    writer = FastPersistWriter(tmp_path / "c")
    fut = dcp.async_save(state, storage_writer=writer)
    state["model"]["w"].add_(1)  # after staging: the checkpoint holds the values at the call
    state["opt"]["state"][0]["exp_avg"].zero_()
    fut.result()
    assert QueuedCopier.calls == [2]  # both device tensors in one call
    assert _leased() == base + 0 and writer._staged == []
    target = _state()
    dcp.load(target, storage_reader=FastPersistReader(tmp_path / "c"))
    assert torch.equal(target["model"]["w"], expected["w"])
    assert torch.equal(target["opt"]["state"][0]["exp_avg"], expected["exp_avg"])
    assert torch.equal(target["model"]["b"], state["model"]["b"]) and int(target["model"]["n"]) == 7


def test_cached_staging_keeps_its_arena_and_copies_into_it_again(tmp_path: Any) -> None:
    base = _leased()  # arenas other tests' saves may still hold
    writer = FastPersistWriter(tmp_path / "c", cache_staged_state_dict=True)
    state = {"w": torch.randn(16, 16), "step": 1}
    dcp.async_save(state, storage_writer=writer).result()
    cached, snapshot = writer.state_dict_cache, writer._cached_snapshot
    assert snapshot is not None and snapshot.holds(cached["w"]) and _leased() == base + 1  # kept between saves
    state["w"].add_(1)
    state["step"] = 2
    dcp.async_save(state, storage_writer=writer).result()
    assert writer._cached_snapshot is snapshot and writer.state_dict_cache is cached
    target = {"w": torch.zeros(16, 16), "step": 0}
    dcp.load(target, storage_reader=FastPersistReader(tmp_path / "c"))
    assert torch.equal(target["w"], state["w"]) and target["step"] == 2
    state["w"] = torch.randn(8)  # another shape: a new copy, the old arena handed back
    dcp.async_save(state, storage_writer=writer).result()
    assert writer._cached_snapshot is not snapshot and snapshot.released and _leased() == base + 1


class Sub(torch.Tensor):
    pass


def test_what_the_arena_path_does_not_take_is_left_to_dcps_stager(tmp_path: Any) -> None:
    base = _leased()  # arenas other tests' saves may still hold
    assert stage_state_dict({"s": torch.randn(3).as_subclass(Sub)}, pinned_bytes="auto", what="x") is None
    assert stage_state_dict({"q": torch.randn(3).to_sparse()}, pinned_bytes="auto", what="x") is None
    assert stage_state_dict({"w": torch.randn(1 << 20)}, pinned_bytes=1 << 20, what="x") is None  # beyond the bound
    assert _leased() == base + 0
    state = {"w": torch.randn(1 << 20)}
    writer = FastPersistWriter(tmp_path / "c", fp.Config(chunk_bytes=1 << 20, pinned_bytes=2 << 20))
    dcp.async_save(state, storage_writer=writer).result()  # DCP's own copy: still saved whole
    target = {"w": torch.zeros(1 << 20)}
    dcp.load(target, storage_reader=FastPersistReader(tmp_path / "c"))
    assert torch.equal(target["w"], state["w"])


def test_a_non_contiguous_device_tensor_is_not_staged_here(on_device: set[int]) -> None:
    w = torch.randn(8, 4)
    on_device.add(w.untyped_storage().data_ptr())
    assert stage_state_dict({"w": w.t()}, pinned_bytes="auto", what="x") is None  # a device-side copy first
    host = torch.randn(8, 4).t()  # a non-contiguous host tensor is copied by the CPU: staged here
    staged = stage_state_dict({"w": w, "h": host}, pinned_bytes="auto", what="x")
    assert staged is not None and torch.equal(staged[1]["h"], host) and torch.equal(staged[1]["w"], w)
    staged[0].release()


def test_the_copies_are_the_tensors_and_shared_objects_stay_shared() -> None:
    base = _leased()  # arenas other tests' saves may still hold
    w = torch.randn(3, 5)
    state = {"a": w, "b": [w, torch.tensor(2.5)], "c": (1, None, "x")}
    staged = stage_state_dict(state, pinned_bytes="auto", what="x")
    assert staged is not None
    snapshot, copy = staged
    assert copy["a"] is copy["b"][0] and torch.equal(copy["a"], w) and copy["a"].data_ptr() != w.data_ptr()
    assert copy["c"] == (1, None, "x") and float(copy["b"][1]) == 2.5
    assert snapshot.holds(copy["a"]) and _leased() == base + 1
    snapshot.release()
    del snapshot
    assert _leased() == base + 0


def test_a_failing_device_copy_raises_and_hands_the_arena_back(on_device: set[int]) -> None:
    base = _leased()  # arenas other tests' saves may still hold
    w = torch.randn(1000)
    on_device.add(w.untyped_storage().data_ptr())
    QueuedCopier.fail = True
    with pytest.raises(RuntimeError, match="fell off the bus"):
        snapshot_tensors([w], pinned_bytes="auto", what="x")
    assert _leased() == base + 0


def test_a_rank_with_nothing_to_write_hands_back_its_copy(tmp_path: Any) -> None:
    base = _leased()  # arenas other tests' saves may still hold
    writer = FastPersistWriter(tmp_path / "c")
    staged = writer.stage({"w": torch.randn(4)})
    assert _leased() == base + 1 and len(writer._staged) == 1

    writer.write_data(SavePlan([], storage_data="__0_0.distcp"), None).wait()  # type: ignore[arg-type]
    assert writer._staged == [] and _leased() == base + 0
    del staged


def test_while_saves_hold_every_arena_the_bound_allows_dcps_stager_takes_it(tmp_path: Any) -> None:
    ARENAS.clear()  # other tests' free arenas would serve it
    cap = 4 << 20
    held, _ = ARENAS.lease(cap, cap_bytes=cap, min_bytes=cap, pin=False)  # a save still writing
    state = {"w": torch.randn(1 << 18)}
    assert stage_state_dict(state, pinned_bytes=cap, what="x") is None  # at once, not after that save
    writer = FastPersistWriter(tmp_path / "c", fp.Config(chunk_bytes=1 << 20, pinned_bytes=cap))
    dcp.async_save(state, storage_writer=writer).result()
    target = {"w": torch.zeros(1 << 18)}
    dcp.load(target, storage_reader=FastPersistReader(tmp_path / "c"))
    assert torch.equal(target["w"], state["w"])
    del held
    staged = stage_state_dict(state, pinned_bytes=cap, what="x")  # the arena is free again
    assert staged is not None
    staged[0].release()
