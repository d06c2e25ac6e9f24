"""``fastpersist inspect ROOT``: a Checkpointer root's steps and levels (own shares vs partner copies)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

import fastpersist as fp
from fastpersist.format.layout import shard_name, step_dir_name
from fastpersist.format.manifest import read_manifest
from fastpersist.tools import cli

MODES = [pytest.param(False, id="replicated"), pytest.param(True, id="sharded")]


def _partner_roots(workdir: str, sharded: bool) -> None:
    """node0/ and node1/: steps 1 and 2 saved by 4 ranks as 2 simulated nodes with replicas=1."""
    import inspect_workers as w
    from gloo import run_ranks

    results = run_ranks(w.save_steps, 4, (workdir, sharded, [1, 2]), workdir, timeout_s=120)
    for rank, r in enumerate(results):
        assert "traceback" not in r, f"rank {rank}: {r}"


def _inspect(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert cli.main(["inspect", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def _a_file_of(step_dir: str, share: int, sharded: bool) -> str:
    if sharded:
        shard = os.path.join(step_dir, shard_name(share))
        return os.path.join(shard, read_manifest(shard).files[0].name)
    m = read_manifest(step_dir)
    return os.path.join(step_dir, next(f.name for f in m.files if f.writer == share))


@pytest.mark.parametrize("sharded", MODES)
def test_a_partner_root_shows_own_shares_and_copies(
    workdir: str, sharded: bool, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FASTPERSIST_NODE", raising=False)
    _partner_roots(workdir, sharded)
    node0, node1 = os.path.join(workdir, "node0"), os.path.join(workdir, "node1")
    info = _inspect(capsys, node0, "--node", "node0")
    assert [s["step"] for s in info["steps"]] == [1, 2] and info["index_step"] == 2
    step = info["steps"][1]
    assert step["replicas"] == 1 and step["sharded"] is sharded and step["nodes"] == ["node0", "node1"]
    assert step["checkpoint_id"] == read_manifest(os.path.join(node0, step_dir_name(2))).checkpoint_id
    kinds = {s["owner_rank"]: (s["kind"], s["present"]) for s in step["shares"]}
    assert kinds == {0: ("own", True), 1: ("own", True), 2: ("copy", True), 3: ("copy", True)}
    own = sum(s["bytes"] for s in step["shares"] if s["kind"] == "own")
    assert info["levels"]["local"]["steps"] == [1, 2] and info["levels"]["partner"]["steps"] == [1, 2]
    assert "unknown" not in info["levels"]
    assert step["bytes_here"] == sum(s["bytes"] for s in step["shares"]) > own > 0

    # Two nodes and replicas=1: each node holds every share, so the root alone does not say whose it is.
    info = _inspect(capsys, node1)
    assert info["steps"][1]["node"] is None and {s["kind"] for s in info["steps"][1]["shares"]} == {"?"}
    assert info["levels"]["unknown"]["steps"] == [1, 2] and info["levels"]["local"]["steps"] == []
    monkeypatch.setenv("FASTPERSIST_NODE", "node1")
    info = _inspect(capsys, node1)
    assert info["steps"][1]["node"] == "node1"

    # node1's copy of rank 0's share of step 2 loses a file: shown missing, the rest still present.
    os.remove(_a_file_of(os.path.join(node1, step_dir_name(2)), 0, sharded))
    shares = _inspect(capsys, node1)["steps"][1]["shares"]
    first = shares[0]
    assert (first["owner_rank"], first["kind"], first["present"]) == (0, "copy", False)
    assert all(s["present"] for s in shares[1:]) and shares[0]["problem"]

    assert cli.main(["inspect", node1]) == 0
    out = capsys.readouterr().out
    assert "Checkpointer root, 2 step(s), index names step 2" in out
    assert "replicas=1 over nodes node0, node1" in out and "this root is node node1" in out
    assert "share 0 of rank 0 (node node0): copy, missing" in out
    assert "level partner: steps 1, 2" in out


def test_a_plain_root_lists_its_steps_and_a_checkpoint_is_still_a_checkpoint(
    workdir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = os.path.join(workdir, "run")
    with fp.Checkpointer(root, keep=2) as ck:
        for step in (5, 6, 7):
            ck.save(step, {"w": torch.ones(1000) * step, "step": step})
            ck.wait()
    info = _inspect(capsys, root)
    assert [(s["step"], s["replicas"], s["indexed"]) for s in info["steps"]] == [(6, 0, False), (7, 0, True)]
    assert all(s["bytes_here"] >= 4000 for s in info["steps"])
    assert info["levels"]["local"]["steps"] == [6, 7] and info["levels"]["partner"]["steps"] == []
    assert cli.main(["inspect", root]) == 0
    out = capsys.readouterr().out
    assert "step 7 (indexed: latest)" in out and "no replicas" in out
    assert cli.main(["inspect", ck.path(7)]) == 0  # a checkpoint: described from its manifest, as before
    assert "1 tensors" in capsys.readouterr().out
    os.makedirs(os.path.join(root, step_dir_name(9)))  # a step directory without a manifest
    info = _inspect(capsys, root)
    assert info["steps"][-1]["step"] == 9 and info["steps"][-1]["committed"] is False
    assert info["steps"][-1]["above_index"] is True
