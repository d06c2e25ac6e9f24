"""The remote level under faults, on a directory: the run identity rule (another run's steps on
a reused prefix, the steps a rollback abandoned), configurations refused at construction, a
restore that never waits for the drain, a refill killed midway, and in a group (4 ranks as 2
nodes, or 2 nodes of 1) a node lost with a remote, and one rank whose upload fails."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch

import fastpersist as fp
from fastpersist.format.layout import TMP_MARKER

import levels_workers as w
from gloo import run_ranks

CONFIG = fp.Config(chunk_bytes=64 << 10, pool_bytes=1 << 20, queue_depth=4)


def state(step: int, run: str, n: int = 20_000) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=gen), "step": step, "run": run}


def _ck(root: Any, remote: fp.Remote | None = None, **kw: Any) -> fp.Checkpointer:
    return fp.Checkpointer(root, every=1, config=CONFIG, levels=[remote] if remote else [], **kw)


def _drained_each(ck: fp.Checkpointer, steps: range, run: str) -> None:
    for step in steps:
        ck.save(step, state(step, run))
        ck.close()  # each due step drained before the next: the remote's contents are certain


def _flip_a_byte(step_dir: Any) -> None:
    data = next(p for p in os.listdir(step_dir) if p.endswith(".bin"))
    with open(os.path.join(step_dir, data), "r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 1]))


def test_a_new_run_on_a_reused_remote_prefix_never_restores_the_old_runs_steps(tmp_path: Any, caplog: Any) -> None:
    """Repro 20: run 2 (a new root) on run 1's remote prefix has committed steps 1-2 locally and
    drained nothing; its restart restores its own step, never run 1's newer step 5."""
    remote = tmp_path / "remote"
    _drained_each(_ck(tmp_path / "run1", fp.Remote(remote, every=1)), range(1, 6), "run1")
    with _ck(tmp_path / "run2") as ck:  # run 2 dies before its first drain: modelled by none
        for step in (1, 2):
            ck.save(step, state(step, "run2"))
    again = _ck(tmp_path / "run2", fp.Remote(remote))
    assert again.latest() == 2  # the local level holds the step its index names: the remote is not asked
    assert again.load()["run"] == "run2"
    _flip_a_byte(tmp_path / "run2" / "step-00000002")  # now the remote is asked: it holds run 1's 4 and 5
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        assert again.latest() == 1
    assert "another run's steps [4, 5]" in caplog.text
    restored = again.load()
    assert (restored["run"], restored["step"]) == ("run2", 1)
    explicit = again.load(step=5)  # an explicit step is an explicit choice
    assert (explicit["run"], explicit["step"]) == ("run1", 5)
    assert again.latest() == 1  # and it changes nothing the run restores by itself


def test_after_a_rollback_no_restore_returns_a_step_the_rollback_abandoned(tmp_path: Any, caplog: Any) -> None:
    """Repro 21: steps 1-7 drained; the run rolls back to step 3 and saves 4-8 again, draining
    every second step. The rollback's 6 replaces the abandoned 6 on the remote (WARNING), and the
    abandoned 7, out of the new lineage, is retired; with the new 8 damaged and the local root
    gone, the restore returns the rollback's 6, never an abandoned step."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    _drained_each(_ck(local, fp.Remote(remote, every=1, keep=2), keep=8), range(1, 8), "abandoned")
    assert sorted(os.listdir(remote)) == ["latest.json", "step-00000006", "step-00000007"]
    rolled = _ck(local, fp.Remote(remote, every=2, keep=2), keep=8)
    assert rolled.load(step=3)["run"] == "abandoned"
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        _drained_each(rolled, range(4, 9), "rollback")  # drains 4, 6 and 8
    assert "step-00000006 held another checkpoint" in caplog.text
    assert rolled.levels()["remote"]["steps"] == [6, 8]
    assert fp.load(str(remote / "step-00000006"))["run"] == "rollback"
    _flip_a_byte(remote / "step-00000008")
    shutil.rmtree(local)  # every node lost
    restored = _ck(local, fp.Remote(remote)).load()
    assert (restored["run"], restored["step"]) == ("rollback", 6)


@pytest.mark.parametrize("where", ["the root", "inside the root", "around the root"])
def test_a_remote_that_overlaps_the_root_is_refused_at_construction(tmp_path: Any, where: str) -> None:
    """Repro 26: the remote the root itself (close() then blocked timeout_s four times), inside
    it, or holding it."""
    root = tmp_path / "runs" / "exp1"
    remote = {"the root": root, "inside the root": root / "remote", "around the root": tmp_path / "runs"}[where]
    with pytest.raises(ValueError, match="the remote level must be a place of its own"):
        _ck(root, fp.Remote(remote))
    assert not os.path.exists(root / "remote")  # nothing made


@pytest.mark.parametrize("url", [False, True])
def test_one_remote_for_two_roots_at_once_is_refused(tmp_path: Any, url: bool) -> None:
    """Two roots draining into one remote (or one nested in the other) would retire each
    other's steps: refused while the first holds it, accepted once it is closed."""
    remote: Any = "s3://bucket/runs" if url else tmp_path / "remote"
    nested: Any = "s3://bucket//runs/exp1/" if url else tmp_path / "remote" / "exp1"
    first = _ck(tmp_path / "a", fp.Remote(remote))
    for other in (remote, nested):
        with pytest.raises(ValueError, match="remote level of another root"):
            _ck(tmp_path / "b", fp.Remote(other))
    assert _ck(tmp_path / "a", fp.Remote(remote)).root == first.root  # the same root again: its restart
    first.close()
    second = _ck(tmp_path / "b", fp.Remote(remote))
    with pytest.raises(ValueError, match="remote level of another root"):
        first.save(1, state(1, "a"))  # the closed one cannot drain into it again meanwhile
    second.close()


def test_a_restore_never_waits_for_a_throttled_drain(tmp_path: Any) -> None:
    """Repro 29: latest() and load() return at once while the drain of the step they restore
    crawls at 100 KB/s (about 2.5 s here)."""
    ck = _ck(tmp_path / "local", fp.Remote(tmp_path / "remote", every=1, bytes_per_s=100_000))
    ck.save(1, state(1, "run", 60_000))
    ck.wait()
    started = time.monotonic()
    assert ck.latest() == 1
    assert ck.load()["step"] == 1
    took = time.monotonic() - started
    assert ck._far.drainer.pinned() == {1}, "the drain had already finished: the test proves nothing"
    assert took < 1.0, took
    ck.close()
    assert ck.levels()["remote"]["steps"] == [1]


_KILLED_REFILL = """
import os, signal, sys
import fastpersist as fp
from fastpersist.levels.remote_steps import RemoteSteps

download = RemoteSteps.download
def dying(self, step, dest_dir, files):
    download(self, step, dest_dir, files[:1])  # one file of the refill written, then killed
    os.kill(os.getpid(), signal.SIGKILL)
RemoteSteps.download = dying
fp.Checkpointer(sys.argv[1], levels=[fp.Remote(sys.argv[2])]).load()
"""


def test_a_refill_killed_midway_blocks_no_later_restore(tmp_path: Any) -> None:
    """Repro 24: a kill -9 during a refill from the remote leaves its temporary directory,
    named after the remote step's id; the next restore removes it and refills the step."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    with _ck(local, fp.Remote(remote, every=1)) as ck:
        ck.save(1, state(1, "run", 200_000))
    shutil.rmtree(local)
    killed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILLED_REFILL), str(local), str(remote)], timeout=120, check=False
    )
    assert killed.returncode == -signal.SIGKILL
    left = [n for n in os.listdir(local) if TMP_MARKER in n]
    assert left, os.listdir(local)
    again = _ck(local, fp.Remote(remote))
    restored = again.load()
    assert restored["step"] == 1 and torch.equal(restored["w"], state(1, "run", 200_000)["w"])
    assert not [n for n in os.listdir(local) if TMP_MARKER in n]
    assert [os.path.basename(p) for p in again.removed_leftovers] == left


def test_a_node_lost_with_a_remote_is_restored_from_the_partner_copies(tmp_path: Any) -> None:
    """Repro 23: replicas=1 and a remote, one node's root deleted: the step comes from the
    partner copies (node 0's step directory untouched, nothing refilled from the remote)."""
    d = str(tmp_path)
    saved = run_ranks(w.save_with_remote, 4, (d, [1, 2, 3, 4]), d, timeout_s=180)
    assert all("traceback" not in r for r in saved), saved
    kept = os.stat(os.path.join(d, "node0", "step-00000004")).st_ino
    shutil.rmtree(os.path.join(d, "node1"))
    for name in os.listdir(d):
        if name.startswith(("result-", "error-", "init-store")):
            os.remove(os.path.join(d, name))
    results = run_ranks(w.restore_with_remote, 4, (d,), d, timeout_s=180)
    # Node 1 (ranks 2, 3) was not refilled with step 4: it holds only the step saved after the restore.
    want = [{"latest": 4, "step": 4, "same": True, "local": local} for local in ([4, 5], [4, 5], [5], [5])]
    assert results == want, results
    assert os.stat(os.path.join(d, "node0", "step-00000004")).st_ino == kept


def test_one_ranks_failed_upload_fails_every_ranks_drain_at_once(tmp_path: Any) -> None:
    """Repro 28: rank 1 cannot write its share of step 2 on the remote (a directory stands where
    its file goes). Every rank's close() raises within seconds (no rank waits timeout_s, 60 s
    here, for another's marker), rank 1 its own error and rank 0 the same errno naming rank 1."""
    d = str(tmp_path)
    results = run_ranks(w.drain_with_a_rank_failing, 2, (d,), d, timeout_s=120)
    assert all("traceback" not in r for r in results), results
    for r in results:
        assert r["errno"] == 21 and r["seconds"] < 20, r  # EISDIR; 4 attempts with backoff: ~4 s
        assert r["remote"] == [1], r
    assert "rank 1 could not upload its share for step 2" in results[0]["error"]
    assert "Is a directory" in results[1]["error"] and "rank 1 could not" not in results[1]["error"]
