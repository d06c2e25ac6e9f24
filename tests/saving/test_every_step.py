"""Checkpointer(every=1) on a GPU state while the disk is slower than a step (saving/in_flight.py):
a step due while the previous save still writes is staged at once and written once the disk is
free; a newer step takes the place of one still waiting, which is never written."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch

import fastpersist as fp
from fastpersist import checkpointer as checkpointer_module
from fastpersist.gpu.arenas import ARENAS
from fastpersist.gpu.copiers import use_copier

from fake_cuda import InstantCopier


@pytest.fixture
def held_commit(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Holds step 0's commit (its after-commit work) until the event is set: the disk is busy."""
    release = threading.Event()
    original = checkpointer_module.Checkpointer._after_commit

    def after_commit(self: fp.Checkpointer, step: int, result: fp.SaveResult) -> None:
        if step == 0:
            release.wait(30)
        original(self, step, result)

    monkeypatch.setattr(checkpointer_module.Checkpointer, "_after_commit", after_commit)
    yield release
    release.set()


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((200_000,), float(step)), "b": torch.arange(100.0) + step, "step": step}


def test_steps_due_while_the_disk_is_busy_are_snapshots_and_the_newest_is_written(
    workdir: str, backend: str, held_commit: threading.Event
) -> None:
    with use_copier(lambda t: t.numel() == 200_000, InstantCopier):  # the weights on a (fake) GPU
        _every_step(workdir, backend, held_commit)


def test_a_host_state_still_commits_every_step(workdir: str) -> None:
    # A host state's snapshot would cost as much as the write it saves (a memory copy against
    # a page-cache copy or an O_DIRECT write): every due step waits for the one before.
    ck = fp.Checkpointer(os.path.join(workdir, "ck"), every=1, keep=10, config=fp.Config(chunk_bytes=64 << 10))
    for step in range(4):
        ck.wait_staged()
        ck.save(step, _state(step))
    ck.close()
    assert ck.steps() == [0, 1, 2, 3]


def _every_step(workdir: str, backend: str, held_commit: threading.Event) -> None:
    root = os.path.join(workdir, "ck")
    ck = fp.Checkpointer(root, every=1, keep=3, config=fp.Config(backend=backend, chunk_bytes=64 << 10))
    state = _state(0)
    first = ck.save(0, state)
    assert first is not None
    futures = [first]
    for step in range(1, 4):
        ck.wait_staged()  # as before optimizer.step(): the newest snapshot has landed
        state = _state(step)
        fut = ck.save(step, state)  # returns without waiting for step 0's write
        assert fut is not None and not first.done()
        futures.append(fut)
    ck.wait_staged()
    for replaced in futures[1:3]:  # replaced before the disk was free: never written
        with pytest.raises(fp.SaveCancelledError):
            replaced.wait(30)
        assert replaced.cancelled()
    assert not first.done() and not futures[3].done()
    held_commit.set()
    result = ck.wait()
    assert result is not None and result.path == ck.path(3)
    ck.close()
    assert ck.steps() == [0, 3]
    assert ck.latest() == 3
    loaded = ck.load(3)
    assert torch.equal(loaded["w"], _state(3)["w"]) and loaded["step"] == 3  # type: ignore[index]
    assert not any(k.arena.leased for k in ARENAS._kept)


def test_close_waits_for_replaced_snapshots_to_remove_their_files(workdir: str) -> None:
    # Replaced snapshots clean up on their own threads; close() returns only once they have.
    root = os.path.join(workdir, "ck")
    with use_copier(lambda t: t.numel() == 200_000, InstantCopier):
        ck = fp.Checkpointer(root, every=1, keep=2, config=fp.Config(chunk_bytes=64 << 10))
        for step in range(60):
            ck.wait_staged()
            ck.save(step, _state(step))
        ck.close()
    assert ck.steps()[-1] == 59
    assert [n for n in os.listdir(root) if ".fptmp-" in n] == []
