"""The Checkpointer's whole configuration matrix on real gloo ranks, on every backend.

{replicated, sharded} x {no stripes, stripes shared by the ranks, per-rank stripes} x {host
tensors, device tensors staged through the arena (a fake copy engine)} x {first run, restart
with a new Checkpointer}, ``keep=2`` over 3 steps and then 2 more: every step that is
kept loads bit-identically, exactly ``keep`` steps remain, no stripe directory a manifest names
is missing, and none that no manifest names is left behind (issue: a sharded Checkpointer with
stripes lost every checkpoint it committed).
"""

from __future__ import annotations

from typing import Any

import pytest

from gloo import run_ranks
from matrix_workers import KEEP, MODES, SOURCES, STRIPES, run

WORLD = 2


@pytest.fixture(scope="module", params=["io_uring", "threads"])
def matrix(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from backends import available_backends

    if request.param not in available_backends():
        pytest.skip(f"{request.param} is not available here")
    workdir = str(tmp_path_factory.mktemp(f"matrix-{request.param}"))
    results = run_ranks(run, WORLD, (workdir, request.param), workdir, timeout_s=300)
    for rank, res in enumerate(results):
        assert "traceback" not in res, f"rank {rank}: {res}"
    return results


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stripes", STRIPES)
def test_every_configuration_keeps_what_it_committed(
    matrix: list[dict[str, Any]], mode: str, stripes: str, source: str
) -> None:
    for rank, results in enumerate(matrix):
        res = results[f"{mode}/{stripes}/{source}"]
        where = f"{mode}, stripes {stripes}, {source} tensors, rank {rank}"
        assert res["committed"] == [1, 2, 3, 4, 5], where
        assert res["staged_from_device"] == (source == "device"), where
        first, restart = res["first"], res["restart"]
        assert first["steps"] == [2, 3] and first["latest"] == 3, (where, first)
        assert res["resumed"] == 3 and res["resumed_same"], (where, "the restart resumes the last step, bit-identical")
        assert restart["steps"] == [4, 5] and restart["latest"] == 5, (where, restart)
        for run_report in (first, restart):
            assert len(run_report["steps"]) == KEEP
            assert all(run_report["loads"].values()), (where, run_report["loads"])
            mine = set(run_report["on_disk"])
            referenced = set(run_report["referenced"])
            if stripes == "none":
                assert mine == set() and referenced == set(), where
                continue
            # What this rank's drives hold is exactly what the kept steps name there.
            on_my_drives = {p for p in referenced if p.rsplit("/", 1)[0] in run_report["roots"]}
            assert mine, (where, "the stripes were used")
            assert on_my_drives - mine == set(), (where, "a referenced stripe directory was removed")
            assert mine - referenced == set(), (where, "an unreferenced stripe directory was left behind")
