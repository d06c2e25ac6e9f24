"""The Hugging Face Trainer and Accelerate integrations (fastpersist.integrations.hf_trainer,
.hf_accelerate): overlapped checkpoints that resume exactly, rotate only behind a durable
successor, survive a kill -9 mid-save, and Accelerate's save_state/load_state round trip.

Exactness is checked on every step's loss (recorded unrounded, tests/helpers/hf_trainer_workers.py)
and on the final weights: the model has dropout, so the RNG state must come back too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

import fastpersist.integrations.hf_checkpoint as hf_checkpoint  # noqa: E402
import fastpersist.integrations.hf_trainer as hf_trainer  # noqa: E402

import hf_trainer_workers as workers  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

CHECKPOINT_FILES = {"model.safetensors", "config.json", "optimizer.pt", "scheduler.pt", "rng_state.pth"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A whole run of the overlapped trainer: its losses, final weights and output directory."""
    out = tmp_path_factory.mktemp("uninterrupted")
    trainer = workers.make_trainer(str(out))
    trainer.train()
    return trainer.losses, trainer.model.state_dict(), out


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _resumed_from(checkpoint: Path, out: Path, base: type | None = None) -> Any:
    """A fresh trainer resumed (resume_from_checkpoint=True) in `out`, holding a copy of `checkpoint`."""
    if checkpoint.parent != out:
        shutil.copytree(checkpoint, out / checkpoint.name)
    trainer = workers.make_trainer(str(out), base)
    trainer.train(resume_from_checkpoint=True)
    return trainer


def test_the_overlapped_run_trains_as_the_stock_trainer_and_writes_its_files(
    uninterrupted: Any, tmp_path: Path
) -> None:
    losses, weights, out = uninterrupted
    stock = workers.make_trainer(str(tmp_path), transformers.Trainer)
    stock.train()
    assert losses == stock.losses
    _assert_same_weights(weights, stock.model.state_dict())
    names = sorted(p.name for p in out.iterdir())
    assert names == [f"checkpoint-{s}" for s in range(workers.SAVE_STEPS, workers.STEPS + 1, workers.SAVE_STEPS)]
    for name in names:
        assert CHECKPOINT_FILES | {"trainer_state.json"} <= {p.name for p in (out / name).iterdir()}
    assert get_last_checkpoint(str(out)) == str(out / f"checkpoint-{workers.STEPS}")


def test_resume_from_the_newest_checkpoint_is_exact(uninterrupted: Any, tmp_path: Path) -> None:
    losses, weights, out = uninterrupted
    resumed = _resumed_from(out / "checkpoint-4", tmp_path)
    assert resumed.losses == losses[4:]
    _assert_same_weights(resumed.model.state_dict(), weights)


def test_the_stock_trainer_resumes_exactly_from_a_fastpersist_checkpoint(uninterrupted: Any, tmp_path: Path) -> None:
    losses, weights, out = uninterrupted  # the files are Trainer's own, under its names
    resumed = _resumed_from(out / "checkpoint-6", tmp_path, transformers.Trainer)
    assert resumed.losses == losses[6:]
    _assert_same_weights(resumed.model.state_dict(), weights)


def test_the_optimizer_step_after_a_save_waits_for_its_staging(tmp_path: Path) -> None:
    waits: list[tuple[str, int, bool]] = []  # (checkpoint, global step at the wait, staged after it)
    trainer = workers.make_trainer(str(tmp_path))

    class RecordWaits(transformers.TrainerCallback):  # type: ignore[misc]
        def on_save(self, *_: Any, **__: Any) -> None:  # right after _save_checkpoint returned
            checkpoint = trainer.checkpoint_in_flight
            assert checkpoint is not None
            wait_staged = checkpoint.wait_staged

            def recorded() -> None:
                wait_staged()
                waits.append((os.path.basename(checkpoint.final), trainer.state.global_step, checkpoint.staged()))

            checkpoint.wait_staged = recorded  # type: ignore[method-assign]

    trainer.add_callback(RecordWaits())
    trainer.train()
    first = {name: step for name, step, _ in reversed(waits)}
    assert first == {f"checkpoint-{s}": s for s in range(workers.SAVE_STEPS, workers.STEPS, workers.SAVE_STEPS)}
    assert all(staged for _, _, staged in waits)


def test_rotation_keeps_the_newest_two_durable_checkpoints_and_deletes_only_behind_a_committed_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[str]] = []
    rotate = hf_trainer.rotate_checkpoints

    def checked_rotation(**kwargs: Any) -> None:
        listed = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint-"))
        for name in listed:  # every checkpoint Trainer can see is complete when rotation runs
            assert (tmp_path / name / "trainer_state.json").is_file(), name
        seen.append(listed)
        rotate(**kwargs)

    monkeypatch.setattr(hf_trainer, "rotate_checkpoints", checked_rotation)
    trainer = workers.make_trainer(str(tmp_path), save_total_limit=2)
    trainer.train()
    # Each rotation ran once its newest checkpoint was in place, complete, and removed only older ones.
    assert seen == [
        ["checkpoint-2"],
        ["checkpoint-2", "checkpoint-4"],
        ["checkpoint-2", "checkpoint-4", "checkpoint-6"],
        ["checkpoint-4", "checkpoint-6", "checkpoint-8"],
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-6", "checkpoint-8"]
    for name in ("checkpoint-6", "checkpoint-8"):
        folder = tmp_path / name
        model = transformers.GPT2LMHeadModel.from_pretrained(str(folder))
        assert model.transformer.h[0].attn.c_attn.weight.shape == (32, 96)
        optimizer = torch.load(folder / "optimizer.pt", weights_only=True)
        assert len(optimizer["state"]) == len(list(model.parameters()))
        assert torch.load(folder / "scheduler.pt", weights_only=True)["last_epoch"] == int(name.split("-")[1])
    _assert_same_weights(trainer.model.state_dict(), model.state_dict())


@pytest.mark.slow
def test_two_gloo_ranks_checkpoint_every_rank_s_rng_and_resume_exactly(tmp_path: Path) -> None:
    # tests/helpers/hf_trainer_workers.py's ddp_full_then_resumed on each rank, under torchrun (~20 s).
    script = Path(workers.__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(script.parent), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run([*command, str(script), "ddp", str(tmp_path)], env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    for rank in range(2):
        result = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert result["resumed"] == result["full"][4:] and result["same_weights"]
    for folder in (tmp_path / "full").iterdir():
        assert CHECKPOINT_FILES - {"rng_state.pth"} | {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= {
            p.name for p in folder.iterdir()
        }


def test_load_best_model_at_end_keeps_and_loads_the_best_checkpoint_as_the_stock_trainer_does(tmp_path: Path) -> None:
    # The best checkpoint (eval loss at step 2, with greater_is_better) is not the newest: rotation
    # must keep it while later ones are in flight, and the end of training must load it.
    settings = dict(
        eval_strategy="steps",
        eval_steps=workers.SAVE_STEPS,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=True,
        save_total_limit=1,
    )
    runs = []
    for base in (hf_trainer.FastPersistTrainer, transformers.Trainer):
        out = tmp_path / base.__name__
        trainer = workers.recording(base)(
            model=workers.tiny_gpt2(),
            args=workers.training_args(str(out), **settings),
            train_dataset=workers.TokenData(),
            eval_dataset=workers.TokenData(),
        )
        trainer.train()
        runs.append((trainer, out))
    (ours, ours_out), (stock, stock_out) = runs
    assert ours.state.best_model_checkpoint == str(ours_out / f"checkpoint-{workers.SAVE_STEPS}")
    assert sorted(p.name for p in ours_out.iterdir()) == sorted(p.name for p in stock_out.iterdir())
    assert ours.losses == stock.losses
    _assert_same_weights(ours.model.state_dict(), stock.model.state_dict())


def test_a_kill_during_a_save_leaves_the_last_durable_checkpoint_which_resumes_exactly(
    uninterrupted: Any, tmp_path: Path
) -> None:
    losses, weights, _ = uninterrupted
    script = Path(workers.__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(script.parent), os.environ.get("PYTHONPATH", "")])}
    log = tmp_path.parent / f"{tmp_path.name}-worker.log"
    with open(log, "wb") as out:
        run = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env, stdout=out, stderr=out)
    marker, steps = tmp_path / "slow-save", tmp_path / "steps"
    deadline = time.monotonic() + 120
    # Training goes on while checkpoint-4 is written, up to the next save (which waits for it).
    while not (marker.exists() and steps.exists() and steps.read_text() == "6"):
        assert run.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "the worker never trained on to step 6 while checkpoint-4 was in flight"
        time.sleep(0.05)
    time.sleep(0.5)
    assert steps.read_text() == "6"  # and stopped there: at most one checkpoint in flight
    in_flight = marker.read_text()
    run.send_signal(signal.SIGKILL)
    assert run.wait(30) == -signal.SIGKILL
    assert os.path.basename(in_flight) == f"{hf_checkpoint.STAGING_PREFIX}checkpoint-4"
    assert (tmp_path / "checkpoint-2" / "trainer_state.json").is_file()
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")

    marker.unlink()
    steps.unlink()
    resumed = _resumed_from(tmp_path / "checkpoint-2", tmp_path)
    assert resumed.losses == losses[2:]
    _assert_same_weights(resumed.model.state_dict(), weights)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(hf_checkpoint.STAGING_PREFIX)]


def test_a_checkpoint_moved_aside_by_a_killed_resave_of_its_step_is_put_back_and_staging_removed(
    uninterrupted: Any, tmp_path: Path
) -> None:
    losses, weights, out = uninterrupted
    prefix = hf_checkpoint.STAGING_PREFIX
    shutil.copytree(out / "checkpoint-4", tmp_path / f"{prefix}{hf_checkpoint.OLD_MARK}checkpoint-4")
    shutil.copytree(out / "checkpoint-6", tmp_path / f"{prefix}checkpoint-4")  # the new one, never renamed
    resumed = workers.make_trainer(str(tmp_path))
    resumed.train(resume_from_checkpoint=True)
    assert resumed.losses == losses[4:]
    _assert_same_weights(resumed.model.state_dict(), weights)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(prefix)]


def test_save_only_model_writes_the_weights_and_trainer_state_alone(tmp_path: Path) -> None:
    trainer = workers.make_trainer(str(tmp_path), save_only_model=True, max_steps=workers.SAVE_STEPS)
    trainer.train()
    folder = tmp_path / f"checkpoint-{workers.SAVE_STEPS}"
    names = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "trainer_state.json"} <= names and not names & {"optimizer.pt", "rng_state.pth"}
    _assert_same_weights(
        transformers.GPT2LMHeadModel.from_pretrained(str(folder)).state_dict(), trainer.model.state_dict()
    )


def test_unsupported_settings_are_refused_at_the_first_save_naming_them(tmp_path: Path) -> None:
    trainer = workers.make_trainer(str(tmp_path))
    trainer.args.push_to_hub = True  # set after __init__, which would reach the Hub to make the repository
    with pytest.raises(ValueError, match=r"push_to_hub=True.*use transformers\.Trainer"):
        trainer._save_checkpoint(trainer.model, None)
    assert not list(tmp_path.iterdir())


def _accelerate_steps(accelerator: Any, model: Any, optimizer: Any, scheduler: Any, steps: range) -> list[float]:
    """Optimizer steps over fixed batches (batch k: sequences 4k..4k+3); each step's exact loss."""
    ids = workers.TokenData().ids
    losses = []
    model.train()
    for step in steps:
        batch = ids[4 * step : 4 * step + 4]
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _prepared(seed: int) -> Any:
    from accelerate import Accelerator

    from fastpersist.integrations.hf_accelerate import FastPersistStateHooks

    accelerator = Accelerator(cpu=True)
    model = workers.tiny_gpt2()
    if seed:  # another starting point, which only the load can undo
        torch.manual_seed(seed)
        model = transformers.GPT2LMHeadModel(model.config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.8)
    prepared = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, FastPersistStateHooks(background=True).install(accelerator), *prepared


def test_accelerate_save_state_and_load_state_go_through_the_hooks_and_resume_exactly(tmp_path: Path) -> None:
    from fastpersist.integrations.hf_accelerate import model_dir_name

    accelerator, hooks, model, optimizer, scheduler = _prepared(seed=0)
    _accelerate_steps(accelerator, model, optimizer, scheduler, range(2))
    accelerator.save_state(str(tmp_path))  # returns with the weights' save in flight
    waits: list[bool] = []
    wait_staged = hooks.wait_staged

    def recorded(timeout: float | None = None) -> None:
        wait_staged(timeout)
        waits.append(all(fut.staged() for fut in hooks.saves_in_flight))

    hooks.wait_staged = recorded  # type: ignore[method-assign]
    expected = _accelerate_steps(accelerator, model, optimizer, scheduler, range(2, 4))
    assert waits == [True, True]  # each optimizer.step() waited for the weights' staging first
    (result,) = hooks.wait()
    assert result.path == str(tmp_path / model_dir_name(0))
    names = {p.name for p in tmp_path.iterdir()}
    assert model_dir_name(0) in names and "optimizer.bin" in names and "model.safetensors" not in names
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    accelerator, hooks, model, optimizer, scheduler = _prepared(seed=7)
    accelerator.load_state(str(tmp_path))
    assert _accelerate_steps(accelerator, model, optimizer, scheduler, range(2, 4)) == expected
    _assert_same_weights(model.state_dict(), weights)

    hooks.remove()  # a folder Accelerate wrote alone still loads with the hooks installed
    plain = tmp_path / "plain"
    accelerator.save_state(str(plain))
    assert "model.safetensors" in {p.name for p in plain.iterdir()}
    accelerator, hooks, model, optimizer, scheduler = _prepared(seed=7)
    accelerator.load_state(str(plain))
    _assert_same_weights(model.state_dict(), weights)
