"""Checkpointer.latest() / load() in a process that restores from a root another process saves
to with keep=1: a step retired under the restore is not damage, and a newer step is loaded.

Each test runs the trainer's next save (which retires the step the reader just chose) at one
moment of the reader's restore, through the seam that moment passes: after the index is read,
after the steps are listed, before the chosen step is opened.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import fastpersist as fp
import fastpersist.levels.local_level as local_level


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((1000,), float(step)), "step": step}


class Trainer:
    """Another Checkpointer on the same root (keep=1): each commit retires the step before it."""

    def __init__(self, root: str) -> None:
        self.ck = fp.Checkpointer(root, keep=1)
        self.step = 0
        self.save_next()

    def save_next(self) -> None:
        self.step += 1
        self.ck.save(self.step, _state(self.step))
        self.ck.wait()  # committed, and the step before it renamed out of sight


def _once(action: Callable[[], None], inner: Callable[..., Any]) -> Callable[..., Any]:
    """`inner`, running `action` first at its first call only."""
    done = threading.Event()

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not done.is_set():
            done.set()
            action()
        return inner(*args, **kwargs)

    return wrapped


def _no_false_damage(caplog: pytest.LogCaptureFixture) -> None:
    assert not [r for r in caplog.records if "fails verification" in r.getMessage()]


def test_a_step_retired_between_listing_and_verifying_is_not_damage(
    workdir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = Trainer(workdir)
    reader = fp.Checkpointer(workdir, keep=1)
    monkeypatch.setattr(reader.local, "fingerprint", _once(trainer.save_next, reader.local.fingerprint))
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        state = reader.load()
    assert state["step"] == 2 and torch.equal(state["w"], _state(2)["w"])
    _no_false_damage(caplog)


def test_a_step_retired_before_the_listing_but_after_the_index_was_read(
    workdir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The index named step 1; by the listing only step 2 (above that index) is left."""
    trainer = Trainer(workdir)
    reader = fp.Checkpointer(workdir, keep=1)
    index_step = reader.local.index_step

    def then_save() -> int | None:
        step = index_step()
        if trainer.step == 1:
            trainer.save_next()
        return step

    monkeypatch.setattr(reader.local, "index_step", then_save)
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        assert reader.latest() == 2
    _no_false_damage(caplog)


def test_a_step_retired_before_it_is_opened_loads_the_newer_one(
    workdir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = Trainer(workdir)
    reader = fp.Checkpointer(workdir, keep=1)
    assert reader.latest() == 1
    monkeypatch.setattr(local_level, "load_checkpoint", _once(trainer.save_next, local_level.load_checkpoint))
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        assert reader.load()["step"] == 2
    _no_false_damage(caplog)


def test_a_step_retired_again_and_again_is_a_clear_error_not_no_checkpoint(
    workdir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = Trainer(workdir)
    reader = fp.Checkpointer(workdir, keep=1)
    fingerprint = reader.local.fingerprint

    def retired_every_time(path: str) -> Any:
        trainer.save_next()
        return fingerprint(path)

    monkeypatch.setattr(reader.local, "fingerprint", retired_every_time)
    with caplog.at_level(logging.WARNING, logger="fastpersist"), pytest.raises(fp.CheckpointNotFoundError) as info:
        reader.load()
    assert "retired while they were being checked" in str(info.value) and "try again" in str(info.value)
    _no_false_damage(caplog)


def test_an_explicit_step_that_was_retired_raises_naming_it(workdir: str) -> None:
    trainer = Trainer(workdir)
    trainer.save_next()
    with pytest.raises(fp.CheckpointNotFoundError) as info:
        fp.Checkpointer(workdir, keep=1).load(1)
    assert info.value.filename == trainer.ck.path(1)


def test_a_present_damaged_step_is_still_reported(workdir: str, caplog: pytest.LogCaptureFixture) -> None:
    ck = fp.Checkpointer(workdir, keep=2)
    for step in (1, 2):
        ck.save(step, _state(step))
    ck.wait()
    with open(fp.inspect(ck.path(2))["files"][0]["path"], "r+b") as f:
        f.write(b"\xff" * 8)
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        assert fp.Checkpointer(workdir).load()["step"] == 1
    assert [r for r in caplog.records if "fails verification" in r.getMessage() and ck.path(2) in r.getMessage()]


def test_a_reader_polling_a_live_root_always_gets_a_whole_committed_step(workdir: str) -> None:
    """The reproducer's shape, bounded: a thread saves with keep=1 while another loads."""
    trainer = Trainer(workdir)
    stop = threading.Event()

    def train() -> None:
        while not stop.is_set() and trainer.step < 2000:
            trainer.save_next()

    saver = threading.Thread(target=train)
    saver.start()
    try:
        for _ in range(300):
            state = fp.Checkpointer(workdir, keep=1).load()
            assert torch.equal(state["w"], _state(state["step"])["w"])
    finally:
        stop.set()
        saver.join()
