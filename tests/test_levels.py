"""The partner level: 4 real gloo ranks as 2 simulated nodes of 2, each node its own root,
``replicas=1``; a node's root deleted, damaged copies, both backends (tests/levels_workers.py)."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

import levels_workers as w
from gloo import run_ranks

MODES = [pytest.param(False, id="replicated"), pytest.param(True, id="sharded")]


def _run(target: Any, workdir: str, *args: Any) -> list[dict[str, Any]]:
    for name in os.listdir(workdir):
        if name.startswith(("result-", "error-", "init-store")):
            os.remove(os.path.join(workdir, name))
    results = run_ranks(target, 4, (workdir, *args), workdir, timeout_s=120)
    for rank, r in enumerate(results):
        assert "traceback" not in r, f"rank {rank}: {r}"
    return results


@pytest.mark.parametrize("sharded", MODES)
def test_a_node_lost_loses_no_step(tmp_path: Any, sharded: bool) -> None:
    d = str(tmp_path)
    saved = _run(w.save_steps, d, sharded, [1, 2, 3])
    assert all(r["steps"] == [2, 3] for r in saved), saved
    restored = _run(w.restore, d, sharded)
    assert all(r == {"latest": 3, "step": 3, "same": True} for r in restored), restored
    shutil.rmtree(os.path.join(d, "node1"))
    restored = _run(w.restore, d, sharded)
    assert all(r == {"latest": 3, "step": 3, "same": True} for r in restored), restored
