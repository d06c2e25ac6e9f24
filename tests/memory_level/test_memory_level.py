"""The in-memory level: a Checkpointer root on a real tmpfs (/dev/shm) reuses its memory across
saves, survives the process, and stays crash-safe (memory_level/recycle.py, job/memory/mod.rs)."""

from __future__ import annotations

import collections
import hashlib
import json
import mmap
import multiprocessing
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import fastpersist as fp
from fastpersist import _core
from fastpersist.format.layout import INDEX_NAME, MANIFEST_NAME, RECYCLE_DIR, data_file_name
from fastpersist.loading import reading
from fastpersist.memory_level.recycle import is_memory_root

import crash_worker
import replace_workers
from backends import available_backends
from gloo import HELPERS_DIR

SHM = "/dev/shm"
pytestmark = pytest.mark.skipif(not (os.path.isdir(SHM) and is_memory_root(SHM)), reason="needs a tmpfs at /dev/shm")
DATA = data_file_name(writer=0, stripe=0)


def state_of(step: int, mib: int = 4) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    n = (mib << 20) // 4
    return {
        "model": {"w": torch.randn(n, generator=g), "h": torch.randn(1000, generator=g).to(torch.bfloat16)},
        "opt": {"m": torch.randn(n // 2, generator=g), "count": torch.arange(step + 5), "step": step},
        "step": step,
    }


def digests(state: object, prefix: str = "") -> dict[str, str]:
    """sha256 of every tensor's bytes (and repr of every other leaf), by key path."""
    out: dict[str, str] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(digests(v, f"{prefix}/{k}"))
    elif isinstance(state, torch.Tensor):
        raw = state.contiguous().view(torch.uint8).numpy().tobytes()
        out[prefix] = f"{state.dtype}:{tuple(state.shape)}:{hashlib.sha256(raw).hexdigest()}"
    else:
        out[prefix] = repr(state)
    return out


def du(root: str) -> int:
    """Bytes of memory the files under `root` hold (hidden ones included)."""
    total = 0
    for where, _, files in os.walk(root):
        for name in files:
            total += os.lstat(os.path.join(where, name)).st_blocks * 512
    return total


def config(backend: str, **kw: object) -> fp.Config:
    return fp.Config(backend=backend, chunk_bytes=1 << 20, pool_bytes=4 << 20, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", available_backends())
def test_a_new_process_loads_the_last_step_bit_identically(shm_root: str, backend: str) -> None:
    ck = fp.Checkpointer(shm_root, keep=2, config=config(backend))
    for step in range(5):
        ck.save(step, state_of(step))
    ck.wait()
    child = textwrap.dedent(
        """
        import json, sys
        import fastpersist as fp
        sys.path.insert(0, sys.argv[2])
        from test_memory_level import digests
        ck = fp.Checkpointer(sys.argv[1])
        print(json.dumps({"step": ck.latest(), "digests": digests(ck.load())}))
        """
    )
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HELPERS_DIR, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", child, shm_root, here], capture_output=True, text=True, env=env, check=True, timeout=120
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["step"] == 4
    assert got["digests"] == digests(state_of(4))


@pytest.mark.parametrize("backend", available_backends())
def test_repeated_saves_reuse_memory_and_stay_within_keep_plus_one(shm_root: str, backend: str) -> None:
    keep, mib = 2, 8
    ck = fp.Checkpointer(shm_root, keep=keep, config=config(backend))
    step_bytes = None
    inodes = []
    for step in range(7):
        fut = ck.save(step, state_of(step, mib))
        assert fut is not None
        result = fut.wait()
        step_bytes = step_bytes or result.nbytes
        inodes.append(os.stat(os.path.join(ck.path(step), DATA)).st_ino)
        held = du(shm_root)
        assert held <= (keep + 1) * step_bytes + (1 << 20), (step, held, step_bytes)
        assert ck.steps() == list(range(max(0, step - keep + 1), step + 1))
    # From the fourth save on, each save overwrote the files of the step retired three saves before.
    assert inodes[3:] == inodes[:4][: len(inodes) - 3], inodes
    recycled = os.listdir(os.path.join(shm_root, RECYCLE_DIR))
    assert len(recycled) == 1 and not os.path.exists(os.path.join(shm_root, RECYCLE_DIR, recycled[0], MANIFEST_NAME))
    for step in ck.steps():
        fp.verify(ck.path(step))
        assert digests(ck.load(step)) == digests(state_of(step, mib))


def _mapped_lines(root: str) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if root in line]


def _child_maps(root: str) -> list[str]:
    """The lines of a forked child's /proc/self/maps naming `root`."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        os.write(write_end, "".join(_mapped_lines(root)).encode() or b"-")
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        got = f.read().decode()
    os.waitpid(pid, 0)
    return [] if got == "-" else got.splitlines()


def test_kept_mappings_are_not_inherited_and_deleting_the_root_gives_their_memory_back(shm_root: str) -> None:
    ck = fp.Checkpointer(shm_root, keep=1, config=config("auto"))
    for step in range(4):
        ck.save(step, state_of(step))
    ck.wait()
    assert _mapped_lines(shm_root)  # the engine keeps the rotating files mapped between saves
    assert _child_maps(shm_root) == []  # a forked worker would pin them after their deletion
    shutil.rmtree(shm_root)
    deadline = time.monotonic() + 10
    while _mapped_lines(shm_root) and time.monotonic() < deadline:
        time.sleep(0.05)  # the engine's kept mappings of deleted files are dropped by its reaper
    assert _mapped_lines(shm_root) == []


def test_a_hard_linked_data_file_is_never_overwritten(shm_root: str) -> None:
    ck = fp.Checkpointer(shm_root, keep=1, config=config("auto"))
    ck.save(0, state_of(0))
    ck.wait()
    link = os.path.join(os.path.dirname(shm_root), "backup.bin")
    os.link(os.path.join(ck.path(0), DATA), link)
    before = open(link, "rb").read()
    for step in range(1, 5):
        ck.save(step, state_of(step))
    ck.wait()
    assert open(link, "rb").read() == before


def test_a_disk_root_is_not_recycled(workdir: str) -> None:
    root = os.path.join(workdir, "disk")
    ck = fp.Checkpointer(root, keep=1, config=config("auto"))
    for step in range(4):
        ck.save(step, state_of(step, 1))
    ck.wait()
    assert not os.path.exists(os.path.join(root, RECYCLE_DIR))
    assert ck.steps() == [3]


def test_clean_removes_a_recycle_dir_and_keeps_the_checkpoints(shm_root: str) -> None:
    ck = fp.Checkpointer(shm_root, keep=2, config=config("auto"))
    for step in range(4):
        ck.save(step, state_of(step))
    ck.wait()
    bin_dir = os.path.join(shm_root, RECYCLE_DIR)
    entries = [os.path.join(bin_dir, n) for n in os.listdir(bin_dir)]
    assert entries
    assert fp.clean(shm_root, dry_run=True) == entries
    assert os.listdir(bin_dir)
    assert fp.clean(shm_root) == entries
    assert not os.listdir(bin_dir) if os.path.exists(bin_dir) else True
    assert ck.steps() == [2, 3] and ck.latest() == 3
    assert digests(ck.load(3)) == digests(state_of(3))
    ck.save(4, state_of(4))  # the next save simply allocates fresh memory
    ck.wait()
    assert digests(ck.load(4)) == digests(state_of(4))
    assert [os.path.dirname(p) for p in fp.clean(shm_root)] == [bin_dir]  # step 2, retired by step 4
    assert ck.steps() == [3, 4]


def _whole_step(state: dict[str, object]) -> bool:
    """Whether every tensor of `state` is the one its step's save wrote (replace_workers)."""
    step = state["step"]
    assert isinstance(step, int)
    want = replace_workers.stepped_state(step)
    return all(torch.equal(state[k], want[k]) for k in want if isinstance(want[k], torch.Tensor))  # type: ignore[arg-type]


def test_loads_while_retention_recycles_see_one_step(shm_root: str, backend: str) -> None:
    """Another process saves step after step (keep=1: each save overwrites the files of the step
    retired before); loads here of the step the index names, unverified, return one step whole
    or raise CheckpointNotFoundError (before the fix: tensors mixing two steps)."""
    os.makedirs(shm_root)
    if HELPERS_DIR not in sys.path:
        sys.path.insert(0, HELPERS_DIR)
    ctx = multiprocessing.get_context("spawn")
    saves = ctx.Queue()
    seconds = 4.0
    saver = ctx.Process(target=replace_workers.save_steps_on_a_memory_root, args=(shm_root, backend, seconds, saves))
    saver.start()
    seen: collections.Counter[str] = collections.Counter()
    try:
        stop = time.monotonic() + seconds + 15  # the saver's start-up, then its seconds
        while saver.is_alive() and time.monotonic() < stop:
            try:
                with open(os.path.join(shm_root, INDEX_NAME)) as f:
                    path = os.path.join(shm_root, json.load(f)["path"])
            except (OSError, ValueError):
                continue  # no step yet, or the index being replaced
            try:
                state = fp.load(path, verify=False, config=fp.Config(backend=backend))  # type: ignore[arg-type]
            except fp.CheckpointNotFoundError:
                seen["not found"] += 1
                continue
            seen["whole" if _whole_step(state) else f"MIXED at step {state['step']}"] += 1
        saves_done = saves.get(timeout=30)
    finally:
        saver.join(30)
        if saver.is_alive():
            saver.kill()
    assert saver.exitcode == 0
    assert set(seen) <= {"whole", "not found"}, seen
    assert saves_done >= 10 and seen["whole"] >= 10, (saves_done, seen)


def test_a_file_a_load_holds_is_never_recycled(shm_root: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saves that retire the step a load is reading (and would recycle its files) write fresh
    files instead: the bytes the load reads stay the step's own. Recycling resumes after."""
    ck = fp.Checkpointer(shm_root, keep=1, config=config(backend))
    ck.save(0, state_of(0))
    ck.wait()
    data0 = os.path.join(ck.path(0), DATA)
    inode0, bytes0 = os.stat(data0).st_ino, open(data0, "rb").read()
    seen: dict[str, object] = {}
    read_ranges_into = reading._core.read_ranges_into

    def saves_then_read(ranges: list[tuple[object, ...]], *args: object, **kwargs: object) -> object:
        if not seen:
            with open(str(ranges[0][0]), "rb") as held:  # as the engine holds it while it reads
                for step in (1, 2):  # 1 retires step 0; 2 would overwrite its files
                    ck.save(step, state_of(step))
                    ck.wait()
                seen["bytes"] = held.read()
            seen["inode2"] = os.stat(os.path.join(ck.path(2), DATA)).st_ino
        return read_ranges_into(ranges, *args, **kwargs)

    monkeypatch.setattr(reading._core, "read_ranges_into", saves_then_read)
    try:
        state = fp.load(ck.path(0), verify=False, config=config(backend))
        assert digests(state) == digests(state_of(0))  # the retired step's files were still there
    except fp.CheckpointNotFoundError:
        pass  # or its recycle entry was freed before the read: nothing of it is returned
    monkeypatch.undo()
    assert seen["bytes"] == bytes0  # before the fix: step 2's bytes, written over step 0's
    assert seen["inode2"] != inode0
    for step in (3, 4):  # with no reader, step 4 overwrites the files of step 2 (retired by 3)
        ck.save(step, state_of(step))
    ck.wait()
    assert os.stat(os.path.join(ck.path(4), DATA)).st_ino == seen["inode2"]
    assert digests(ck.load(4)) == digests(state_of(4))


class ForkServer:
    """tests/helpers/crash_worker.py's fork server (as in test_crash.py)."""

    def __init__(self) -> None:
        worker = os.path.join(HELPERS_DIR, "crash_worker.py")
        self.proc = subprocess.Popen(
            [sys.executable, worker], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ.copy()
        )

    def ask(self, *words: str) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(" ".join(words) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _every_checkpoint_dir(root: str) -> list[str]:
    """Every directory under `root` holding a manifest (recycle entries and leftovers included)."""
    return sorted(where for where, _, files in os.walk(root) if MANIFEST_NAME in files)


@pytest.mark.parametrize("worker", ["run_checkpointer", "run_device_checkpointer"])
def test_kill_9_during_saves_on_a_memory_root_keeps_the_previous_step(shm_root: str, worker: str) -> None:
    # run_device_checkpointer's weights are staged by a fake copy engine straight into the
    # step's data file (gpu/arenas.py: the file is the arena).
    marker = os.path.join(os.path.dirname(shm_root), "marker")
    open(marker, "wb").write(b"\0")
    rng = random.Random(int(os.environ.get("FASTPERSIST_TEST_SEED", "22")))
    server = ForkServer()
    newest, recycled_kills = -1, 0
    try:
        for kill in range(10):
            pid = server.ask(worker, shm_root, marker)
            with open(marker, "r+b") as f:
                mm = mmap.mmap(f.fileno(), 1)
                deadline = time.monotonic() + 20
                while mm[0] in (crash_worker.STARTING, crash_worker.IDLE) and time.monotonic() < deadline:
                    time.sleep(0.001)
                time.sleep(rng.uniform(0.05, 0.4))  # several saves in: recycled files are being overwritten
                recycled_kills += os.path.isdir(os.path.join(shm_root, RECYCLE_DIR))
                os.kill(pid, signal.SIGKILL)
                assert server.ask("wait", str(pid)) == signal.SIGKILL
                mm[0] = crash_worker.STARTING
                mm.close()
            context = f"kill {kill}"
            ck = fp.Checkpointer(shm_root, keep=2, config=crash_worker.config())
            # Whatever holds a manifest (a committed step; a temporary directory killed between its
            # manifest and its rename; a recycle entry killed before its manifest went) either
            # fails verification or holds exactly the state of the step it is named after.
            for path in _every_checkpoint_dir(shm_root):
                step = int(re.search(r"step-(\d+)", path).group(1))  # type: ignore[union-attr]
                try:
                    fp.verify(path)
                except (fp.FastPersistError, OSError):
                    continue
                assert digests(fp.load(path)) == digests(crash_worker.expected_state(step)), (context, path)
            step = ck.latest()
            assert step is not None and step >= newest, (context, step, newest)
            newest = step
            ck.clean()
            assert ck.latest() == newest
    finally:
        server.close()
    assert newest > 0 and recycled_kills > 0


def test_is_memory_fs_tells_tmpfs_from_disk(workdir: str) -> None:
    assert _core.is_memory_fs(SHM)
    assert not _core.is_memory_fs(workdir)
    with pytest.raises(OSError):
        _core.is_memory_fs(os.path.join(workdir, "missing"))
