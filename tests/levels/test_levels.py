"""The partner level: 4 real gloo ranks as 2 simulated nodes of 2, each node its own root,
``replicas=1``: a node's root deleted, damaged copies, a partner killed mid-copy, training
killed and resumed; replicated and sharded state, every backend (tests/helpers/levels_workers.py)."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest

import levels_workers as w
from backends import available_backends
from gloo import run_ranks

MODES = [pytest.param(False, id="replicated"), pytest.param(True, id="sharded")]
BACKENDS = available_backends()


def _clear(workdir: str) -> None:
    for name in os.listdir(workdir):
        if name.startswith(("result-", "error-", "init-store")):
            os.remove(os.path.join(workdir, name))


def _run(target: Any, workdir: str, *args: Any) -> list[dict[str, Any]]:
    _clear(workdir)
    results = run_ranks(target, 4, (workdir, *args), workdir, timeout_s=120)
    for rank, r in enumerate(results):
        assert "traceback" not in r, f"rank {rank}: {r}"
    return results


def _flip_a_byte(path: str, offset: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _data_files(step_dir: str) -> list[str]:
    found = []
    for dirpath, _, names in os.walk(step_dir):
        found += [os.path.join(dirpath, n) for n in names if n.endswith(".bin")]
    return sorted(found)


# Replicated on every backend; sharded on the first (the engine path is the same, the suite shorter).
@pytest.mark.parametrize(
    ("sharded", "backend"),
    [pytest.param(False, b, id=f"replicated-{b}") for b in BACKENDS]
    + [pytest.param(True, BACKENDS[0], id=f"sharded-{BACKENDS[0]}")],
)
def test_a_node_lost_loses_no_step(tmp_path: Any, sharded: bool, backend: str) -> None:
    d = str(tmp_path)
    saved = _run(w.save_steps, d, sharded, backend, [1, 2, 3])
    assert all(r["steps"] == [2, 3] for r in saved), saved
    for r in saved:  # each node holds its own ranks' shares (local) and its partner's (partner)
        assert r["levels"]["local"]["steps"] == [2, 3] and r["levels"]["partner"]["steps"] == [2, 3], r
    shutil.rmtree(os.path.join(d, "node1"))
    restored = _run(w.restore, d, sharded, backend)
    assert all(r == {"latest": 3, "step": 3, "same": True} for r in restored), restored
    # The replaced node is refilled by the next save, and every rank reads its own again.
    _run(w.save_steps, d, sharded, backend, [4])
    assert sorted(os.listdir(os.path.join(d, "node1"))).count("step-00000004") == 1
    restored = _run(w.restore, d, sharded, backend)
    assert all(r == {"latest": 4, "step": 4, "same": True} for r in restored), restored


@pytest.mark.parametrize("sharded", MODES)
def test_a_device_state_is_kept_on_a_partner_and_restored_after_a_node_loss(tmp_path: Any, sharded: bool) -> None:
    d = str(tmp_path)
    saved = _run(w.save_device_steps, d, sharded, BACKENDS[0], [1, 2, 3])
    for r in saved:
        assert r["from_device"] and r["steps"] == [2, 3], r
        assert r["levels"]["local"]["steps"] == [2, 3] and r["levels"]["partner"]["steps"] == [2, 3], r
    shutil.rmtree(os.path.join(d, "node1"))
    restored = _run(w.restore, d, sharded, BACKENDS[0])
    assert all(r == {"latest": 3, "step": 3, "same": True} for r in restored), restored


def test_a_state_of_fewer_chunks_than_writers_is_restored(tmp_path: Any) -> None:
    """Two writers get no bytes (a 4 KiB stream, 64 KiB chunks, 4 writers): their shares are empty, not missing."""
    d = str(tmp_path)
    _run(w.save_steps, d, False, "threads", [1], 1000)
    shutil.rmtree(os.path.join(d, "node1"))
    restored = _run(w.restore, d, False, "threads", 1000)
    assert all(r == {"latest": 1, "step": 1, "same": True} for r in restored), restored


@pytest.mark.parametrize("sharded", MODES)
def test_load_out_fills_in_place_from_a_partner_copy(tmp_path: Any, sharded: bool) -> None:
    d = str(tmp_path)
    _run(w.save_steps, d, sharded, "threads", [1, 2])
    shutil.rmtree(os.path.join(d, "node1"))
    restored = _run(w.restore_into, d, sharded)
    want = {"refused_untouched": True, "in_place": True, "same": True, "step": 2}
    assert all(r == want for r in restored), restored


@pytest.mark.parametrize("sharded", MODES)
def test_a_damaged_copy_is_passed_over(tmp_path: Any, sharded: bool) -> None:
    d = str(tmp_path)
    _run(w.save_steps, d, sharded, "threads", [1, 2])
    # Node 0's copy of every file of step 2 is damaged: its ranks' shares come from node 1's copies.
    for path in _data_files(os.path.join(d, "node0", "step-00000002")):
        _flip_a_byte(path)
    restored = _run(w.restore, d, sharded, "threads")
    assert all(r == {"latest": 2, "step": 2, "same": True} for r in restored), restored
    # Both copies of something damaged: no copy of step 2 verifies, so step 1 is restored.
    for path in _data_files(os.path.join(d, "node1", "step-00000002"))[:1]:
        _flip_a_byte(path)
    restored = _run(w.restore, d, sharded, "threads")
    assert all(r == {"latest": 1, "step": 1, "same": True} for r in restored), restored


@pytest.mark.parametrize("differ", [pytest.param(False, id="same-state"), pytest.param(True, id="differing-state")])
def test_replicated_copies_are_made_from_each_partners_own_state(tmp_path: Any, differ: bool) -> None:
    """Replicated state: each partner writes its copies from its own (identical) state, so no
    share crosses the group; where a rank's state differs, its copies fail the owner's chunk
    checksums and are sent instead. Either way node1 alone restores what both nodes held."""
    d = str(tmp_path)
    saved = _run(w.save_replicated_counting_transfers, d, differ, BACKENDS[0])
    assert [r["transfers"] for r in saved] == [[4 if differ else 0]] * 4, saved
    assert len({r["digest"] for r in saved}) == 1, saved
    shutil.rmtree(os.path.join(d, "node0"))
    restored = _run(w.restore_digest, d, BACKENDS[0])
    assert all(r == {"latest": 1, "digest": saved[0]["digest"]} for r in restored), restored


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_killed_during_a_restore_hangs_no_one(tmp_path: Any, backend: str) -> None:
    """A rank killed at its first broadcast of a partner-level restore's bytes, the survivors
    staying alive after they raise: gloo lets some survivors wait on others that already left the
    broadcasts (before the fix: 60 s, the whole timeout_s); the control group's watch connections
    tell every survivor at once, so each raises within seconds (repro 32)."""
    d = str(tmp_path)
    _run(w.save_steps, d, False, backend, [1])
    _clear(d)
    results = run_ranks(w.restore_with_a_rank_killed, 4, (d, backend, 3, 1), d, timeout_s=120)
    assert results[3]["exitcode"] == -9, results[3]
    for r in results[:3]:
        assert "GroupLoadError" in r["outcome"], r
        assert r["seconds"] < w.RESTORE_KILLED_BOUND_S < r["timeout_s"], r


@pytest.mark.parametrize("sharded", MODES)
def test_a_partner_killed_mid_copy_commits_nothing_and_hangs_no_one(tmp_path: Any, sharded: bool) -> None:
    d = str(tmp_path)
    _clear(d)
    results = run_ranks(w.save_with_a_partner_killed, 4, (d, sharded, "threads", 3), d, timeout_s=120)
    assert results[3]["exitcode"] == -9, results[3]
    for rank in range(3):
        r = results[rank]
        assert "GroupSaveError" in r["outcome"], r
        assert 3 not in r["steps"], r
    restored = _run(w.restore, d, sharded, "threads")
    assert all(r == {"latest": 2, "step": 2, "same": True} for r in restored), restored


@pytest.mark.parametrize("sharded", MODES)
def test_training_killed_and_a_node_replaced_resumes_exactly(tmp_path: Any, sharded: bool) -> None:
    d = str(tmp_path)
    _clear(d)
    killed = run_ranks(w.train, 4, (d, sharded, "auto", 5, True), d, timeout_s=180)
    assert all(r["start"] == 0 and len(r["losses"]) == 5 for r in killed), killed  # then SIGKILLed
    shutil.rmtree(os.path.join(d, "node1"))
    resumed = _run(w.train, d, sharded, "auto", 8, False)
    for rank, r in enumerate(resumed):
        losses, final = w.reference(1 + (rank if sharded else 0), 8)
        assert 4 <= r["start"] <= 5, r  # step 5 was in flight when the ranks were killed
        assert r["losses"] == losses[r["start"] :], (rank, r)
        assert r["digest"] == final, rank


def test_kill_9_at_random_moments_never_restores_a_wrong_state(tmp_path: Any) -> None:
    """Two nodes of one rank save step after step and are SIGKILLed at random moments, 30 times
    (alternately replicated and sharded roots); each restart restores, checks and reports the
    newest step before saving on: never a state that verifies but differs, never a step lost."""
    import multiprocessing
    import random
    import signal
    import sys
    import time

    from gloo import HELPERS_DIR

    if HELPERS_DIR not in sys.path:
        sys.path.insert(0, HELPERS_DIR)
    ctx = multiprocessing.get_context("spawn")
    rng = random.Random(2207)
    runs = int(os.environ.get("FASTPERSIST_KILL_RUNS", "30"))
    newest = {False: 0, True: 0}
    for run in range(runs + 2):
        sharded = bool(run % 2)
        d = str(tmp_path / ("sharded" if sharded else "replicated"))
        os.makedirs(d, exist_ok=True)
        _clear(d)
        init = os.path.join(d, f"init-store-{run}")
        procs = [ctx.Process(target=w.campaign_run, args=(r, 2, init, d, sharded)) for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 120
        results = [os.path.join(d, f"result-{r}.json") for r in range(2)]
        while not all(os.path.exists(p) for p in results):
            assert time.monotonic() < deadline and all(p.is_alive() for p in procs), f"run {run}: no restore report"
            time.sleep(0.05)
        reports = [json.load(open(p)) for p in results]
        assert reports[0] == reports[1] and reports[0]["same"], (run, reports)
        latest = reports[0]["latest"] or 0
        assert latest >= newest[sharded], (run, latest, newest)  # a committed step is never lost
        newest[sharded] = latest
        if run >= runs:
            assert latest > 0
        time.sleep(rng.uniform(0.0, 1.5))
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.join(30)


@pytest.mark.parametrize(("replicas", "stripes", "says"), [(2, False, "needs at least 3 nodes"), (1, True, "stripes")])
def test_what_the_partner_level_refuses_it_refuses_on_every_rank(
    tmp_path: Any, replicas: int, stripes: bool, says: str
) -> None:
    results = _run(w.refused, str(tmp_path), replicas, stripes)
    assert all(says in r["error"] and r["steps"] == [] for r in results), results


def test_arguments_are_checked() -> None:
    import fastpersist as fp

    with pytest.raises(ValueError, match=r"Partner\(replicas=1\): needs the Checkpointer's group="):
        fp.Checkpointer("/tmp/fp-levels-args", levels=[fp.Partner(replicas=1)])
    with pytest.raises(ValueError, match=r"Partner\(replicas=-1\)"):
        fp.Partner(replicas=-1)


def test_placement_is_a_ring_over_nodes_never_on_the_same_node() -> None:
    from fastpersist.distributed.placement import Placement

    p = Placement(["a", "a", "a", "b", "c", "c"])
    for replicas in (1, 2):
        for rank in range(6):
            nodes = [p.node_of(rank)] + [p.node_of(q) for q in p.partners(rank, replicas)]
            assert len(set(nodes)) == replicas + 1, (rank, replicas, nodes)
    assert p.partners(0, 2) == [3, 4] and p.partners(3, 1) == [4] and p.partners(5, 1) == [1]
    assert sorted(q for r in range(6) for q in p.sources(r, 1)) == list(range(6))  # each share kept once
    with pytest.raises(ValueError, match="needs at least 4 nodes"):
        p.check_replicas(3)


def test_candidates_need_every_share_under_one_id_and_stop_at_the_newest_index() -> None:
    from fastpersist.levels.partner_restore import NodeReport, StepReport, candidates

    reports = [
        NodeReport(0, 3, [StepReport(2, "x", 2, (0, 1), (0, 1)), StepReport(3, "y", 2, (0,), (0, 1))]),
        NodeReport(1, None, [StepReport(3, "y", 2, (1,), (0, 1)), StepReport(4, "z", 2, (0, 1), (0, 1))]),
    ]
    found = candidates(reports)
    assert [(c.step, c.checkpoint_id) for c in found] == [(3, "y"), (2, "x")]  # 4 is past every index
    assert found[0].holders == {0: [0], 1: [1]} and found[1].holders == {0: [0], 1: [0]}
    reports[1].steps[0] = StepReport(3, "other", 2, (1,), (0, 1))  # two saves of step 3: neither complete
    assert [c.step for c in candidates(reports)] == [2]


def test_a_memory_root_per_node_survives_a_node_and_stays_bounded() -> None:
    """Each node's root under /dev/shm (the in-memory level) with replicas=1: six saves hold at
    most keep + 1 steps of memory per node, and a node's memory lost is restored from its partner."""
    d = f"/dev/shm/fp-levels-test-{os.getpid()}"
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    try:
        _run(w.save_steps, d, False, "auto", [1, 2, 3, 4, 5, 6])
        for node in ("node0", "node1"):
            used = sum(
                os.path.getsize(os.path.join(p, n)) for p, _, names in os.walk(os.path.join(d, node)) for n in names
            )
            assert used <= 3 * 300_000, (node, used)  # a step's stream is ~281 KB on each node
        shutil.rmtree(os.path.join(d, "node0"))
        restored = _run(w.restore, d, False, "auto")
        assert all(r == {"latest": 6, "step": 6, "same": True} for r in restored), restored
    finally:
        shutil.rmtree(d, ignore_errors=True)
