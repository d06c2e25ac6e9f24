"""Spares (memory_level/spares.py): a memory root's next save finds its files made while the
training step ran, whole or not at all, and a save that starts stops the making."""

from __future__ import annotations

import glob
import os
import threading
import time

import pytest
import torch

import fastpersist as fp
from fastpersist.format.layout import RECYCLE_DIR, data_file_name
from fastpersist.memory_level import spares
from fastpersist.memory_level.recycle import is_memory_root, take_recycled
from fastpersist.memory_level.spares import make_spare, stop_spares, wait_spare

SHM = "/dev/shm"
pytestmark = pytest.mark.skipif(not (os.path.isdir(SHM) and is_memory_root(SHM)), reason="needs a tmpfs at /dev/shm")
DATA = data_file_name(writer=0, stripe=0)


def state_of(step: int, mib: int = 2) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn((mib << 20) // 4, generator=g), "step": step}


def entries(root: str) -> list[str]:
    where = os.path.join(root, RECYCLE_DIR)
    return sorted(os.listdir(where)) if os.path.isdir(where) else []


def test_the_first_saves_take_spares_made_after_each_commit_and_load_whole(shm_root: str) -> None:
    with fp.Checkpointer(shm_root, keep=2) as ck:
        inodes, spare_inodes = [], []
        for step in range(5):
            ck.save(step, state_of(step)).result()
            inodes.append(os.stat(os.path.join(ck.path(step), DATA)).st_ino)
            wait_spare()
            if step < 2:  # nothing retired yet: a spare of this step waits for the next save
                st = os.stat(os.path.join(shm_root, RECYCLE_DIR, f"spare-step-{step:08d}", DATA))
                assert st.st_size == os.stat(os.path.join(ck.path(step), DATA)).st_size
                assert st.st_blocks * 512 >= st.st_size  # every page allocated
                spare_inodes.append(st.st_ino)
            else:  # a retired step's files serve instead: no spare is made
                assert not [e for e in entries(shm_root) if e.startswith((".", "spare-"))]
        assert inodes[1:3] == spare_inodes  # the next two saves took them
        assert inodes[3] == inodes[0] and inodes[4] == inodes[1]  # then the rotation, as before
        for step in ck.steps():
            fp.verify(ck.path(step))
            got = ck.load(step)
            assert torch.equal(got["w"], state_of(step)["w"]) and got["step"] == step


def test_a_save_that_starts_stops_the_making_and_takes_the_files_allocated_whole(
    shm_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fp.save(state_of(0, mib=32), os.path.join(shm_root, "step"))
    monkeypatch.setattr(spares, "SLICE_BYTES", 1 << 20)
    monkeypatch.setattr(spares, "PROMPT_S", 30.0)  # in time however busy the machine (nice 19)
    real = spares._core.MemoryFileAhead
    allocated, go_on = threading.Event(), threading.Event()

    class PausedOnceAllocated:
        def __init__(self, *a: object) -> None:
            self.inner = real(*a)

        @property
        def allocated_bytes(self) -> int:
            return int(self.inner.allocated_bytes)

        def advance(self, n: int) -> bool:
            if self.inner.allocated_bytes == (32 << 20):  # every page allocated: mapping next
                allocated.set()
                go_on.wait()
            return bool(self.inner.advance(n))

    monkeypatch.setattr(spares._core, "MemoryFileAhead", PausedOnceAllocated)
    assert make_spare(shm_root, os.path.join(shm_root, "step")) is not None
    assert make_spare(shm_root, os.path.join(shm_root, "step")) is None  # one at a time
    assert allocated.wait(30)
    threading.Timer(0.05, go_on.set).start()
    stop_spares()  # as a save does when it starts: waits for the slice, and the handover
    assert entries(shm_root) == ["spare-step"]
    spare = os.stat(os.path.join(shm_root, RECYCLE_DIR, "spare-step", DATA))
    assert spare.st_size == os.stat(os.path.join(shm_root, "step", DATA)).st_size
    assert spare.st_blocks * 512 >= spare.st_size
    state = state_of(1, mib=32)
    fp.save(state, os.path.join(shm_root, "next"))  # takes it, overwrites it in place
    assert os.stat(os.path.join(shm_root, "next", DATA)).st_ino == spare.st_ino
    assert torch.equal(fp.load(os.path.join(shm_root, "next"))["w"], state["w"])


def test_a_spare_too_late_for_the_save_that_stopped_it_is_deleted(
    shm_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fp.save(state_of(0, mib=32), os.path.join(shm_root, "step"))
    monkeypatch.setattr(spares, "SLICE_BYTES", 4096)
    monkeypatch.setattr(spares, "PROMPT_S", 0.0)  # the save does not wait at all
    slow = spares._core.MemoryFileAhead.advance
    gate = threading.Event()

    class Slow:
        def __init__(self, *a: object) -> None:
            self.inner = spares._core.MemoryFileAhead(*a)

        def advance(self, n: int) -> bool:
            gate.wait()
            return bool(slow(self.inner, n))

    monkeypatch.setattr(spares._core, "MemoryFileAhead", Slow)
    make_spare(shm_root, os.path.join(shm_root, "step"))
    stop_spares()
    gate.set()
    wait_spare()
    assert entries(shm_root) == []  # deleted: the save that stopped it may have looked already


def test_a_file_stopped_before_its_pages_were_allocated_is_not_handed_over(
    shm_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fp.save(state_of(0, mib=32), os.path.join(shm_root, "step"))
    monkeypatch.setattr(spares, "SLICE_BYTES", 4096)
    monkeypatch.setattr(spares, "PROMPT_S", 30.0)
    make_spare(shm_root, os.path.join(shm_root, "step"))
    begun = time.monotonic()
    while not glob.glob(os.path.join(shm_root, RECYCLE_DIR, ".making-*", DATA)):
        assert time.monotonic() - begun < 30
        time.sleep(0.001)
    stop_spares()
    wait_spare()
    assert entries(shm_root) == []  # the save writes a new file faster than it completes this one


def test_a_spare_being_made_is_never_taken(shm_root: str) -> None:
    making = os.path.join(shm_root, RECYCLE_DIR, ".making-1-0")
    os.makedirs(making)
    with open(os.path.join(making, DATA), "wb") as f:
        f.write(b"x" * 4096)
    tmp = os.path.join(shm_root, ".step.tmp")
    os.makedirs(tmp)
    assert take_recycled(shm_root, tmp, [os.path.join(tmp, DATA)]) == 0
    assert os.path.exists(os.path.join(making, DATA))


def test_no_spare_on_a_disk_root_or_through_a_planted_link(shm_root: str, tmp_path: str) -> None:
    disk = os.path.join(tmp_path, "disk")
    fp.save(state_of(0), os.path.join(disk, "step"))
    assert make_spare(disk, os.path.join(disk, "step")) is None
    fp.save(state_of(0), os.path.join(shm_root, "step"))
    victim = os.path.join(tmp_path, "victim")
    os.mkdir(victim)
    os.symlink(victim, os.path.join(shm_root, RECYCLE_DIR))
    thread = make_spare(shm_root, os.path.join(shm_root, "step"))
    assert thread is not None
    thread.join()
    assert os.listdir(victim) == [] and os.path.islink(os.path.join(shm_root, RECYCLE_DIR))
