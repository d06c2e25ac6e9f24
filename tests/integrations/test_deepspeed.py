"""fastpersist's DeepSpeed checkpoint engine against the real DeepSpeed: 2 ranks on the CPU
accelerator over gloo, ZeRO stages 0 to 3, blocking and decoupled.

Each case saves through our engine, loads through DeepSpeed's ``load_checkpoint`` into an engine
with other initial weights, and resumes: the next steps' losses must equal the uninterrupted
run's, compared exactly. DeepSpeed's offline ``zero_to_fp32`` must read the files back to the
weights that were saved. A kill -9 during a save must leave ``latest`` naming the previous tag,
which loads and resumes exactly.

The first DeepSpeed run on a machine compiles DeepSpeed's shared-memory comm op with ninja
(about 90 s on two cores; cached in ~/.cache/torch_extensions afterwards).
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

if importlib.util.find_spec("deepspeed") is None:  # CI installs it: pip install '.[test]'
    pytest.skip("DeepSpeed is not installed (pip install '.[test]' installs it)", allow_module_level=True)

import torch

import deepspeed_workers as workers
from deepspeed_workers import SAVE_AFTER, STEPS, TAG_A, TAG_B
from gloo import HELPERS_DIR, REPO_DIR, run_ranks

pytestmark = pytest.mark.slow  # each case starts 2 or 4 DeepSpeed processes (a few seconds each to import)

#: Spawned ranks import DeepSpeed (several seconds) and, the first time, compile its comm op.
RANK_TIMEOUT_S = 400


def _ok(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for rank, res in enumerate(results):
        assert "traceback" not in res, f"rank {rank} failed:\n{res['traceback']}"
    return results


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_save_load_resume_is_exact(tmp_path: Any, stage: int) -> None:
    results = _ok(run_ranks(workers.run_save_load_resume, 2, (str(tmp_path), stage), str(tmp_path), RANK_TIMEOUT_S))
    for mode in ("sync", "decoupled"):
        save_dir = tmp_path / f"ckpt-{mode}"
        for rank, res in enumerate(results):
            case = res[mode]
            assert case["checkpoint_engine"] == "FastPersistCheckpointEngine"
            assert len(case["losses"]) == STEPS
            assert case["resumed"] == case["losses"][SAVE_AFTER:], (mode, rank)  # bit for bit
            assert os.path.basename(os.path.dirname(case["load_path"])) == TAG_A
            assert case["latest"] == TAG_A
            # Blocking: `latest` is written in save_checkpoint; decoupled: only at the commit in step().
            assert case["latest_before_commit"] == (TAG_A if mode == "sync" else None), mode
        if stage > 0:
            assert results[0][mode]["zero_to_fp32_exact"], mode
        names = sorted(os.listdir(save_dir / TAG_A))
        assert "mp_rank_00_model_states.pt" in names or "zero_pp_rank_0_mp_rank_00_model_states.pt" in names, names
        assert not [n for n in names if ".fptmp-" in n], names  # every file committed, none left half-done
        assert (save_dir / "latest").read_text() == TAG_A


def _run_until_killed(target: Any, world: int, args: tuple[Any, ...], workdir: str, grace_s: float = 20) -> list[int]:
    """Runs ``target`` on `world` ranks until one is killed (SIGKILL); the ranks still alive
    `grace_s` later (blocked on the dead one in DeepSpeed's own collectives) are killed too.
    Returns each rank's exit code."""
    ctx = multiprocessing.get_context("spawn")
    if HELPERS_DIR not in sys.path:
        sys.path.insert(0, HELPERS_DIR)
    init_file = os.path.join(workdir, "init-store-kill")
    procs = [ctx.Process(target=target, args=(r, world, init_file, *args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + RANK_TIMEOUT_S
    while not any(p.exitcode == -signal.SIGKILL for p in procs):
        assert time.monotonic() < deadline, "no rank was killed during the save"
        assert not all(p.exitcode is not None for p in procs), [p.exitcode for p in procs]
        time.sleep(0.05)
    for p in procs:
        p.join(grace_s)
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


@pytest.mark.parametrize(
    ("stage", "mode", "where"),
    [
        (2, "sync", "writing"),
        (2, "decoupled", "writing"),
        (0, "decoupled", "writing"),  # rank 1 writes nothing: it waits for the dead rank 0 at the commit
        (1, "sync", "agreeing"),
        (3, "decoupled", "agreeing"),
    ],
)
def test_a_kill_during_a_save_leaves_latest_at_the_previous_tag_which_resumes(
    tmp_path: Any, stage: int, mode: str, where: str
) -> None:
    workdir = str(tmp_path)
    codes = _run_until_killed(workers.killed_during_save, 2, (workdir, stage, mode, where), workdir)
    assert -signal.SIGKILL in codes
    save_dir = tmp_path / "ckpt"
    assert (save_dir / "latest").read_text() == TAG_A  # B's files may exist; `latest` never names them
    for path in (save_dir / TAG_B).glob("*.pt"):  # and each of them is whole (renamed in once durable)
        torch.load(path, weights_only=False)
    if where == "agreeing":  # rank 0 outlived rank 1: it saw the group fail and left `latest` alone
        with open(tmp_path / "result-0.json") as f:
            seen = json.load(f)
        assert seen["latest"] == TAG_A, seen
        assert seen["error"].startswith("GroupSaveError") and "still names the previous tag" in seen["error"], seen
    killed_losses = []
    for rank in range(2):
        with open(tmp_path / f"losses-{rank}.json") as f:
            killed_losses.append(json.load(f))
        for leftover in (tmp_path / f"result-{rank}.json", tmp_path / f"error-{rank}.txt"):
            leftover.unlink(missing_ok=True)  # the killed run's: run_ranks reads the resumed run's
    resumed = _ok(run_ranks(workers.resume_from_latest, 2, (workdir, stage, mode), workdir, RANK_TIMEOUT_S))
    for rank, res in enumerate(resumed):
        assert os.path.basename(os.path.dirname(res["load_path"])) == TAG_A
        assert res["loss"] == killed_losses[rank][SAVE_AFTER]  # the step after tag A, as first trained


def test_ranks_saving_different_tags_follow_deepspeeds_tag_validation(tmp_path: Any) -> None:
    """DeepSpeed's own suite saves ``tag-{rank}`` under each ``checkpoint.tag_validation``: "FAIL"
    raises its AssertionError on every rank, "WARN" (its default) saves each rank's files in its
    own tag's directory and ``latest`` names rank 0's, as DeepSpeed's engines do."""
    results = _ok(run_ranks(workers.different_tags, 2, (str(tmp_path),), str(tmp_path), RANK_TIMEOUT_S))
    for rank, res in enumerate(results):
        for decoupled in (False, True):
            failed, warned = res[f"FAIL-{decoupled}"], res[f"WARN-{decoupled}"]
            assert failed == {"error": "AssertionError", "latest": None, "files": []}, (rank, failed)
            assert warned["error"] is None and warned["latest"] == "tag-0", (rank, warned)
            assert f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" in warned["files"], (rank, warned)
            assert not [n for n in warned["files"] if ".fptmp-" in n], warned


def test_fastpersist_imports_no_deepspeed_and_the_integration_says_what_is_missing() -> None:
    code = (
        "import sys, fastpersist, fastpersist.integrations\n"
        "assert 'deepspeed' not in sys.modules\n"
        "sys.modules['deepspeed'] = None\n"  # as if it were not installed
        "try:\n"
        "    import fastpersist.integrations.deepspeed\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "needs DeepSpeed: pip install deepspeed" in done.stdout


def test_the_docs_recipe_runs_and_resumes(tmp_path: Any) -> None:
    """docs/integrations.md's DeepSpeed recipe, run as it says (torchrun, 2 CPU ranks), twice."""
    docs = os.path.join(REPO_DIR, "docs", "integrations.md")
    with open(docs) as f:
        section = f.read().split("## DeepSpeed", 1)[1]
    recipe = section.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "train.py").write_text(recipe)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py"]
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    for run in ("first", "resumed"):
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RANK_TIMEOUT_S)
        assert done.returncode == 0, f"the {run} run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        assert (tmp_path / "ckpt" / "latest").read_text() == "global_step40"
    tags = sorted(p.name for p in (tmp_path / "ckpt").glob("global_step*"))
    assert tags == [f"global_step{n}" for n in (10, 20, 30, 40)]
    assert "Unable to find latest file" not in done.stderr + done.stdout  # the second run loaded it
