"""Nothing deletes what it cannot prove is garbage (docs/failure-model.md, "Deletion").

Stripe roots shared by several checkpoint roots, ``cp -r`` copies, a committed step whose
manifest cannot be read, another process's save in flight, a reused root, a missing stripe root.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest
import torch

import fastpersist as fp
from fastpersist.format.manifest import read_manifest
from fastpersist.retention import retire


def _state(seed: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(200_000, generator=gen), "step": seed}


def _same(a: dict[str, object], b: dict[str, object]) -> bool:
    return a["step"] == b["step"] and torch.equal(a["w"], b["w"])  # type: ignore[arg-type]


def _drives(workdir: str) -> list[str]:
    drives = [os.path.join(workdir, f"nvme{i}") for i in range(2)]
    for d in drives:
        os.makedirs(d, exist_ok=True)
    return drives


def _striped(config: fp.Config, stripes: list[str]) -> fp.Config:
    return fp.Config(backend=config.backend, chunk_bytes=64 << 10, pool_bytes=1 << 20, stripes=stripes)


def test_checkpointers_sharing_stripe_roots_never_touch_each_other(workdir: str, config: fp.Config) -> None:
    cfg = _striped(config, _drives(workdir))
    a = fp.Checkpointer(os.path.join(workdir, "expA"), keep=2, config=cfg)
    for step in range(3):
        a.save(step, _state(step))
        a.wait()
    b = fp.Checkpointer(os.path.join(workdir, "expB"), keep=2, config=cfg)
    assert b.clean() == []
    for step in range(3):
        b.save(step, _state(10 + step))
        b.wait()
    assert fp.clean(b.root, stripes=cfg.stripes) == []
    assert fp.clean(a.root, stripes=cfg.stripes) == []
    assert a.steps() == [1, 2] and b.steps() == [1, 2]
    for step in (1, 2):
        assert _same(a.load(step), _state(step)) and _same(b.load(step), _state(10 + step))
    rc = subprocess.run(
        [sys.executable, "-m", "fastpersist", "clean", a.root, "--stripes", *(cfg.stripes or [])], capture_output=True
    )
    assert rc.returncode == 0 and _same(b.load(2), _state(12))


def test_replacing_a_copy_of_a_striped_checkpoint_keeps_the_originals_data(workdir: str, config: fp.Config) -> None:
    cfg = _striped(config, _drives(workdir))
    original, copy = os.path.join(workdir, "ckpt", "best"), os.path.join(workdir, "backup", "best")
    os.makedirs(os.path.dirname(copy))
    os.makedirs(os.path.dirname(original))
    fp.save(_state(1), original, config=cfg)
    shutil.copytree(original, copy)
    fp.save(_state(2), copy, config=cfg)  # refresh the backup: its old tree names the original's stripes
    assert _same(fp.load(original), _state(1)) and _same(fp.load(copy), _state(2))
    assert fp.clean(os.path.dirname(copy), stripes=cfg.stripes) == []
    assert _same(fp.load(original), _state(1))


def test_an_unreadable_committed_manifest_keeps_its_stripe_directories(
    workdir: str, config: fp.Config, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _striped(config, _drives(workdir))
    root = os.path.join(workdir, "root")
    path = os.path.join(root, "ck")
    os.makedirs(root)
    fp.save(_state(1), path, config=cfg)
    named = read_manifest(path).stripes
    with open(os.path.join(path, "manifest.json"), "r+b") as f:  # a damaged (or newer-format) manifest
        f.seek(40)
        f.write(b"#")
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        assert fp.clean(root, stripes=cfg.stripes) == []
    assert all(os.path.isdir(d) for d in named)
    assert "keeping every stripe directory" in caplog.text


def test_retention_waits_until_the_new_step_verifies(
    workdir: str, config: fp.Config, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _striped(config, _drives(workdir))
    old, new = os.path.join(workdir, "step-00000001"), os.path.join(workdir, "step-00000002")
    fp.save(_state(1), old, config=cfg)
    fp.save(_state(2), new, config=cfg)
    victim = fp.inspect(new)["files"][-1]["path"]
    os.truncate(victim, 10)
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        assert retire(workdir, new, [old], cfg.stripes, rank=0) == []
    assert "does not verify yet" in caplog.text and _same(fp.load(old), _state(1))
    os.remove(victim)
    assert retire(workdir, new, [old], cfg.stripes, rank=0) == []
    fp.save(_state(2), new, config=cfg)
    assert retire(workdir, new, [old], cfg.stripes, rank=0) == [old]
    assert not os.path.exists(old)  # out of sight at once; its bytes go in the background
    assert fp.wait_removed(timeout=60)
    assert {n for d in cfg.stripes or [] for n in os.listdir(d)} == {
        os.path.basename(d) for d in read_manifest(new).stripes
    }


def test_clean_refuses_one_stripe_root_given_as_a_string(workdir: str) -> None:
    """It was iterated as one relative stripe root per character: nothing cleaned, no word."""
    root, drive = os.path.join(workdir, "root"), _drives(workdir)[0]
    leftover = os.path.join(root, ".step-00000002.fptmp-0123456789ab")
    os.makedirs(leftover)
    for stripes in (drive, drive.encode(), pathlib.Path(drive)):
        with pytest.raises(ValueError, match=r"fastpersist\.clean\(stripes=.*\): expected None or a list of") as info:
            fp.clean(root, stripes=stripes)  # type: ignore[arg-type]
        assert "not a single path: write stripes=[" in str(info.value)
    with pytest.raises(TypeError, match=r"fastpersist\.clean\(stripes\[0\]=5\): expected a directory"):
        fp.clean(root, stripes=[5])  # type: ignore[list-item]
    assert os.path.isdir(leftover), "refused before anything was removed"
    assert fp.clean(root, stripes=[drive]) == [leftover]


@pytest.mark.parametrize("how", ["missing", "a file"])
def test_a_missing_stripe_root_is_refused_before_anything_is_written(workdir: str, config: fp.Config, how: str) -> None:
    drives = _drives(workdir)
    bad = os.path.join(workdir, "not-mounted")
    if how == "a file":
        open(bad, "w").close()
    path = os.path.join(workdir, "ck")
    fp.save(_state(1), path, config=_striped(config, drives))
    before = sorted(os.listdir(workdir)), [sorted(os.listdir(d)) for d in drives]
    with pytest.raises(OSError, match="create it or mount its drive") as info:
        fp.save(_state(2), path, config=_striped(config, [drives[0], bad]))
    assert info.value.filename == bad
    assert (sorted(os.listdir(workdir)), [sorted(os.listdir(d)) for d in drives]) == before
    assert _same(fp.load(path), _state(1))


def test_a_reused_root_follows_its_own_index(workdir: str, config: fp.Config, caplog: pytest.LogCaptureFixture) -> None:
    old_run = fp.Checkpointer(workdir, keep=2, config=config)
    for step in (97, 98, 99):
        old_run.save(step, _state(step))
        old_run.wait()
    new_run = fp.Checkpointer(workdir, keep=2, config=config)
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        for step in range(5):
            new_run.save(step, _state(step))
            new_run.wait()
            assert new_run.latest() == step
    assert "newer than step 0" in caplog.text
    assert new_run.steps() == [3, 4, 98, 99], "retention removes only this run's older steps"
    assert fp.Checkpointer(workdir, config=config).latest() == 4, "a restart resumes the new run"
    assert _same(new_run.load(), _state(4))


def _save_forever(root: str, stop_file: str, out: str) -> None:
    ck = fp.Checkpointer(root, keep=2, config=fp.Config(chunk_bytes=64 << 10, pool_bytes=256 << 10, queue_depth=1))
    ok, errors = 0, []
    step = 0
    while not os.path.exists(stop_file) and step < 400:
        try:
            ck.save(step, {"w": torch.full((1 << 20,), float(step))})
            ck.wait()
            ok += 1
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
        step += 1
    with open(out, "w") as f:
        f.write(f"{ok}\n" + "\n".join(errors))


def test_another_process_cleaning_never_breaks_a_save_in_flight(workdir: str) -> None:
    root, stop, out = os.path.join(workdir, "run"), os.path.join(workdir, "stop"), os.path.join(workdir, "out")
    os.makedirs(root)
    saver = multiprocessing.get_context("spawn").Process(target=_save_forever, args=(root, stop, out))
    saver.start()
    cleaned: list[str] = []
    started = time.monotonic()
    while not os.path.exists(os.path.join(root, "latest.json")) and time.monotonic() - started < 60:
        time.sleep(0.05)  # the saver has imported torch and committed once
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        eval_job = fp.Checkpointer(root)  # an eval job polling latest(): removes nothing
        eval_job.latest()
        cleaned += fp.clean(root)  # and a cleaner that does: must skip live saves
    open(stop, "w").close()
    saver.join(60)
    assert saver.exitcode == 0
    ok, *errors = open(out).read().split("\n")
    assert errors == [""] or errors == [], errors
    assert int(ok) >= 3 and cleaned == [], cleaned


def test_a_file_system_without_locks_saves_and_clean_keeps_its_temporary_directories(
    workdir: str, config: fp.Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import fcntl

    from fastpersist.format import flocks

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    monkeypatch.setattr(flocks, "_warned_no_locks", False)
    path = os.path.join(workdir, "ck")
    fp.save(_state(1), path, config=config)
    assert _same(fp.load(path), _state(1))
    tmp = os.path.join(workdir, ".ck.fptmp-0123456789ab")  # a dead save's, or a live one: no way to tell
    os.makedirs(tmp)
    tmp_file = os.path.join(workdir, ".model.pt.fptmp-0123456789ab")  # an atomic file write's, the same
    open(tmp_file, "wb").close()
    fp.torch_save({"w": torch.ones(2)}, os.path.join(workdir, "model.pt"))  # the next write of it keeps it too
    assert fp.clean(workdir) == [] and os.path.isdir(tmp) and os.path.isfile(tmp_file)
