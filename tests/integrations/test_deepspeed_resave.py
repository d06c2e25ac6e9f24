"""A DeepSpeed tag saved again, and a decoupled save read back at once, against the real
DeepSpeed: 2 ranks on the CPU accelerator over gloo (tests/integrations/test_deepspeed.py has the
save-load-resume cases).

A re-saved tag (``save_checkpoint(dir, tag="last")`` at every checkpoint) must never be named by
``latest`` while its files are being replaced: a kill or a failed write part-way leaves its old
files, byte for byte, which resume exactly, and the next save removes the dead staging directory.
A decoupled save read back before any commit point (``load_checkpoint`` right after
``save_checkpoint``, as DeepSpeed's own tests do) reads the new tag.

The ranks run the functions of this module (spawned: they import it by name).
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import signal
import time
from typing import Any

import pytest

if importlib.util.find_spec("deepspeed") is None:  # CI installs it: pip install '.[test]'
    pytest.skip("DeepSpeed is not installed (pip install '.[test]' installs it)", allow_module_level=True)

from test_deepspeed import RANK_TIMEOUT_S, _ok, _run_until_killed

import deepspeed_workers as workers
from deepspeed_workers import SAVE_AFTER, STEPS
from gloo import report_rank, run_ranks

pytestmark = pytest.mark.slow  # each case starts 2 DeepSpeed processes, some twice

TAG = "last"


def _digests(tag_dir: str) -> dict[str, str]:
    """Each file of a tag's directory (hidden ones included) and its SHA-256."""
    found = {}
    for name in sorted(os.listdir(tag_dir)):
        with open(os.path.join(tag_dir, name), "rb") as f:
            found[name] = hashlib.sha256(f.read()).hexdigest()
    return found


def _hidden(save_dir: str) -> list[str]:
    """What a save left beside the tags: staging directories, temporary files."""
    return sorted(n for n in os.listdir(save_dir) if n.startswith("."))


def _settle_and_list(save_dir: str) -> list[str]:
    """Once every rank's background removals are done: the hidden entries of `save_dir`."""
    import torch.distributed as dist

    import fastpersist as fp

    fp.wait_removed()
    dist.barrier()
    return _hidden(save_dir)


def _offline_weights_match(save_dir: str, tag: str, weights: dict[str, list[float]]) -> bool:
    """Whether DeepSpeed's offline reader (zero_to_fp32) reads `tag` back to `weights`."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    offline = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=tag)
    return all(offline[name].flatten().tolist() == weights[name] for name in weights)


# -------------------------------------------------------------------- a re-save killed part-way


def resave_then_die(rank: int, world: int, init_file: str, workdir: str, stage: int, mode: str) -> None:
    """Saves tag "last" after SAVE_AFTER steps, trains to STEPS, and is killed (every rank) right
    after its first file of the re-save started (decoupled) or was written (sync). The losses
    after the first save go to ``losses-{rank}.json``, the tag's files to ``before.json``."""

    def scenario() -> None:
        workers._setup(rank, world)
        save_dir = os.path.join(workdir, "ckpt")
        engine = workers.make_engine(stage, seed=0)
        ours = workers.install(engine, mode == "decoupled")
        losses = [workers.train_step(engine, step) for step in range(SAVE_AFTER)]
        engine.save_checkpoint(save_dir, tag=TAG)
        losses += [workers.train_step(engine, step) for step in range(SAVE_AFTER, STEPS)]
        assert workers.latest(save_dir) == TAG
        with open(os.path.join(workdir, f"losses-{rank}.json"), "w") as f:
            json.dump(losses, f)
        if rank == 0:
            with open(os.path.join(workdir, "before.json"), "w") as f:
                json.dump(_digests(os.path.join(save_dir, TAG)), f)
        save = ours.save

        def save_then_die(state_dict: object, path: str) -> None:
            save(state_dict, path)
            os.kill(os.getpid(), signal.SIGKILL)

        ours.save = save_then_die  # type: ignore[method-assign]
        engine.save_checkpoint(save_dir, tag=TAG)

    report_rank(rank, world, init_file, workdir, scenario, destroy=False)


def resume_and_resave(rank: int, world: int, init_file: str, workdir: str, stage: int, mode: str) -> None:
    """A fresh group loads what ``latest`` names, trains on, re-saves the tag and reads it offline."""

    def resume() -> dict[str, Any]:
        workers._setup(rank, world)
        save_dir = os.path.join(workdir, "ckpt")
        leftovers = _hidden(save_dir)
        engine = workers.make_engine(stage, seed=1)
        workers.install(engine, mode == "decoupled")
        load_path, _ = engine.load_checkpoint(save_dir)
        result: dict[str, Any] = {"load_path": load_path, "global_steps": engine.global_steps, "leftovers": leftovers}
        result["resumed"] = [workers.train_step(engine, step) for step in range(SAVE_AFTER, STEPS)]
        weights = workers.full_weights(engine, stage)
        engine.save_checkpoint(save_dir, tag=TAG)  # the next save: removes the killed one's staging directory
        engine.destroy()
        result["hidden_after"] = _settle_and_list(save_dir)
        result["latest"] = workers.latest(save_dir)
        if rank == 0 and stage > 0:
            result["offline_exact"] = _offline_weights_match(save_dir, TAG, weights)
            result["recovery_script"] = os.path.isfile(os.path.join(save_dir, "zero_to_fp32.py"))
        return result

    report_rank(rank, world, init_file, workdir, resume)


@pytest.mark.parametrize(("stage", "mode"), [(2, "sync"), (1, "decoupled")])
def test_a_resave_killed_part_way_leaves_the_tag_whole_and_the_next_save_clears_its_staging(
    tmp_path: Any, stage: int, mode: str
) -> None:
    workdir = str(tmp_path)
    codes = _run_until_killed(resave_then_die, 2, (workdir, stage, mode), workdir)
    assert -signal.SIGKILL in codes
    save_dir = tmp_path / "ckpt"
    assert (save_dir / "latest").read_text() == TAG
    before = json.loads((tmp_path / "before.json").read_text())
    assert _digests(str(save_dir / TAG)) == before  # not one file of the tag was touched
    killed_losses = [json.loads((tmp_path / f"losses-{rank}.json").read_text()) for rank in range(2)]
    for leftover in tmp_path.glob("result-*.json"):
        leftover.unlink()
    for leftover in tmp_path.glob("error-*.txt"):
        leftover.unlink()
    resumed = _ok(run_ranks(resume_and_resave, 2, (workdir, stage, mode), workdir, RANK_TIMEOUT_S))
    assert any(".fptmp-" in name for name in resumed[0]["leftovers"]), resumed[0]["leftovers"]  # the killed staging
    for rank, res in enumerate(resumed):
        assert os.path.basename(os.path.dirname(res["load_path"])) == TAG
        assert res["global_steps"] == SAVE_AFTER
        assert res["resumed"] == killed_losses[rank][SAVE_AFTER:], rank  # bit for bit: the tag's old state
        assert res["hidden_after"] == [], res["hidden_after"]
        assert res["latest"] == TAG
    if stage > 0:
        assert resumed[0]["offline_exact"] and resumed[0]["recovery_script"]


# -------------------------------------------------------------------- a failed re-save; reading one's own save


def _failing_second_save_on_rank_0(module: Any) -> Any:
    """Makes rank 0's second file of the next save fail as a full disk would; returns the original."""
    import torch.distributed as dist

    original = module.torch_save
    calls = []

    def torch_save(state_dict: object, path: str, **kwargs: Any) -> Any:
        calls.append(path)
        if dist.get_rank() == 0 and len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
        return original(state_dict, path, **kwargs)

    module.torch_save = torch_save
    return original


def failed_resave(stage: int, save_dir: str) -> dict[str, Any]:
    """Blocking: saves the tag, trains on, re-saves it with rank 0's second file failing; then a
    fresh engine loads ``latest`` and trains the same steps."""
    import fastpersist.integrations.deepspeed as fp_deepspeed

    engine = workers.make_engine(stage, seed=0)
    workers.install(engine, decoupled=False)
    losses = [workers.train_step(engine, step) for step in range(SAVE_AFTER)]
    engine.save_checkpoint(save_dir, tag=TAG)
    before = _digests(os.path.join(save_dir, TAG))
    losses += [workers.train_step(engine, step) for step in range(SAVE_AFTER, STEPS)]
    original = _failing_second_save_on_rank_0(fp_deepspeed)
    try:
        engine.save_checkpoint(save_dir, tag=TAG)
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        fp_deepspeed.torch_save = original
    engine.destroy()
    result: dict[str, Any] = {"error": error, "latest": workers.latest(save_dir)}
    result["unchanged"] = _digests(os.path.join(save_dir, TAG)) == before
    result["hidden"] = _settle_and_list(save_dir)
    resumed = workers.make_engine(stage, seed=1)
    workers.install(resumed, decoupled=False)
    resumed.load_checkpoint(save_dir)
    result["global_steps"] = resumed.global_steps
    result["resumed_exact"] = [workers.train_step(resumed, s) for s in range(SAVE_AFTER, STEPS)] == losses[SAVE_AFTER:]
    resumed.destroy()
    return result


def read_own_decoupled_saves(stage: int, save_dir: str) -> dict[str, Any]:
    """Decoupled: a save read back by a fresh engine at once, with its tag; the tag re-saved and
    read back at once without a tag; a save of another tag while one is open."""
    saver = workers.make_engine(stage, seed=0)
    workers.install(saver, decoupled=True)
    for step in range(SAVE_AFTER):
        workers.train_step(saver, step)
    saver.save_checkpoint(save_dir, tag=TAG)  # open: no commit point yet
    first = workers.make_engine(stage, seed=1)
    workers.install(first, decoupled=True)
    load_path, _ = first.load_checkpoint(save_dir, tag=TAG)
    result: dict[str, Any] = {"first": [os.path.basename(os.path.dirname(load_path)), first.global_steps]}
    steps = range(SAVE_AFTER, SAVE_AFTER + 2)
    result["first_exact"] = [workers.train_step(first, s) for s in steps] == [
        workers.train_step(saver, s) for s in steps
    ]
    first.destroy()
    saver.save_checkpoint(save_dir, tag=TAG)  # a re-save, open, its files in flight
    again = workers.make_engine(stage, seed=2)
    workers.install(again, decoupled=True)
    load_path, _ = again.load_checkpoint(save_dir)
    result["again"] = [os.path.basename(os.path.dirname(load_path)), again.global_steps]
    step = SAVE_AFTER + 2
    result["again_exact"] = workers.train_step(again, step) == workers.train_step(saver, step)
    again.destroy()
    saver.save_checkpoint(save_dir, tag="other")
    saver.save_checkpoint(save_dir, tag="another")  # commits "other" first
    result["latest_while_another_is_open"] = workers.latest(save_dir)
    saver.destroy()
    result["hidden"] = _settle_and_list(save_dir)
    result["latest"] = workers.latest(save_dir)  # (after the barrier: rank 0 writes it once the ranks agreed)
    return result


def read_latest_while_rank_0_is_slow(save_dir: str) -> dict[str, Any]:
    """Decoupled, ZeRO-1: a fresh engine loads ``latest`` right after a save, while rank 0 is
    slow to write ``latest`` (a loaded disk): every rank must read the new tag. (Before the
    commit's last agreement, rank 1 returned as soon as the files were agreed durable, found no
    ``latest``, skipped the load and went on from step 0; under ZeRO-3 the ranks then hang in
    the load's collectives.)"""
    import torch.distributed as dist

    import fastpersist.integrations.deepspeed as fp_deepspeed

    saver = workers.make_engine(1, seed=0)
    workers.install(saver, decoupled=True)
    for step in range(SAVE_AFTER):
        workers.train_step(saver, step)
    saver.save_checkpoint(save_dir)  # open: no commit point yet
    original = fp_deepspeed.write_small_file

    def slow_write(path: str, data: bytes, **kwargs: Any) -> None:
        time.sleep(1.0 if dist.get_rank() == 0 else 0.0)
        original(path, data, **kwargs)

    fp_deepspeed.write_small_file = slow_write
    try:
        fresh = workers.make_engine(1, seed=1)
        workers.install(fresh, decoupled=True)
        load_path, _ = fresh.load_checkpoint(save_dir)
    finally:
        fp_deepspeed.write_small_file = original
    result = {"tag": load_path and os.path.basename(os.path.dirname(load_path)), "global_steps": fresh.global_steps}
    fresh.destroy()
    saver.destroy()
    return result


def failed_and_own_reads(rank: int, world: int, init_file: str, workdir: str, stage: int) -> None:
    def cases() -> dict[str, Any]:
        workers._setup(rank, world)
        return {
            "failed": failed_resave(stage, os.path.join(workdir, "ckpt-failed")),
            "own": read_own_decoupled_saves(stage, os.path.join(workdir, "ckpt-own")),
            "slow_latest": read_latest_while_rank_0_is_slow(os.path.join(workdir, "ckpt-slow-latest")),
        }

    report_rank(rank, world, init_file, workdir, cases)


def test_a_failed_resave_keeps_the_old_tag_and_a_decoupled_save_reads_back_at_once(tmp_path: Any) -> None:
    results = _ok(run_ranks(failed_and_own_reads, 2, (str(tmp_path), 3), str(tmp_path), RANK_TIMEOUT_S))
    for rank, res in enumerate(results):
        failed = res["failed"]
        assert failed["error"] is not None, rank  # every rank raises, not only the one whose write failed
        assert failed["error"].startswith("OSError" if rank == 0 else "GroupSaveError"), failed["error"]
        assert failed["latest"] == TAG and failed["unchanged"], failed
        assert failed["hidden"] == [], failed["hidden"]  # the staging directory went with the failure
        assert failed["global_steps"] == SAVE_AFTER and failed["resumed_exact"], failed
        own = res["own"]
        assert own["first"] == [TAG, SAVE_AFTER] and own["first_exact"], own
        assert own["again"] == [TAG, SAVE_AFTER + 2] and own["again_exact"], own
        assert own["latest_while_another_is_open"] == "other", own
        assert own["latest"] == "another", own
        assert own["hidden"] == [], own["hidden"]
        assert res["slow_latest"] == {"tag": f"global_step{SAVE_AFTER}", "global_steps": SAVE_AFTER}, (rank, res)
