"""Process death in the middle of a save: a real kill -9, and a normal exit with a save in flight."""

from __future__ import annotations

import collections
import mmap
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
import torch

import fastpersist as fp
from fastpersist.format.manifest import read_manifest
from fastpersist.format.ownership import write_owner
from fastpersist.tools import cli

import crash_worker
from budget import iterations

CHILD = textwrap.dedent(
    """
    import sys, torch, fastpersist as fp
    path, mode = sys.argv[1], sys.argv[2]
    state = {"w": torch.full((64 << 20,), 2.0), "step": 2}          # 256 MiB
    cfg = fp.Config(pool_bytes=16 << 20, chunk_bytes=1 << 20, queue_depth=2)
    fut = fp.save_async(state, path, config=cfg)
    print("started", flush=True)
    if mode == "hang":
        fut.wait_staged()
        import time; time.sleep(60)
    # mode "exit": return with the save in flight
    """
)


def _start(path: str, mode: str) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, path, mode], stdout=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "started"
    return child


def test_kill_9_mid_save_keeps_the_previous_checkpoint(workdir: str) -> None:
    path = os.path.join(workdir, "ckpt")
    fp.save({"w": torch.full((10,), 1.0), "step": 1}, path)
    seen = set()
    for delay in (0.02, 0.3):
        child = _start(path, "hang")
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait()
        state = fp.load(path)  # old or new, never a mix; always verifiable
        fp.verify(path)
        assert state["step"] in (1, 2)
        assert torch.equal(state["w"], torch.full(state["w"].shape, float(state["step"])))
        seen.add(state["step"])
    # A kill 20 ms in lands mid-write (256 MiB through a 16 MiB pool takes longer), so the old
    # checkpoint must have survived it at least once.
    assert 1 in seen


def test_exit_with_a_save_in_flight_commits_it_whole(workdir: str) -> None:
    path = os.path.join(workdir, "ckpt")
    child = _start(path, "exit")
    assert child.wait(timeout=120) == 0
    fp.verify(path)
    state = fp.load(path)
    assert state["step"] == 2 and bool((state["w"] == 2.0).all())
    assert not [n for n in os.listdir(workdir) if ".fptmp-" in n]


# ----------------------------------------------------------------------------- the kill -9 campaign

#: Kills per campaign: 40 and 12 in CI, scaled by the soak profile, or set (tests/helpers/budget.py).
KILLS = iterations("FASTPERSIST_CRASH_KILLS", 40)
PLAIN_KILLS = iterations("FASTPERSIST_CRASH_PLAIN_KILLS", 12)
SEED = int(os.environ.get("FASTPERSIST_TEST_SEED", random.SystemRandom().randrange(1 << 32)))


class ForkServer:
    """tests/helpers/crash_worker.py's fork server: children fork with torch and fastpersist already imported."""

    def __init__(self) -> None:
        worker = os.path.abspath(crash_worker.__file__)
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


@pytest.fixture(scope="module")
def forkserver() -> Iterator[ForkServer]:
    server = ForkServer()
    yield server
    server.close()


def _kill_at(server: ForkServer, pid: int, marker: str, phase: int | None, delay_s: float) -> int:
    """Waits for `phase` (or `delay_s` of running), SIGKILLs the child, returns the phase it died in."""
    with open(marker, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 1)
        deadline = time.monotonic() + 10
        while mm[0] == crash_worker.STARTING and time.monotonic() < deadline:
            time.sleep(0.001)
        start = time.monotonic()
        if phase is not None:
            while mm[0] != phase and time.monotonic() - start < 2:
                pass
        time.sleep(delay_s)
        os.kill(pid, signal.SIGKILL)
        assert server.ask("wait", str(pid)) == signal.SIGKILL
        died_in = mm[0]
        mm[0] = crash_worker.STARTING
        mm.close()
    return died_in


def _leftovers(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if ".fptmp-" in n or ".tmp-" in n)


@pytest.mark.parametrize("worker", ["run_checkpointer", "run_incremental_checkpointer", "run_device_checkpointer"])
def test_kill_9_at_random_moments_never_loses_the_newest_committed_step(
    workdir: str, forkserver: ForkServer, worker: str
) -> None:
    # run_device_checkpointer stages the weights through the arena with a fake copy engine.
    root, marker = os.path.join(workdir, "run"), os.path.join(workdir, "marker")
    open(marker, "wb").write(b"\0")
    rng = random.Random(SEED)
    kills = KILLS if worker == "run_checkpointer" else max(8, KILLS // 3)
    expected = (
        crash_worker.incremental_state if worker == "run_incremental_checkpointer" else crash_worker.expected_state
    )
    died_in: collections.Counter[str] = collections.Counter()
    newest = -1
    cleaned = linked = 0
    for kill in range(kills):
        # Half aimed at each phase in turn (plus a random 0-2 ms), half at a random moment.
        aimed = kill % 2 == 0
        phase = 2 + (kill // 2) % 5 if aimed else None
        pid = forkserver.ask(worker, root, marker)
        at = _kill_at(forkserver, pid, marker, phase, rng.uniform(0, 0.002) if aimed else rng.uniform(0, 0.3))
        died_in[crash_worker.PHASES[at]] += 1
        context = f"seed {SEED}, kill {kill} in phase {crash_worker.PHASES[at]}"
        left = _leftovers(root)
        ck = fp.Checkpointer(root, keep=2, config=crash_worker.config())
        removed = ck.clean()  # what the next run's first save does
        cleaned += len(left)
        assert _leftovers(root) == [], context
        assert {os.path.basename(p) for p in removed} >= {n for n in left if ".fptmp-" in n}, context
        step = ck.latest()
        if step is None:
            assert newest == -1, f"{context}: step {newest} was committed and is gone"
            continue
        assert step >= newest, f"{context}: latest() went back from {newest} to {step}"
        newest = step
        fp.verify(ck.path(step))
        assert_same(ck.load(step), expected(step))
        linked += read_manifest(ck.path(step)).format_version[0] == 2  # an incremental step
    print(
        f"\nkill -9 campaign {worker} (seed {SEED}): {kills} kills survived, died in {dict(died_in)}, "
        f"{cleaned} leftovers cleaned, newest step {newest}"
    )
    assert newest > 0
    assert linked > 0 or worker != "run_incremental_checkpointer"
    phases = {p for p, n in died_in.items() if n and p not in ("starting", "idle")}
    if worker != "run_device_checkpointer":
        assert len(phases) >= 4, died_in
    else:
        # A GPU state's Checkpointer stages each step while the disk writes the one before
        # (saving/in_flight.py): the loop marks "staging" for every snapshot, so the marker
        # seldom shows the background commit's phases. Kills in staging and in the commit
        # (writing, manifest, rename or the index) are what this campaign needs.
        assert "staging" in phases and len(phases) >= 2, died_in


def test_kill_9_during_plain_saves_then_clean_removes_every_leftover(workdir: str, forkserver: ForkServer) -> None:
    root, marker = os.path.join(workdir, "plain"), os.path.join(workdir, "marker")
    stripes = [os.path.join(workdir, f"ssd{i}") for i in range(2)]
    for d in (root, *stripes):
        os.makedirs(d)
    open(marker, "wb").write(b"\0")
    path = os.path.join(root, "ck")
    fp.save(crash_worker.expected_state(1), path, config=crash_worker.config(stripes))
    rng = random.Random(SEED + 1)
    removed = 0
    for _ in range(PLAIN_KILLS):
        pid = forkserver.ask("run_plain_saves", path, marker, *stripes)
        _kill_at(forkserver, pid, marker, None, rng.uniform(0, 0.25))
        state = fp.load(path)  # the old checkpoint or a new one, whole
        fp.verify(path)
        assert_same(state, crash_worker.expected_state(state["opt"]["step"]))
        assert cli.main(["clean", root, "--stripes", *stripes]) == 0
        named = {os.path.basename(d) for d in read_manifest(path).stripes}
        on_disk = {n for s in stripes for n in os.listdir(s)}
        assert os.listdir(root) == ["ck"] and on_disk == named, (os.listdir(root), on_disk, named)
        removed += 1
    print(f"\nplain-save kills: {removed} survived; clean left only the committed checkpoint")


def assert_same(a: object, b: object) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


def test_clean_dry_run_lists_and_clean_removes_only_leftovers(workdir: str) -> None:
    root, ssd = os.path.join(workdir, "root"), os.path.join(workdir, "ssd")
    os.makedirs(ssd)
    path = os.path.join(root, "ck")
    os.makedirs(root)
    fp.save({"w": torch.ones(3)}, path, config=fp.Config(stripes=[ssd]))
    kept = set(os.listdir(ssd))
    tmp = os.path.join(root, ".ck.fptmp-0123456789ab")
    # Provable leftovers: one of the dead temporary directory's save (no marker yet), one whose
    # marker names root/ck under an id that is not the committed one.
    orphans = [os.path.join(ssd, "ck.0123456789ab.fpstripe"), os.path.join(ssd, "ck.ba9876543210.w1.fpstripe")]
    for d in (tmp, *orphans):
        os.makedirs(d)
    write_owner(orphans[1], path, "ba9876543210" + "0" * 20, durable=False)
    # Not provably ours: no marker and no dead save of that id; a marker naming another root.
    unproven = os.path.join(ssd, "ck.cafe0000cafe.fpstripe")
    foreign = os.path.join(ssd, "ck.beef0000beef.fpstripe")
    for d in (unproven, foreign):
        os.makedirs(d)
    write_owner(foreign, os.path.join(workdir, "other-root", "ck"), "beef0000beef" + "0" * 20, durable=False)
    expected = sorted([tmp, *orphans])
    assert sorted(fp.clean(root, stripes=[ssd], dry_run=True)) == expected
    assert os.path.isdir(tmp) and all(os.path.isdir(d) for d in orphans)
    assert sorted(fp.clean(root, stripes=[ssd])) == expected
    assert set(os.listdir(ssd)) == kept | {os.path.basename(unproven), os.path.basename(foreign)}
    assert os.listdir(root) == ["ck"]
    assert fp.load(path)["w"].sum() == 3
