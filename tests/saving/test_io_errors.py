"""Real I/O failures through the public API: a full tmpfs, an unwritable or vanished directory,
a read-only file system. Each gives a clear OSError (errno and filename kept), commits nothing,
leaves the previous checkpoint loadable and no partial files, fds or threads behind.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import is_root

import fastpersist as fp
from fastpersist.saving import job, remover, start
from fastpersist.saving.remover import run_later

MIB = 1 << 20


@contextmanager
def tmpfs(where: Path, *options: str) -> Iterator[Path]:
    """A fresh tmpfs at `where` (skips with the reason where mounting is refused)."""
    if not is_root():
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def process_counts() -> tuple[int, int]:
    """(open fds, OS threads) of this process."""
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def quiet_counts() -> tuple[int, int]:
    """Counts once the threads of a finished save have exited (they end just after it returns)."""
    last = process_counts()
    for _ in range(50):
        time.sleep(0.05)
        now = process_counts()
        if now == last:
            return now
        last = now
    return last


def settle(expected: tuple[int, int]) -> tuple[int, int]:
    """Counts after giving finished background threads a moment to exit."""
    deadline = time.monotonic() + 5
    while process_counts() != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return process_counts()


def config(backend: str) -> fp.Config:
    return fp.Config(backend=backend, chunk_bytes=MIB, pool_bytes=4 * MIB, queue_depth=4)


def _three_saves_on_room_for_two(small: Path, backend: str, save: Callable[..., object]) -> None:
    """Room for two 4 MiB checkpoints, not three: the third save fits only once the tree the
    second one replaced (queued for removal, held back here by a gate) is gone."""
    path = str(small / "ck")
    states = [{"w": torch.full((MIB,), float(k))} for k in range(3)]
    fp.save(states[0], path, config=config(backend))
    gate = threading.Event()
    run_later(gate.wait, 30)
    fp.save(states[1], path, config=config(backend))
    threading.Timer(0.5, gate.set).start()
    save(states[2], path, config=config(backend))
    assert torch.equal(fp.load(path)["w"], states[2]["w"])
    assert fp.wait_removed(timeout=60) and os.listdir(small) == ["ck"]


@pytest.mark.parametrize("method", ["save", "save_async"])
def test_a_save_short_of_space_waits_for_the_queued_removal_of_a_replaced_tree(
    tmp_path: Path, backend: str, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    waits: list[bool] = []
    real_wait = remover.wait_removed
    monkeypatch.setattr(remover, "wait_removed", lambda: waits.append(real_wait()))

    def save(state: object, path: str, config: fp.Config) -> None:
        if method == "save":
            fp.save(state, path, config=config)
        else:
            fp.save_async(state, path, config=config).wait(timeout=60)

    with tmpfs(tmp_path / "small", "size=10m") as small:
        _three_saves_on_room_for_two(small, backend, save)
    assert waits == [True]  # before writing: the free space was short of the save's bytes


def test_a_save_that_runs_out_of_space_anyway_waits_for_the_removals_and_retries(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where the free space looked enough (a filesystem's own overhead, a neighbour's writes)
    # and the disk still filled, a blocking save waits for the queued removals and tries again.
    monkeypatch.setattr(job, "make_room", lambda paths, nbytes: None)
    waits: list[bool] = []
    real_wait = start.wait_removed
    monkeypatch.setattr(start, "wait_removed", lambda: waits.append(real_wait()))
    with tmpfs(tmp_path / "small", "size=10m") as small:
        _three_saves_on_room_for_two(small, backend, fp.save)
    assert waits == [True]  # the first try ran out of space, the second fit


def test_full_disk_mid_save(tmp_path: Path, backend: str) -> None:
    with tmpfs(tmp_path / "small", "size=12m") as small:
        path = str(small / "ck")
        old = {"w": torch.full((MIB // 4,), 1.0)}
        fp.save(old, path, config=config(backend))  # 1 MiB; also warms the pool and backend up
        before = quiet_counts()
        used_before = shutil.disk_usage(small).used
        big = {"w": torch.full((6 * MIB,), 2.0)}  # 24 MiB: runs out mid-write
        with pytest.raises(OSError) as caught:
            fp.save(big, path, config=config(backend))
        assert caught.value.errno == errno.ENOSPC, caught.value
        assert caught.value.filename and str(small) in caught.value.filename
        assert torch.equal(fp.load(path)["w"], old["w"])  # the previous checkpoint is intact
        assert os.listdir(small) == ["ck"] and shutil.disk_usage(small).used <= used_before
        assert settle(before) == before, "fds or threads leaked"
        # The same through save_async: the error arrives at wait().
        with pytest.raises(OSError) as caught_async:
            fp.save_async(big, path, config=config(backend)).wait(timeout=60)
        assert caught_async.value.errno == errno.ENOSPC and os.listdir(small) == ["ck"]
        assert settle(before) == before
        # A disk filled by someone else: even a small save fails; once space is freed, it succeeds.
        filler = small / "filler"
        filler.write_bytes(b"\0" * (10 * MIB))
        medium = {"w": torch.full((2 * MIB,), 3.0)}  # 8 MiB
        with pytest.raises(OSError) as caught_full:
            fp.save(medium, path, config=config(backend))
        assert caught_full.value.errno == errno.ENOSPC
        filler.unlink()
        fp.save(medium, path, config=config(backend))
        assert fp.wait_removed(timeout=60)  # the replaced tree goes after the commit, in the background
        assert torch.equal(fp.load(path)["w"], medium["w"]) and os.listdir(small) == ["ck"]
        assert settle(before) == before


@contextmanager
def unwritable(directory: Path) -> Iterator[None]:
    """Makes `directory` refuse new entries, even to root (ext4 immutable flag)."""
    if is_root():
        if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not supported here (needed to deny root)")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
    else:
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(0o755)


def test_unwritable_directory(workdir: str, backend: str) -> None:
    parent = Path(workdir) / "locked"
    parent.mkdir()
    path = parent / "ck"
    fp.save({"w": torch.ones(10)}, path, config=config(backend))
    with unwritable(parent):
        with pytest.raises(PermissionError) as caught:
            fp.save({"w": torch.zeros(10)}, path, config=config(backend))
        assert caught.value.filename and str(parent) in caught.value.filename
    assert os.listdir(parent) == ["ck"] and fp.load(path)["w"].sum() == 10


def test_directory_removed_mid_save(workdir: str, backend: str) -> None:
    path = os.path.join(workdir, "ck")
    fp.save({"w": torch.ones(10)}, path, config=config(backend))
    before = quiet_counts()
    fut = fp.save_async({"w": torch.randn(16 * MIB)}, path, config=config(backend))  # 64 MiB via 4 MiB pool
    tmp = [n for n in os.listdir(workdir) if ".fptmp-" in n]
    assert len(tmp) == 1
    shutil.rmtree(os.path.join(workdir, tmp[0]))
    with pytest.raises(OSError) as caught:
        fut.wait(timeout=120)
    assert caught.value.errno == errno.ENOENT and caught.value.filename, caught.value
    assert os.listdir(workdir) == ["ck"] and fp.load(path)["w"].sum() == 10  # nothing committed
    assert settle(before) == before


def test_read_only_file_system(tmp_path: Path, backend: str) -> None:
    with tmpfs(tmp_path / "ro", "size=8m") as mnt:
        path = str(mnt / "ck")
        fp.save({"w": torch.ones(10)}, path, config=config(backend))
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with pytest.raises(OSError) as caught:
            fp.save({"w": torch.zeros(10)}, path, config=config(backend))
        assert caught.value.errno == errno.EROFS and caught.value.filename
        assert fp.load(path)["w"].sum() == 10 and fp.verify(path)["files"] == 1  # load never writes
        with pytest.raises(OSError) as caught_new:
            fp.save({"w": torch.zeros(10)}, str(mnt / "new"), config=config(backend))
        assert caught_new.value.errno == errno.EROFS and os.listdir(mnt) == ["ck"]
