"""The remote level on a directory: background drain, atomic remote commit, retention, restore
when the local root is gone, a damaged remote copy, a full remote filesystem, a slow remote
that never blocks a step; and 4 gloo ranks as 2 nodes with replicas=1 losing every node."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from typing import Any

import pytest
import torch

import fastpersist as fp

import levels_workers as w
from gloo import run_ranks

CONFIG = fp.Config(chunk_bytes=64 << 10, pool_bytes=1 << 20, queue_depth=4)


def state(step: int, n: int = 50_000) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=gen), "step": step}


def _ck(root: Any, remote: fp.Remote, **kw: Any) -> fp.Checkpointer:
    return fp.Checkpointer(root, every=1, keep=2, config=CONFIG, levels=[remote], **kw)


def test_steps_drain_and_restore_when_the_local_root_is_gone(tmp_path: Any) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    with _ck(local, fp.Remote(remote, every=2, keep=2)) as ck:
        for step in range(1, 7):
            ck.save(step, state(step))
            ck.wait_staged()
    assert ck.levels()["remote"]["steps"] == [4, 6]  # drained 1, 2, 4, 6; two kept
    assert not [n for n in os.listdir(remote) if n.startswith(".")]  # no marker or leftover
    assert torch.equal(fp.load(str(remote / "step-00000006"))["w"], state(6)["w"])  # a plain checkpoint
    shutil.rmtree(local)
    again = _ck(local, fp.Remote(remote, every=2))
    assert again.latest() == 6
    loaded = again.load()
    assert loaded["step"] == 6 and torch.equal(loaded["w"], state(6)["w"])
    again.save(7, state(7))  # training continues and refills the local level
    again.close()
    assert again.steps() == [6, 7] and again.latest() == 7  # 6 refilled from the remote


def test_a_damaged_remote_copy_falls_back_to_the_previous_remote_step(tmp_path: Any) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    with _ck(local, fp.Remote(remote, every=1, keep=3)) as ck:
        for step in (1, 2, 3):
            ck.save(step, state(step))
            ck.close()  # each step drained before the next
    data = next(p for p in (remote / "step-00000003").iterdir() if p.suffix == ".bin")
    with open(data, "r+b") as f:
        f.seek(10)
        f.write(b"\xff\xfe")
    shutil.rmtree(local)
    again = _ck(local, fp.Remote(remote))
    assert again.latest() == 2
    assert torch.equal(again.load()["w"], state(2)["w"])


def test_a_slow_remote_never_blocks_a_step(tmp_path: Any) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    ck = _ck(local, fp.Remote(remote, every=1, bytes_per_s=100_000))  # 200 KB: ~2 s per drain
    started = time.monotonic()
    for step in range(1, 6):
        ck.save(step, state(step))
        ck.wait_staged()
    ck.wait()
    saving = time.monotonic() - started
    assert saving < 1.5, saving  # five saves did not wait for the ~2 s drain
    assert ck.levels()["remote"]["steps"] in ([], [1])  # the drain of step 1 is still throttled
    ck.close()
    assert ck.levels()["remote"]["steps"][-1] == 5  # the newest step superseded the waiting ones


@pytest.fixture
def tiny_fs(tmp_path: Any) -> Any:
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_a_full_remote_fails_the_drain_keeps_the_previous_step_and_close_raises(
    tmp_path: Any, tiny_fs: Any, caplog: Any
) -> None:
    local = tmp_path / "local"
    ck = _ck(local, fp.Remote(tiny_fs, every=1))
    ck.save(1, state(1, 20_000))  # 80 KB: fits
    ck.close()
    caplog.set_level(logging.WARNING, logger="fastpersist")
    ck.save(2, state(2, 400_000))  # 1.6 MB: ENOSPC
    with pytest.raises(OSError) as e:
        ck.close()
    assert "No space" in str(e.value) or e.value.errno == 28
    assert "drain of step 2" in caplog.text and "attempt 1" in caplog.text
    assert fp.verify(str(tiny_fs / "step-00000001"))["files"] >= 1
    assert ck.levels()["remote"]["steps"] == [1]


def test_a_group_that_loses_every_node_restores_from_the_remote(tmp_path: Any) -> None:
    d = str(tmp_path)
    results = run_ranks(w.save_with_remote, 4, (d, [1, 2, 3, 4]), d, timeout_s=180)
    assert all("traceback" not in r for r in results), results
    # Rank 0 retires old remote steps after the commit the others wait for: they may list one more.
    assert all(r["remote"][-1] == 4 for r in results), results
    shutil.rmtree(os.path.join(d, "node0"))
    shutil.rmtree(os.path.join(d, "node1"))
    for name in os.listdir(d):
        if name.startswith(("result-", "error-", "init-store")):
            os.remove(os.path.join(d, name))
    results = run_ranks(w.restore_with_remote, 4, (d,), d, timeout_s=180)
    assert all(r == {"latest": 4, "step": 4, "same": True, "local": [4, 5]} for r in results), results


def test_a_retry_after_the_remote_commit_succeeds_and_rewrites_nothing(tmp_path: Any) -> None:
    """A rank whose wait for the commit timed out retries once the commit has landed."""
    import dataclasses

    from fastpersist.format.manifest import read_manifest
    from fastpersist.levels.remote_steps import RemoteSteps

    local, remote = tmp_path / "local", tmp_path / "remote"
    with _ck(local, fp.Remote(remote, every=1)) as ck:
        ck.save(1, state(1))
    m, r = read_manifest(ck.path(1)), RemoteSteps(remote)
    manifest = remote / "step-00000001" / "manifest.json"
    inode = os.stat(manifest).st_ino
    assert r.drain_share(1, ck.path(1), m, 0, lambda n: None) == 0
    r.commit(1, ck.path(1), m, timeout_s=5, run=None, keep=2)
    assert os.stat(manifest).st_ino == inode  # the committed manifest was not replaced
    other = dataclasses.replace(m, checkpoint_id="another")
    with pytest.raises(FileExistsError):
        r.drain_share(1, ck.path(1), other, 0, lambda n: None)


def test_ranks_that_drain_at_different_speeds_still_drain_the_same_steps(tmp_path: Any) -> None:
    d = str(tmp_path)
    results = run_ranks(w.save_with_uneven_drains, 4, (d,), d, timeout_s=180)
    assert all("traceback" not in r for r in results), results
    assert all(r["error"] == "" for r in results), results  # no rank waited for a step the others skipped
    assert all(r["drained"][-1] == 8 for r in results), results
    for step in results[0]["drained"]:
        assert fp.verify(os.path.join(d, "remote", f"step-{step:08d}"))["files"] >= 1


def test_a_damaged_local_copy_is_never_drained(tmp_path: Any) -> None:
    from fastpersist.format.manifest import read_manifest
    from fastpersist.levels.remote_steps import RemoteSteps

    ck = fp.Checkpointer(tmp_path / "local", config=CONFIG)
    ck.save(1, state(1, 200_000))
    ck.wait()
    data = next(p for p in (tmp_path / "local" / "step-00000001").iterdir() if p.suffix == ".bin")
    with open(data, "r+b") as f:
        f.seek(300_000)
        f.write(b"\x00\x01\x02")
    remote = RemoteSteps(str(tmp_path / "remote"))
    with pytest.raises(fp.ChecksumMismatchError):
        remote.drain_share(1, ck.path(1), read_manifest(ck.path(1)), 0, lambda n: None)
    assert remote.steps() == []


def test_a_plain_group_save_drains_every_writers_file(tmp_path: Any) -> None:
    d = str(tmp_path)
    results = run_ranks(w.plain_group_with_remote, 2, (d,), d, timeout_s=120)
    assert all("traceback" not in r for r in results), results
    remote_step = os.path.join(d, "remote", "step-00000001")
    assert fp.verify(remote_step)["files"] == 1  # the one data file, written by writer 1
    assert torch.equal(fp.load(remote_step)["w"], w.step_state(1, 0, False, 1000)["w"])


class _Clock:
    """A fake `time` for the drain's throttle: sleeping advances it."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.mark.parametrize("writing", [False, True])
def test_the_drain_yields_half_its_time_to_a_writing_save(tmp_path: Any, monkeypatch: Any, writing: bool) -> None:
    from fastpersist.levels import remote_drain as drain
    from fastpersist.levels.remote_steps import RemoteSteps

    clock = _Clock()
    monkeypatch.setattr(drain, "time", clock)
    drainer = drain.Drainer(
        RemoteSteps(str(tmp_path / "remote")), str, rank=0, size=1, keep=1, timeout_s=5, writing=lambda: writing
    )
    try:
        throttle = drainer._throttle(clock.now, [0])
        for piece_s in (0.2, 0.05, 3.0):
            clock.now += piece_s  # the piece's read and upload
            throttle(8 << 20)
        assert clock.slept == pytest.approx([0.2, 0.05, drain.YIELD_MAX_S] if writing else [])
    finally:
        drainer.close()


def test_an_object_cut_after_its_marker_is_never_committed(tmp_path: Any, monkeypatch: Any, caplog: Any) -> None:
    """The commit checks every object's size, not only the owners' markers: a data object cut
    short after its upload fails that attempt (WARNING naming it), and the retry commits it whole."""
    from fastpersist.levels.remote_steps import RemoteSteps

    original = RemoteSteps.drain_share
    cut: list[str] = []

    def drain_then_cut(self: RemoteSteps, step: int, local_dir: str, *args: Any) -> int:
        nbytes = original(self, step, local_dir, *args)
        if not cut:
            data = next(p for p in os.listdir(self.path(step)) if p.endswith(".bin"))
            cut.append(os.path.join(self.path(step), data))
            os.truncate(cut[0], 4096)
        return nbytes

    monkeypatch.setattr(RemoteSteps, "drain_share", drain_then_cut)
    local, remote = tmp_path / "local", tmp_path / "remote"
    with caplog.at_level(logging.WARNING, logger="fastpersist"), _ck(local, fp.Remote(remote, every=1)) as ck:
        ck.save(1, state(1))
    assert cut and any(cut[0] in r.getMessage() and "4096 bytes" in r.getMessage() for r in caplog.records)
    assert ck.levels()["remote"]["steps"] == [1]
    assert torch.equal(fp.load(str(remote / "step-00000001"))["w"], state(1)["w"])


def test_remote_every_none_with_failures_follows_the_advisor(tmp_path: Any, caplog: Any, monkeypatch: Any) -> None:
    """remote_every=None with failures=: after each drain the remote interval is the multi-level
    advisor's choice for the measured costs (logged at INFO), in steps, and later steps follow it."""
    import dataclasses

    from fastpersist.advisor.multilevel import best_remote_every
    from fastpersist.levels.remote_drain import Drainer

    drain = Drainer.drain  # each drain made to cost training 50 ms of CPU: the advice spaces drains
    monkeypatch.setattr(Drainer, "drain", lambda self, step: dataclasses.replace(drain(self, step), cpu_s=0.05))
    failures = fp.Failures(process_mtbf_s=3600.0, cluster_mtbf_s=5.0)
    local, remote = tmp_path / "local", tmp_path / "remote"
    with caplog.at_level(logging.INFO, logger="fastpersist"), _ck(local, fp.Remote(remote), failures=failures) as ck:
        for step in range(1, 4):
            time.sleep(0.02)  # a training step
            ck.save(step, state(step))
            ck.wait()
            ck._far.drainer.wait()
        level = ck._far
        assert level.advised_costs is not None and level.every is not None
        assert level.every == best_remote_every(0, 1, level.advised_costs, failures)
        assert any("remote_every None ->" in r.getMessage() for r in caplog.records)
        drained = ck.levels()["remote"]["steps"]
        for step in range(4, 4 + 2 * level.every):
            ck.save(step, state(step))
            ck.wait()
            ck._far.drainer.wait()
        after = [s for s in ck.levels()["remote"]["steps"] if s > max(drained)]
    # Fewer drains than saves once the advice spaces them (it may move with each drain's cost).
    assert level.every >= 2 and 0 < len(after) < 2 * level.every, (level.every, after)


def test_every_auto_with_failures_sets_every_against_what_the_local_level_survives(tmp_path: Any) -> None:
    failures = fp.Failures(process_mtbf_s=7200.0, node_mtbf_s=3600.0, nodes=2, cluster_mtbf_s=86400.0)
    ck = fp.Checkpointer(tmp_path / "a", every="auto", failures=failures, levels=[fp.Remote(tmp_path / "r")])
    assert ck.history.mtbf_s == pytest.approx(7200.0)  # node and cluster losses are the remote's
    with pytest.raises(ValueError, match="no failure the local level survives"):
        fp.Checkpointer(tmp_path / "b", every="auto", failures=fp.Failures(cluster_mtbf_s=86400.0))
    with pytest.raises(TypeError, match="Failures"):
        fp.Checkpointer(tmp_path / "d", failures={"process_mtbf_s": 1.0})  # type: ignore[arg-type]
