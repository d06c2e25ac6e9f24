"""Real torch.distributed process groups (gloo, several local processes)."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest
import torch

import fastpersist as fp

from dist_workers import make_state, run, same
from gloo import run_ranks


def run_group(world: int, scenario: str, workdir: str, backend: str, timeout_s: float = 120) -> list[dict[str, Any]]:
    """Runs `scenario` on `world` spawned ranks; returns each rank's result (or its traceback)."""
    return run_ranks(run, world, (scenario, workdir, backend), workdir, timeout_s)


def stream_bytes(path: str) -> int:
    return int(fp.inspect(path)["total_bytes"])


@pytest.mark.parametrize("world", [2, 4])
def test_replicated_each_rank_writes_its_share(workdir: str, backend: str, world: int) -> None:
    results = run_group(world, "replicated", workdir, backend)
    for r, res in enumerate(results):
        assert "traceback" not in res, res
        assert res["same"] and res["async_same"] and res["ck_same"], f"rank {r}"
        assert res["latest"] == 2
        for f in res["files"]:
            assert f.startswith(os.path.join(workdir, f"rank{r}-ssd")), "each rank writes to its own stripes"
    path = os.path.join(workdir, "ckpt")
    total = stream_bytes(path)
    chunk = 64 << 10
    shares = [res["nbytes"] for res in results]
    assert sum(shares) == total
    assert max(shares) - min(shares) <= chunk, shares  # ~1/N each, balanced within one chunk
    assert same(make_state(7), fp.load(path)), "a single process without a group loads it"
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    assert {f["writer"] for f in manifest["files"]} == set(range(world))
    run = sorted(os.listdir(os.path.join(workdir, "run")))
    assert run == ["history.json", "latest.json", "step-00000001", "step-00000002"]  # history: rank 0's costs, wear


def test_one_writer_per_node(workdir: str) -> None:
    results = run_group(2, "writers_node", workdir, "threads")
    assert [r["nbytes"] for r in results][1] == 0
    assert results[0]["nbytes"] == stream_bytes(os.path.join(workdir, "node"))


def test_a_device_state_saves_through_each_ranks_arena(workdir: str, backend: str) -> None:
    results = run_group(2, "device_group", workdir, backend)
    expected = {"same": True, "shard_same": True, "steps": [1, 2], "ck_same": True, "mem": [[3], True, True]}
    assert results == [expected] * 2, results


def test_a_group_skips_a_device_step_while_any_rank_still_writes(workdir: str, backend: str) -> None:
    results = run_group(2, "device_group_skips", workdir, backend)
    assert all("device" in r for r in results), results
    for r in results:
        assert r["device"]["returned"] == [True, False, False, True], r
        assert r["device"]["steps"] == [0, 3] and r["device"]["same"], r
        assert r["device"]["levels"]["local"]["steps"] == [0, 3], r
        assert r["host"]["returned"] == [True, True, True, True], r
        assert r["host"]["steps"] == [1, 2, 3] and r["host"]["same"], r


def test_sharded_round_trip_per_rank(workdir: str, backend: str) -> None:
    results = run_group(2, "sharded", workdir, backend)
    assert all(r.get("same") for r in results), results
    path = os.path.join(workdir, "sharded")
    for r in range(2):
        assert same(make_state(100 + r, tensors=3 + r), fp.load(path, shard=r))
    with pytest.raises(ValueError, match="sharded over 2 ranks"):
        fp.load(path)
    assert fp.verify(path)["files"] == 2
    assert fp.inspect(path)["tensors"] == sum(
        len(fp.inspect(os.path.join(path, s))["tensor_list"]) for s in ["shard-00000", "shard-00001"]
    )


def test_a_failing_rank_fails_every_rank_and_commits_nothing(workdir: str) -> None:
    results = run_group(2, "failing_rank", workdir, "threads")
    assert "UnsupportedValueError" in results[1]["error"]
    assert "GroupSaveError" in results[0]["error"] and "rank 1" in results[0]["error"]
    assert results[0]["group_error"]  # fp.GroupSaveError, a FastPersistError
    assert all(r["previous_ok"] and r["elapsed"] < 30 for r in results), results
    assert not [n for n in os.listdir(workdir) if ".fptmp-" in n]


def test_a_torn_share_on_one_rank_commits_nothing_anywhere(workdir: str, backend: str) -> None:
    results = run_group(2, "torn_rank", workdir, backend)
    assert "SaveCancelledError" in results[1]["staged_error"]
    assert results[1]["error"] == results[1]["staged_error"]  # the same verdict
    assert "GroupSaveError" in results[0]["error"] and "rank 1" in results[0]["error"]
    assert all(r["previous_ok"] for r in results), results
    assert not [n for n in os.listdir(workdir) if ".fptmp-" in n or n.endswith(".fpstripe")]


def test_a_killed_rank_makes_the_others_raise_in_bounded_time(workdir: str) -> None:
    results = run_group(2, "killed_rank", workdir, "threads", timeout_s=60)
    assert results[1].get("exitcode") == 3
    assert "GroupSaveError" in results[0]["error"], results[0]
    assert results[0]["elapsed"] < 5.0 + 10, results[0]
    assert results[0]["previous_ok"]
    assert same(make_state(1), fp.load(os.path.join(workdir, "ckpt")))


def test_a_rank_killed_between_every_step_saves_fails_the_next_agreement_at_once(workdir: str) -> None:
    results = run_group(2, "killed_at_agreement", workdir, "threads", timeout_s=60)
    assert results[1].get("exitcode") == 3
    error = results[0]["error"]
    assert "GroupSaveError" in error and "agree whether step 1 is saved" in error, results[0]
    assert results[0]["elapsed"] < 15, results[0]  # not timeout_s=60
    assert results[0]["steps"] == [0], results[0]


def test_a_hung_rank_makes_the_others_raise_after_the_timeout(workdir: str) -> None:
    results = run_group(2, "hung_rank", workdir, "threads", timeout_s=90)
    assert "GroupSaveError" in results[0]["error"] and "timeout_s=3.0" in results[0]["error"], results[0]
    assert 2.5 < results[0]["elapsed"] < 3.0 + 8, results[0]
    assert all(r.get("previous_ok") for r in results), results
    assert same(make_state(1), fp.load(os.path.join(workdir, "ckpt")))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_enospc_on_one_rank(workdir: str) -> None:
    tiny = os.path.join(workdir, "tiny")
    os.makedirs(tiny)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", tiny]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        results = run_group(2, "enospc_rank", workdir, "threads")
    finally:
        subprocess.run(["umount", "-l", tiny])
    assert "No space left" in results[1]["error"] or "ENOSPC" in results[1]["error"], results[1]
    assert "GroupSaveError" in results[0]["error"], results[0]
    assert all(r["previous_ok"] for r in results)


def test_writer_map() -> None:
    from fastpersist.distributed.control import writer_map

    assert writer_map(["a", "a", "b", "b"], "rank") == {0: 0, 1: 1, 2: 2, 3: 3}
    assert writer_map(["a", "a", "b", "b"], "node") == {0: 0, 2: 1}
    assert writer_map(["a", "a", "a", "b", "b", "b"], 2) == {0: 0, 1: 1, 3: 2, 4: 3}
    assert torch.distributed.is_available()
