"""The target of a save: concurrent first saves of one path, and names too long for the directory."""

from __future__ import annotations

import errno
import multiprocessing
import os
import re
import sys
from typing import Any

import pytest
import torch

import fastpersist as fp
from fastpersist import _core
from fastpersist.saving.target import NAME_MAX_BYTES

from dist_workers import run
from gloo import HELPERS_DIR, run_ranks
from race_worker import save_rounds, state_of

ROUNDS = 30


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["worker"] == b["worker"] and torch.equal(a["w"], b["w"])


def test_two_processes_making_the_first_save_of_one_path_both_commit(workdir: str, backend: str) -> None:
    """Each round both processes save a fresh path at once: the later commit replaces the earlier."""
    if HELPERS_DIR not in sys.path:
        sys.path.insert(0, HELPERS_DIR)
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    os.environ["RACE_BACKEND"] = backend
    procs = [ctx.Process(target=save_rounds, args=(w, workdir, ROUNDS, barrier, results)) for w in range(2)]
    try:
        for p in procs:
            p.start()
        outcomes = dict(results.get(timeout=240) for _ in procs)
    finally:
        del os.environ["RACE_BACKEND"]
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert outcomes == {0: ["ok"] * ROUNDS, 1: ["ok"] * ROUNDS}
    assert sorted(os.listdir(workdir)) == sorted(f"ck-{i}" for i in range(ROUNDS))  # no leftovers
    for i in range(ROUNDS):
        path = os.path.join(workdir, f"ck-{i}")
        fp.verify(path)
        loaded = fp.load(path)
        assert _same(loaded, state_of(loaded["worker"]))


def test_a_save_that_loses_the_race_to_create_a_path_replaces_the_winner(
    workdir: str, config: fp.Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another save commits the path between this save's existence check and its rename."""
    path = os.path.join(workdir, "ck")
    real = _core.replace_atomically
    raced = []

    def other_save_commits_first(src: str, dst: str) -> bool:
        if not raced:
            raced.append(dst)
            fp.save(state_of(1), dst, config=config)  # itself renames with the real call
            raise FileExistsError(errno.EEXIST, "rename: File exists", dst)  # what the stale check meets
        return real(src, dst)

    monkeypatch.setattr(_core, "replace_atomically", other_save_commits_first)
    fp.save(state_of(0), path, config=config)
    assert raced == [path]
    assert _same(fp.load(path), state_of(0))
    fp.verify(path)
    assert fp.wait_removed(timeout=60)  # (after the commit, in the background)
    assert os.listdir(workdir) == ["ck"]  # the replaced checkpoint was removed


def test_a_path_that_stops_being_a_checkpoint_mid_race_is_not_replaced(
    workdir: str, config: fp.Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = os.path.join(workdir, "ck")

    def a_file_appears(src: str, dst: str) -> bool:
        with open(dst, "w") as f:
            f.write("not a checkpoint")
        raise FileExistsError(errno.EEXIST, "rename: File exists", dst)

    monkeypatch.setattr(_core, "replace_atomically", a_file_appears)
    with pytest.raises(FileExistsError, match="not a fastpersist checkpoint") as raised:
        fp.save(state_of(0), path, config=config)
    assert raised.value.filename == path
    assert os.listdir(workdir) == ["ck"] and open(path).read() == "not a checkpoint"


@pytest.mark.parametrize("striped", [False, True])
def test_a_name_too_long_for_the_hidden_directories_is_refused_before_writing(
    workdir: str, config: fp.Config, striped: bool
) -> None:
    stripes = [os.path.join(workdir, "ssd0")] if striped else None
    if stripes:
        os.mkdir(stripes[0])
    cfg = fp.Config(backend=config.backend, chunk_bytes=config.chunk_bytes, stripes=stripes)
    # .NAME.fptmp-ID12 adds 20 bytes; NAME.ID12.fpstripe adds 22.
    longest = NAME_MAX_BYTES - (22 if striped else 20)
    path = os.path.join(workdir, "c" * 240)
    with pytest.raises(ValueError, match=rf"{re.escape(path)}.*240 bytes.*255-byte limit.*at most {longest} bytes"):
        fp.save({"w": torch.ones(4)}, path, config=cfg)
    with pytest.raises(ValueError, match=f"at most {longest} bytes"):
        fp.save_async({"w": torch.ones(4)}, os.path.join(workdir, "d" * (longest + 1)), config=cfg)
    assert sorted(os.listdir(workdir)) == (["ssd0"] if striped else [])
    assert not stripes or os.listdir(stripes[0]) == []
    fits = os.path.join(workdir, "e" * longest)
    fp.save({"w": torch.ones(4)}, fits, config=cfg)
    fp.save({"w": torch.full((4,), 2.0)}, fits, config=cfg)  # a replace too
    assert fp.load(fits, config=cfg)["w"].tolist() == [2.0] * 4


def test_a_striped_save_refuses_a_name_its_loader_would_refuse(workdir: str) -> None:
    stripes = [os.path.join(workdir, "ssd")]
    os.mkdir(stripes[0])
    cfg = fp.Config(stripes=stripes)
    with pytest.raises(ValueError, match=r"my ckpt.*with stripes.*'my ckpt\.0{12}\.fpstripe'"):
        fp.save({"w": torch.ones(4)}, os.path.join(workdir, "my ckpt"), config=cfg)
    assert sorted(os.listdir(workdir)) == ["ssd"] and os.listdir(stripes[0]) == []
    fp.save({"w": torch.ones(4)}, os.path.join(workdir, "my ckpt"))  # without stripes the name is fine
    assert fp.load(os.path.join(workdir, "my ckpt"))["w"].tolist() == [1.0] * 4


def test_the_name_limit_counts_bytes_not_characters(workdir: str) -> None:
    path = os.path.join(workdir, "é" * 118)  # 236 bytes in UTF-8
    with pytest.raises(ValueError, match=r"236 bytes.*at most 235 bytes"):
        fp.save({"w": torch.ones(4)}, path)


def test_a_group_save_of_a_name_too_long_fails_on_every_rank_before_writing(workdir: str) -> None:
    """Rank 0 checks with the longest rank tag (".r1" here: 255 - 25 = 230 bytes) for everyone."""
    results = run_ranks(run, 2, ("long_name", workdir, "threads"), workdir, 120)
    for r in results:
        assert [n for n in r["written"] if n not in ("init-store", "ssd") and not n.startswith("result-")] == [], r
    assert [r["stripe"] for r in results] == [[], []]
    rank0, rank1 = (r["raised"] for r in results)
    assert rank0.startswith("ValueError: cannot save ") and "at most 230 bytes" in rank0, rank0
    assert rank1.startswith("GroupSaveError: rank 0 could not start the save") and "at most 230 bytes" in rank1, rank1
