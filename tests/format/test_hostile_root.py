"""A root that defends itself: links, FIFOs and a step that is a link, seeded into a Checkpointer
root on disk and on a memory root (/dev/shm), never make fastpersist delete or overwrite anything
outside the root, and never make it wait forever (docs/failure-model.md, "What a root defends
against")."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import fastpersist as fp
from fastpersist.format.layout import HISTORY_NAME, INDEX_NAME, MANIFEST_NAME, RECYCLE_DIR, data_file_name
from fastpersist.integrations.dcp import FastPersistReader, FastPersistWriter
from fastpersist.memory_level.recycle import is_memory_root, take_recycled
from fastpersist.tools.cli import main as cli

SHM = "/dev/shm"
HAS_SHM = os.path.isdir(SHM) and is_memory_root(SHM)
DATA = data_file_name(writer=0, stripe=0)
BOUND_S = 20.0


@pytest.fixture(params=["disk", "memory"])
def place(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fresh directory on disk, or on the tmpfs at /dev/shm (the memory level, which recycles)."""
    if request.param == "memory":
        if not HAS_SHM:
            pytest.skip("needs a tmpfs at /dev/shm")
        parent = tempfile.mkdtemp(prefix="fp-test-hostile-", dir=SHM)
        yield parent
        shutil.rmtree(parent, ignore_errors=True)
    else:
        yield str(tmp_path_factory.mktemp("hostile"))


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((64 << 10,), float(step)), "step": step}


def _victim(place: str) -> str:
    """A directory outside the root with files and a sub-directory: what must survive."""
    victim = os.path.join(place, "victim")
    os.makedirs(os.path.join(victim, "sub"))
    for name in ("precious.txt", os.path.join("sub", "deeper.txt")):
        with open(os.path.join(victim, name), "w") as f:
            f.write("keep me")
    return victim


def _untouched(victim: str) -> None:
    assert sorted(os.listdir(victim)) == ["precious.txt", "sub"]
    with open(os.path.join(victim, "sub", "deeper.txt")) as f:
        assert f.read() == "keep me"


def _outside_checkpoint(place: str) -> str:
    outside = os.path.join(place, "best-model")
    fp.save(_state(99), outside)
    return outside


def _loads_intact(outside: str) -> None:
    assert sorted(os.listdir(outside)) == [DATA, MANIFEST_NAME]
    assert fp.load(outside)["step"] == 99 and fp.verify(outside) is not None


def test_a_recycle_dir_that_is_a_link_is_never_followed(place: str, caplog: pytest.LogCaptureFixture) -> None:
    """`.fprecycle` planted as a link: fp.clean, `fastpersist clean`, a Checkpointer's first save,
    retention (which recycles on a memory root) and its next saves leave the directory it names alone."""
    victim = _victim(place)
    root = os.path.join(place, "root")
    os.makedirs(root)
    os.symlink(victim, os.path.join(root, RECYCLE_DIR))
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        assert fp.clean(root) == []
        assert cli(["clean", root]) == 0
        with fp.Checkpointer(root, keep=1) as ck:
            for step in range(4):
                ck.save(step, _state(step))
            ck.wait()
            assert ck.steps() == [3] and ck.load()["step"] == 3
    _untouched(victim)
    assert os.path.islink(os.path.join(root, RECYCLE_DIR))  # not ours to delete either
    assert "is not a plain directory (a link?)" in caplog.text


def test_links_inside_the_recycle_dir_are_unlinked_never_followed(place: str) -> None:
    """A recycle entry that is a link, and an entry whose data file or shard is a link: a save
    takes nothing through them, and clean removes the links only."""
    victim = _victim(place)
    outside = _outside_checkpoint(place)
    root = os.path.join(place, "root")
    bin_dir = os.path.join(root, RECYCLE_DIR)
    os.makedirs(os.path.join(bin_dir, "step-00000000.aaaaaaaaaaaa"))
    os.symlink(outside, os.path.join(bin_dir, "step-00000001.bbbbbbbbbbbb"))
    os.symlink(os.path.join(outside, DATA), os.path.join(bin_dir, "step-00000000.aaaaaaaaaaaa", DATA))
    os.makedirs(os.path.join(bin_dir, "step-00000002.cccccccccccc"))
    os.symlink(victim, os.path.join(bin_dir, "step-00000002.cccccccccccc", "shard-00000"))
    with fp.Checkpointer(root, keep=2) as ck:
        for step in range(3):
            ck.save(step, _state(step))
        ck.wait()
        assert ck.load()["step"] == 2
    fp.clean(root)
    assert not os.path.exists(bin_dir) or os.listdir(bin_dir) == [] or is_memory_root(root)
    _loads_intact(outside)
    _untouched(victim)


@pytest.mark.parametrize("keep", [1, 2])
def test_a_step_that_is_a_link_is_retired_as_a_link(place: str, keep: int) -> None:
    """A step directory that is a link to a checkpoint outside the root: retention removes the
    link, never the checkpoint it names (recycled on a memory root, deleted on disk)."""
    outside = _outside_checkpoint(place)
    root = os.path.join(place, "root")
    os.makedirs(root)
    os.symlink(outside, os.path.join(root, "step-00000000"))
    with fp.Checkpointer(root, keep=keep) as ck:
        for step in range(1, 5):
            ck.save(step, _state(step))
        ck.wait()
        assert ck.load()["step"] == 4
    fp.clean(root)
    assert not os.path.lexists(os.path.join(root, "step-00000000"))
    _loads_intact(outside)


def _bounded(call: Callable[[], object], fifo: str) -> object:
    """Runs `call` in a thread and fails the test if it has not returned within BOUND_S; a call
    blocked opening `fifo` is released by opening it for writing, so no thread is left behind."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as e:
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    if thread.is_alive():
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5)
        pytest.fail(f"still blocked after {BOUND_S} s with a FIFO at {fifo}")
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out.get("value")


@pytest.mark.parametrize("name", [INDEX_NAME, HISTORY_NAME])
def test_a_fifo_in_place_of_the_index_or_history_never_blocks(
    place: str, name: str, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    root = os.path.join(place, "root")
    with fp.Checkpointer(root, keep=2) as ck:
        ck.save(0, _state(0))
    fifo = os.path.join(root, name)
    os.remove(fifo)
    os.mkfifo(fifo)
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        ck = fp.Checkpointer(root, keep=2)
        assert _bounded(ck.latest, fifo) == 0
        assert _bounded(lambda: ck.load()["step"], fifo) == 0
        _bounded(lambda: ck.save(1, _state(1)), fifo)
        _bounded(ck.close, fifo)
        assert _bounded(lambda: cli(["inspect", root]), fifo) == 0
    assert "not a regular file (a FIFO, device or socket?)" in caplog.text
    assert fp.Checkpointer(root).load()["step"] == 1  # the save replaced the FIFO with a real file


def test_a_fifo_as_a_dcp_metadata_file_is_refused_at_once(place: str) -> None:
    path = os.path.join(place, "dcp")
    dcp.save({"w": torch.ones(4)}, storage_writer=FastPersistWriter(path), no_dist=True)
    fifo = os.path.join(path, ".metadata")
    os.remove(fifo)
    os.mkfifo(fifo)
    target = {"w": torch.zeros(4)}
    with pytest.raises(CheckpointException, match="not a regular file"):
        _bounded(lambda: dcp.load(target, storage_reader=FastPersistReader(path), no_dist=True), fifo)


def test_a_fifo_as_the_tuning_cache_is_ignored_with_a_warning(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fifo = os.path.join(str(tmp_path), "tune.json")
    os.mkfifo(fifo)
    monkeypatch.setenv("FASTPERSIST_TUNE_CACHE", fifo)
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        _bounded(lambda: fp.save(_state(0), os.path.join(str(tmp_path), "ck")), fifo)
    assert fp.load(os.path.join(str(tmp_path), "ck"))["step"] == 0


def test_a_recycled_file_is_never_taken_through_a_linked_directory(place: str) -> None:
    """take_recycled walks each directory of an entry without following links: a shard
    directory that is a link to outside data gives nothing, and the outside file stays."""
    outside = os.path.join(place, "outside-shard")
    os.makedirs(outside)
    with open(os.path.join(outside, DATA), "wb") as f:
        f.write(b"outside bytes")
    root = os.path.join(place, "root")
    entry = os.path.join(root, RECYCLE_DIR, "step-00000001.0123456789ab")
    os.makedirs(entry)
    os.symlink(outside, os.path.join(entry, "shard-00000"))
    tmp_dir = os.path.join(root, ".step-00000002.fptmp-0123456789ab")
    os.makedirs(os.path.join(tmp_dir, "shard-00000"))
    dest = os.path.join(tmp_dir, "shard-00000", DATA)
    assert take_recycled(root, tmp_dir, [dest]) == 0
    assert not os.path.exists(dest) and os.listdir(outside) == [DATA]
    os.remove(os.path.join(entry, "shard-00000"))
    os.makedirs(os.path.join(entry, "shard-00000"))
    os.rename(os.path.join(outside, DATA), os.path.join(entry, "shard-00000", DATA))
    assert take_recycled(root, tmp_dir, [dest]) == 1  # the same file, really inside: taken
    with open(dest, "rb") as f:
        assert f.read() == b"outside bytes"
