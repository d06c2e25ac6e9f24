"""The Lightning CheckpointIO plug-ins: a tiny Trainer fits, checkpoints, prunes and resumes.

FastPersistCheckpointIO saves synchronously; FastPersistAsyncCheckpointIO overlaps each save
with training. What the overlapped one must keep: the files left are exactly what
ModelCheckpoint reports, a resume is exact, a background failure is raised by the next call, a
removal never deletes a checkpoint before the save in flight (its successor) is durable, and a
kill -9 mid-save leaves the previous checkpoints loadable and nothing half-written at a path.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

import fastpersist as fp  # noqa: E402
from fastpersist.futures import SaveFuture  # noqa: E402
from fastpersist.integrations.lightning import FastPersistAsyncCheckpointIO, FastPersistCheckpointIO  # noqa: E402
from fastpersist.saving import job  # noqa: E402

import lightning_workers  # noqa: E402
from gloo import REPO_DIR  # noqa: E402
from lightning_workers import STEPS_PER_EPOCH, Tiny, loader, rotation, seeded_model, trainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

WORKER = os.path.abspath(lightning_workers.__file__)


def _same_training_state(a: Tiny, b: Tiny) -> None:
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y)
    opt_a, opt_b = a.optimizers().optimizer.state_dict(), b.optimizers().optimizer.state_dict()
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(opt_a["state"][0][key], opt_b["state"][0][key])
    assert opt_a["param_groups"][0]["lr"] == opt_b["param_groups"][0]["lr"]


def _step_of(name: str) -> int:
    return int(re.search(r"step=(\d+)", name).group(1))  # type: ignore[union-attr]


def _checkpoint(step: int) -> dict[str, Any]:
    return {"state_dict": {"w": torch.full((1024,), float(step))}, "global_step": step}


def _hold_manifests(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every save from now on waits before writing its manifest until the returned event is set."""
    gate = threading.Event()
    write_manifest = job.write_manifest

    def held(directory: str, manifest: bytes, *, durable: bool) -> None:
        assert gate.wait(60), "the test never released the save"
        write_manifest(directory, manifest, durable=durable)

    monkeypatch.setattr(job, "write_manifest", held)
    return gate


def _fail_manifest(monkeypatch: pytest.MonkeyPatch, nth: int = 1) -> threading.Event:
    """The `nth` save from now fails with ENOSPC at its manifest, once the returned event is set;
    the others pass."""
    gate = threading.Event()
    write_manifest = job.write_manifest
    calls = 0

    def full(directory: str, manifest: bytes, *, durable: bool) -> None:
        nonlocal calls
        calls += 1
        if calls != nth:
            return write_manifest(directory, manifest, durable=durable)
        assert gate.wait(60), "the test never released the save"
        raise OSError(errno.ENOSPC, "No space left on device (simulated)", directory)

    monkeypatch.setattr(job, "write_manifest", full)
    return gate


def _visible(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if not n.startswith("."))


# ------------------------------------------------------------------------- synchronous


def test_fit_checkpoint_prune_and_resume(tmp_path: Any) -> None:
    root, ckdir = str(tmp_path), str(tmp_path / "ck")
    keep = pl.callbacks.ModelCheckpoint(dirpath=ckdir, save_last=True, save_top_k=1, monitor="step", mode="max")
    model = Tiny()
    trainer(root, 3, FastPersistCheckpointIO(), callbacks=[keep]).fit(model, loader())
    assert sorted(os.listdir(ckdir)) == ["epoch=2-step=12.ckpt", "last.ckpt"]  # older ones removed through the plug-in
    last = os.path.join(ckdir, "last.ckpt")
    fp.verify(last)
    assert fp.load(last)["hyper_parameters"] == {"hidden": 8}

    resumed = Tiny()
    again = trainer(root, 3, FastPersistCheckpointIO())
    again.fit(resumed, loader(), ckpt_path=last)  # nothing left to train: the state is the checkpoint's
    assert again.global_step == 12
    _same_training_state(model, resumed)

    more = trainer(root, 4, FastPersistCheckpointIO())
    more.fit(Tiny(), loader(), ckpt_path=last)
    assert more.global_step == 16 and more.current_epoch == 4


def test_unknown_values_become_repr_or_raise(tmp_path: Any) -> None:
    path = str(tmp_path / "x.ckpt")
    io = FastPersistCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "hp": {"obj": object}}, path)
    assert fp.load(path)["hp"]["obj"] == repr(object)
    with pytest.raises(TypeError, match="strict"):
        FastPersistCheckpointIO(strict=True).save_checkpoint({"hp": object}, path)
    io.remove_checkpoint(path)
    assert not os.path.exists(path)


# ------------------------------------------------------------------------- overlapped: in a Trainer


def test_overlapped_saves_every_n_steps_leave_exactly_what_model_checkpoint_reports(tmp_path: Any) -> None:
    root, ckdir = str(tmp_path), str(tmp_path / "ck")
    keep = rotation(ckdir, every_n_train_steps=2)
    model = seeded_model()
    trainer(root, 3, FastPersistAsyncCheckpointIO(), callbacks=[keep]).fit(model, loader())

    reported = {os.path.basename(p) for p in keep.best_k_models} | {os.path.basename(keep.last_model_path)}
    assert reported == {"epoch=2-step=10.ckpt", "epoch=2-step=12.ckpt", "last.ckpt"}
    assert sorted(os.listdir(ckdir)) == sorted(reported)  # the removed ones are gone, nothing hidden is left
    for name in reported:
        path = os.path.join(ckdir, name)
        fp.verify(path)
        state = FastPersistCheckpointIO().load_checkpoint(path)  # the synchronous plug-in reads it too
        assert state["global_step"] == (12 if name == "last.ckpt" else _step_of(name))
    last = fp.load(os.path.join(ckdir, "last.ckpt"))
    assert torch.equal(last["state_dict"]["layer.weight"], model.layer.weight)


def test_training_goes_on_while_a_save_is_written(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    root, ckdir = str(tmp_path), str(tmp_path / "ck")
    gate = _hold_manifests(monkeypatch)  # no save can commit until step 3 has trained
    seen: dict[int, bool] = {}

    class Release(pl.Callback):  # type: ignore[misc, name-defined]
        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            seen[trainer.global_step] = os.path.exists(os.path.join(ckdir, "epoch=0-step=2.ckpt"))
            if trainer.global_step == 3:
                gate.set()

    keep = pl.callbacks.ModelCheckpoint(dirpath=ckdir, every_n_train_steps=2, save_top_k=-1)
    trainer(root, 1, FastPersistAsyncCheckpointIO(), callbacks=[keep, Release()]).fit(seeded_model(), loader())
    assert seen[3] is False  # step 3 trained while step 2's checkpoint was being written
    assert sorted(os.listdir(ckdir)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]


def test_overlapped_saves_resume_exactly(tmp_path: Any) -> None:
    reference = seeded_model()
    trainer(str(tmp_path / "ref"), 4, FastPersistAsyncCheckpointIO(), enable_checkpointing=False).fit(
        reference, loader()
    )

    root, ckdir = str(tmp_path / "run"), str(tmp_path / "run" / "ck")
    trainer(root, 2, FastPersistAsyncCheckpointIO(), callbacks=[rotation(ckdir)]).fit(seeded_model(), loader())
    resumed = seeded_model(seed=1)  # other weights: the checkpoint must bring them back
    trainer(root, 4, FastPersistAsyncCheckpointIO(), callbacks=[rotation(ckdir)]).fit(
        resumed, loader(), ckpt_path=os.path.join(ckdir, "last.ckpt")
    )
    assert resumed.losses == reference.losses[2 * STEPS_PER_EPOCH :]  # the next losses, bit for bit
    _same_training_state(reference, resumed)


def test_a_failed_save_stops_the_fit_at_the_next_save_and_leaves_the_previous_checkpoints(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, ckdir = str(tmp_path), str(tmp_path / "ck")
    _fail_manifest(monkeypatch, nth=3).set()  # epoch 1's top-k save fails in the background
    with pytest.raises(OSError, match="simulated") as caught:  # raised by the save of last.ckpt after it
        trainer(root, 4, FastPersistAsyncCheckpointIO(), callbacks=[rotation(ckdir)]).fit(seeded_model(), loader())
    assert caught.value.errno == errno.ENOSPC
    assert sorted(os.listdir(ckdir)) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert fp.load(os.path.join(ckdir, "last.ckpt"))["global_step"] == STEPS_PER_EPOCH


def test_the_docs_recipe_runs_and_resumes(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/integrations.md's Lightning recipe, run as a script twice: the second run resumes."""
    docs = os.path.join(REPO_DIR, "docs", "integrations.md")
    with open(docs, encoding="utf-8") as f:
        section = f.read().split("\n## Lightning\n", 1)[1]
    recipe = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    first: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(recipe, "train.py", "exec"), first)
    assert sorted(os.listdir("ckpt")) == ["epoch=1-step=64.ckpt", "epoch=2-step=96.ckpt", "last.ckpt"]
    again: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(recipe, "train.py", "exec"), again)
    assert again["trainer"].global_step == 96 and again["trainer"].ckpt_path == os.path.abspath("ckpt/last.ckpt")
    trained, resumed = first["trainer"].lightning_module, again["trainer"].lightning_module
    for a, b in zip(trained.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------- overlapped: the plug-in's calls


def test_a_removal_waits_until_the_save_in_flight_is_durable(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    older, newer = str(tmp_path / "epoch=0.ckpt"), str(tmp_path / "epoch=1.ckpt")
    io = FastPersistAsyncCheckpointIO()
    io.save_checkpoint(_checkpoint(1), older)
    io.wait()
    gate = _hold_manifests(monkeypatch)
    io.save_checkpoint(_checkpoint(2), newer)  # returns staged: the write goes on
    assert not os.path.exists(newer)
    io.remove_checkpoint(older)  # what top-k rotation asks right after saving the successor
    assert fp.load(older)["global_step"] == 1  # still there: its successor is not durable yet
    gate.set()
    io.teardown()
    assert _visible(str(tmp_path)) == ["epoch=1.ckpt"] and fp.load(newer)["global_step"] == 2


def test_a_background_failure_is_raised_by_the_next_call_and_its_predecessor_kept(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    older, newer = str(tmp_path / "epoch=0.ckpt"), str(tmp_path / "epoch=1.ckpt")
    io = FastPersistAsyncCheckpointIO()
    io.save_checkpoint(_checkpoint(1), older)
    io.wait()
    gate = _fail_manifest(monkeypatch)
    io.save_checkpoint(_checkpoint(2), newer)  # staged; its commit will fail
    io.remove_checkpoint(older)
    gate.set()
    with pytest.raises(OSError) as caught:
        io.save_checkpoint(_checkpoint(3), older)
    assert caught.value.errno == errno.ENOSPC
    assert fp.load(older)["global_step"] == 1 and not os.path.exists(newer)  # the successor failed: kept

    io.save_checkpoint(_checkpoint(3), older)  # raised once; a new save of the path drops its removal
    io.teardown()
    assert _visible(str(tmp_path)) == ["epoch=0.ckpt"] and fp.load(older)["global_step"] == 3


def test_teardown_raises_a_failure_no_call_raised_and_says_what_it_kept(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    older, newer = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    io = FastPersistAsyncCheckpointIO()
    io.save_checkpoint(_checkpoint(1), older)
    io.wait()
    gate = _fail_manifest(monkeypatch)
    io.save_checkpoint(_checkpoint(2), newer)
    io.remove_checkpoint(older)
    gate.set()
    with caplog.at_level("WARNING", logger="fastpersist"), pytest.raises(OSError, match="simulated"):
        io.teardown()
    assert "kept" in caplog.text and "a.ckpt" in caplog.text
    assert _visible(str(tmp_path)) == ["a.ckpt"]
    io.teardown()  # raised once


def test_removing_the_path_being_saved_cancels_that_save(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "last.ckpt")
    io = FastPersistAsyncCheckpointIO()
    io.save_checkpoint(_checkpoint(1), path)
    io.wait()
    gate = _hold_manifests(monkeypatch)
    cancel = SaveFuture.cancel

    def cancel_then_release(self: SaveFuture) -> bool:
        stopped = cancel(self)
        gate.set()
        return stopped

    monkeypatch.setattr(SaveFuture, "cancel", cancel_then_release)
    io.save_checkpoint(_checkpoint(2), path)
    io.remove_checkpoint(path)
    assert gate.is_set() and not os.path.exists(path)  # neither the new checkpoint nor the old one
    io.teardown()  # the cancellation was the plug-in's own: nothing to raise
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------- overlapped: kill -9


@pytest.mark.parametrize(
    ("held", "held_name", "left", "last_step"),
    [
        # Saves 1-4 are epochs 0 and 1 (top-k, then last.ckpt). Save 5, epoch 2's top-k, held:
        # epoch=0's removal waited for it, so it stays, and last.ckpt is epoch 1's.
        (5, "epoch=2-step=12.ckpt", ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"], 8),
        # Save 6, last.ckpt replacing itself, held: epoch 2's top-k is durable (epoch=0 went
        # when it was), and last.ckpt is still epoch 1's whole checkpoint.
        (6, "last.ckpt", ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt", "last.ckpt"], 8),
    ],
    ids=["top-k-save-in-flight", "last-ckpt-in-flight"],
)
def test_a_kill_during_an_overlapped_save_leaves_the_previous_checkpoints_and_resume_is_exact(
    tmp_path: Any, held: int, held_name: str, left: list[str], last_step: int
) -> None:
    root, ckdir = str(tmp_path), str(tmp_path / "ck")
    child = subprocess.Popen([sys.executable, WORKER, root, str(held)], stdout=subprocess.PIPE, text=True)
    _kill_when(child, "holding")  # the held save's data files are written, its manifest is not
    assert child.returncode == -signal.SIGKILL

    assert _visible(ckdir) == left
    for name in left:
        fp.verify(os.path.join(ckdir, name))
    last = os.path.join(ckdir, "last.ckpt")
    assert fp.load(last)["global_step"] == last_step
    (leftover,) = [n for n in os.listdir(ckdir) if n.startswith(f".{held_name}.")]
    with pytest.raises(fp.FastPersistError):
        fp.load(os.path.join(ckdir, leftover))  # the half-written save does not load
    assert os.path.join(ckdir, leftover) in fp.clean(ckdir)  # (with a removed tree the kill beat the remover to)
    assert sorted(os.listdir(ckdir)) == left

    reference = seeded_model()
    trainer(str(tmp_path / "ref"), 4, FastPersistAsyncCheckpointIO(), enable_checkpointing=False).fit(
        reference, loader()
    )
    resumed = seeded_model(seed=1)
    trainer(root, 4, FastPersistAsyncCheckpointIO(), callbacks=[rotation(ckdir)]).fit(resumed, loader(), ckpt_path=last)
    assert resumed.losses == reference.losses[last_step:]
    _same_training_state(reference, resumed)


def _kill_when(child: subprocess.Popen[str], word: str) -> None:
    assert child.stdout is not None
    try:
        while not (line := child.stdout.readline()).startswith(word):
            assert line, f"the child ended before it printed {word!r}"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
