"""saving/commit.Commit: wait for every save, agree, publish, retire; the same sequence for
every host (the Trainer's rename, Accelerate's rotation), tested once here."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import fastpersist as fp
from fastpersist.saving.commit import Commit

from dist_workers import FailedSave, run
from gloo import run_ranks


def _futures(workdir: str, n: int) -> list[fp.SaveFuture]:
    return [fp.save_async({"w": torch.full((4096,), float(i))}, os.path.join(workdir, f"c{i}")) for i in range(n)]


def test_the_steps_run_in_order_and_return_the_results(workdir: str) -> None:
    ran: list[str] = []
    futures = _futures(workdir, 3)
    results = Commit(
        "ckpt",
        futures,
        prepare=lambda: ran.append("prepare"),
        durable=lambda rs: ran.append(f"durable {len(rs)}"),
        publish=lambda: ran.append("publish"),
        retire=lambda: ran.append("retire"),
        abandon=lambda: ran.append("abandon"),
    ).run()
    assert ran == ["prepare", "durable 3", "publish", "retire"]
    assert [r.path for r in results] == [f.path for f in futures]


def test_a_failed_save_cancels_the_others_waits_for_all_and_nothing_is_published(workdir: str) -> None:
    ran: list[str] = []
    futures: list[Any] = [FailedSave(os.path.join(workdir, "full")), *_futures(workdir, 3)]
    with pytest.raises(OSError, match="No space left"):
        Commit(
            "ckpt",
            futures,
            durable=lambda rs: ran.append("durable"),
            publish=lambda: ran.append("publish"),
            retire=lambda: ran.append("retire"),
            abandon=lambda: ran.append("abandon"),
        ).run()
    assert ran == ["abandon"]
    assert all(f.done() for f in futures)  # no save outlives the commit
    # each later save was cancelled before it committed, or had committed before the cancel
    for f in futures[1:]:
        assert f.cancelled() or os.path.exists(os.path.join(f.path, "manifest.json")), f.path


def test_a_failed_prepare_cancels_the_saves_and_raises_its_own_error(workdir: str) -> None:
    futures = _futures(workdir, 2)

    def prepare() -> None:
        raise OSError(28, "No space left on device", "weights")

    with pytest.raises(OSError, match="No space left"):
        Commit("ckpt", futures, prepare=prepare, publish=lambda: pytest.fail("published")).run()
    assert all(f.done() for f in futures)
    assert not any(os.path.exists(os.path.join(f.path, "manifest.json")) for f in futures if f.cancelled())


def test_a_publisher_that_fails_retires_nothing(workdir: str) -> None:
    def publish() -> None:
        raise PermissionError(13, "Permission denied", "latest")

    with pytest.raises(PermissionError):
        Commit("ckpt", _futures(workdir, 1), publish=publish, retire=lambda: pytest.fail("retired")).run()


@pytest.mark.slow
@pytest.mark.parametrize("fails", ["save", "publish"])
def test_in_a_group_every_rank_learns_of_a_failure_and_abandons(workdir: str, fails: str) -> None:
    results: list[dict[str, Any]] = run_ranks(run, 2, ("commit_with_a_failing_rank", workdir, fails), workdir)
    first, last = results
    if fails == "save":
        # rank 1's save failed: neither publishes, both abandon, rank 0 names rank 1
        assert first["ran"] == ["durable 1", "abandon"] and last["ran"] == ["abandon"]
        assert first["raised"].startswith("GroupSaveError") and "rank 1 failed" in first["raised"]
        assert last["raised"].startswith("OSError") and "No space left" in last["raised"]
    else:
        # rank 0's publish failed: nobody retires, rank 1 learns of it
        assert first["ran"] == ["durable 1", "publish", "abandon"] and last["ran"] == ["durable 1", "abandon"]
        assert first["raised"].startswith("OSError")
        assert "rank 0 failed to publish step-1 of rank 1" in last["raised"] and "was not committed" in last["raised"]
    assert first["done"] and last["done"]
