"""A load sees exactly one checkpoint, even while a save replaces it (docs/format.md).

A save replaces a checkpoint by exchanging directories, and the old tree is deleted in the
background after the commit; a load opens the checkpoint directory once and reads everything
through that handle, so it returns one save's state whole (the old one, if its tree was not
deleted yet), or raises CheckpointNotFoundError: never a checksum mismatch caused by the other
save's files, never the step of one save with the tensors of the other.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import shutil
import sys
import time
from typing import Any

import pytest
import torch

import fastpersist as fp
from fastpersist.loading import examine, pipeline, reading
from fastpersist.saving import remover

from gloo import HELPERS_DIR
from replace_workers import TENSORS, replace_in_a_loop, stepped_state

SECONDS = 4.0


def _whole(state: dict[str, Any]) -> bool:
    """Whether every tensor of `state` is the one its step's save wrote."""
    step = state["step"]
    if step not in (1, 2) or int(state["step_t"]) != step:
        return False
    return all(torch.equal(state[f"w{i}"], stepped_state(step)[f"w{i}"]) for i in range(TENSORS))


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_loads_while_another_process_replaces_see_one_checkpoint(
    workdir: str, config: fp.Config, backend: str, verify: bool
) -> None:
    path = os.path.join(workdir, "ck")
    fp.save(stepped_state(1), path, config=config)
    if HELPERS_DIR not in sys.path:
        sys.path.insert(0, HELPERS_DIR)
    ctx = multiprocessing.get_context("spawn")
    saves = ctx.Queue()
    writer = ctx.Process(target=replace_in_a_loop, args=(path, backend, SECONDS, saves))
    writer.start()
    seen: collections.Counter[str] = collections.Counter()
    try:
        stop = time.monotonic() + SECONDS + 10  # the writer's start-up, then its SECONDS
        while writer.is_alive() and time.monotonic() < stop:
            try:
                state = fp.load(path, config=config, verify=verify)
                seen[f"step {state['step']}" if _whole(state) else "MIXED"] += 1
                if verify:  # fp.verify and fp.inspect read one checkpoint too
                    assert fp.verify(path)["files"] >= 1 and fp.inspect(path)["tensors"] == TENSORS + 1
            except fp.CheckpointNotFoundError as e:
                assert e.filename == path and "/proc/self/fd" not in str(e)
                seen["not found"] += 1
        saves_done = saves.get(timeout=30)
    finally:
        writer.join(30)
    assert writer.exitcode == 0
    assert seen["MIXED"] == 0, seen
    assert saves_done >= 10 and seen["step 1"] + seen["step 2"] >= 10, (saves_done, seen)
    assert seen["step 1"] and seen["step 2"], seen  # the loads did run across replacements


def _replace_before_reading(
    monkeypatch: pytest.MonkeyPatch, path: str, config: fp.Config, *, removed: bool = True
) -> list[int]:
    """Makes the next read of data replace the checkpoint at `path` first (a save, whose old
    tree is deleted in the background: waited for if `removed`); returns the replacements done."""
    done: list[int] = []
    read_ranges_into = reading._core.read_ranges_into

    def replace_then_read(*args: Any, **kwargs: Any) -> Any:
        if not done:
            fp.save(stepped_state(2), path, config=config)
            if removed:
                assert fp.wait_removed(timeout=60)
            done.append(1)
        return read_ranges_into(*args, **kwargs)

    monkeypatch.setattr(reading._core, "read_ranges_into", replace_then_read)
    return done


def test_a_checkpoint_replaced_under_a_load_is_not_found(
    workdir: str, config: fp.Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = os.path.join(workdir, "ck")
    fp.save(stepped_state(1), path, config=config)
    done = _replace_before_reading(monkeypatch, path, config)
    with pytest.raises(fp.CheckpointNotFoundError, match="deleted or replaced while it was being read") as info:
        fp.load(path, config=config)
    assert done and info.value.filename == path and "/proc/self/fd" not in str(info.value)
    assert _whole(fp.load(path, config=config)) and fp.load(path)["step"] == 2


def test_a_load_that_began_before_a_replace_returns_the_old_checkpoint_whole(
    workdir: str, config: fp.Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Until the background removal reaches it, the replaced tree is still readable through the
    load's directory handle: the load returns the checkpoint it opened, whole."""
    path = os.path.join(workdir, "ck")
    fp.save(stepped_state(1), path, config=config)
    queued: list[tuple[Any, ...]] = []
    remove_later = remover.remove_later
    monkeypatch.setattr(remover, "remove_later", lambda *a, **k: queued.append((a, k)))  # removal held back
    done = _replace_before_reading(monkeypatch, path, config, removed=False)
    state = fp.load(path, config=config)
    assert done and queued and state["step"] == 1 and _whole(state)
    assert fp.load(path, config=config)["step"] == 2  # a new load sees the new checkpoint
    (root, stripes), kwargs = queued[0]
    remove_later(root, stripes, **kwargs)
    assert fp.wait_removed(timeout=60) and not os.path.exists(root)


@pytest.mark.parametrize("operation", ["load", "verify"])
def test_a_checkpoint_deleted_under_a_read_is_not_found(
    workdir: str, config: fp.Config, monkeypatch: pytest.MonkeyPatch, operation: str
) -> None:
    path = os.path.join(workdir, "ck")
    fp.save(stepped_state(1), path, config=config)
    check_data_files = pipeline.check_data_files

    def check_then_delete(*args: Any) -> int:
        total = check_data_files(*args)
        shutil.rmtree(path)
        return total

    monkeypatch.setattr(pipeline, "check_data_files", check_then_delete)  # load's check
    monkeypatch.setattr(examine, "check_data_files", check_then_delete)  # verify's
    with pytest.raises(fp.CheckpointNotFoundError, match="deleted or replaced") as info:
        fp.load(path, config=config) if operation == "load" else fp.verify(path)
    assert info.value.filename == path and not os.path.exists(path)


def test_errors_name_the_checkpoint_path_not_the_handle(workdir: str, config: fp.Config) -> None:
    path = os.path.join(workdir, "ck")
    fp.save(stepped_state(1), path, config=config)
    data = fp.inspect(path)["files"][0]["path"]
    assert data.startswith(path + os.sep)
    with open(data, "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff")
    for operation in (lambda: fp.load(path, config=config), lambda: fp.verify(path)):
        with pytest.raises(fp.ChecksumMismatchError) as info:
            operation()
        assert info.value.filename == data and data in str(info.value) and "/proc/self" not in str(info.value)
    with pytest.raises(ValueError, match=f"checkpoint {path} does not"):
        fp.load(path, out={"nope": torch.zeros(1)})
