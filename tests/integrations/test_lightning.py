"""The Lightning CheckpointIO plug-ins: a tiny Trainer fits, checkpoints, prunes and resumes.

FastPersistCheckpointIO saves synchronously; FastPersistAsyncCheckpointIO overlaps each save
with training. What the overlapped one must keep: the files left are exactly what
ModelCheckpoint reports, a resume is exact, a background failure is raised by the next call, a
removal never deletes a checkpoint before the save in flight (its successor) is durable.
The host's own contracts (its file format, pickling, its AsyncCheckpointIO wrapper, -vN names)
are test_lightning_host.py's; kill -9 mid-save, test_lightning_kills.py's.
"""

from __future__ import annotations

import errno
import os
import re
import threading
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from fastpersist.futures import SaveFuture  # noqa: E402
from fastpersist.integrations.lightning import (  # noqa: E402
    RESERVED,
    FastPersistAsyncCheckpointIO,
    FastPersistCheckpointIO,
)
from fastpersist.interop.torchasync import ArchiveSaveJob  # noqa: E402

from gloo import REPO_DIR  # noqa: E402
from lightning_workers import STEPS_PER_EPOCH, Tiny, loader, rotation, seeded_model, trainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


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


def _read(path: str) -> Any:
    return torch.load(path, weights_only=False)


def _hold_commits(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every overlapped save from now on waits before its commit (fsync, rename) until the
    returned event is set."""
    gate = threading.Event()
    finish = ArchiveSaveJob.finish

    def held(job: ArchiveSaveJob, timeout: float | None = None) -> Any:
        assert gate.wait(60), "the test never released the save"
        return finish(job, timeout)

    monkeypatch.setattr(ArchiveSaveJob, "finish", held)
    return gate


def _release_on_cancel(monkeypatch: pytest.MonkeyPatch, gate: threading.Event) -> None:
    """A save cancelled from now on releases `gate` (of :func:`_hold_commits`) once cancelled, so
    that its held commit sees the cancellation."""
    cancel = SaveFuture.cancel

    def cancel_then_release(self: SaveFuture) -> bool:
        stopped = cancel(self)
        gate.set()
        return stopped

    monkeypatch.setattr(SaveFuture, "cancel", cancel_then_release)


def _fail_commit(monkeypatch: pytest.MonkeyPatch, nth: int = 1) -> threading.Event:
    """The `nth` overlapped save from now fails with ENOSPC at its commit's fsync, once the
    returned event is set; the others pass. The save's own error path runs (its temporary
    file is removed), as for a real full disk."""
    gate = threading.Event()
    finish = ArchiveSaveJob.finish
    calls = 0

    def full(job: ArchiveSaveJob, timeout: float | None = None) -> Any:
        nonlocal calls
        calls += 1
        if calls != nth:
            return finish(job, timeout)
        assert gate.wait(60), "the test never released the save"
        assert job.handle is not None
        job.handle.wait()
        error = OSError(errno.ENOSPC, "No space left on device (simulated)", job.path)
        job._discard(error)
        raise error

    monkeypatch.setattr(ArchiveSaveJob, "finish", full)
    return gate


def _listed(directory: str) -> list[str]:
    """Every entry, hidden ones included: nothing may be left beside the checkpoints."""
    return sorted(os.listdir(directory))


# ------------------------------------------------------------------------- synchronous


def test_fit_checkpoint_prune_and_resume(tmp_path: Any) -> None:
    root, ckdir = str(tmp_path), str(tmp_path / "ck")
    keep = pl.callbacks.ModelCheckpoint(dirpath=ckdir, save_last=True, save_top_k=1, monitor="step", mode="max")
    model = Tiny()
    trainer(root, 3, FastPersistCheckpointIO(), callbacks=[keep]).fit(model, loader())
    assert _listed(ckdir) == ["epoch=2-step=12.ckpt", "last.ckpt"]  # older ones removed through the plug-in
    last = os.path.join(ckdir, "last.ckpt")
    assert _read(last)["hyper_parameters"] == {"hidden": 8}

    resumed = Tiny()
    again = trainer(root, 3, FastPersistCheckpointIO())
    again.fit(resumed, loader(), ckpt_path=last)  # nothing left to train: the state is the checkpoint's
    assert again.global_step == 12
    _same_training_state(model, resumed)

    more = trainer(root, 4, FastPersistCheckpointIO())
    more.fit(Tiny(), loader(), ckpt_path=last)
    assert more.global_step == 16 and more.current_epoch == 4


class _Opaque:
    """A value no data-only format holds; torch.save pickles it, so the plug-ins save it."""

    def __init__(self, tag: str) -> None:
        self.tag = tag


@pytest.mark.parametrize("io_type", [FastPersistCheckpointIO, FastPersistAsyncCheckpointIO])
def test_whatever_torch_save_pickles_is_saved(tmp_path: Any, io_type: type) -> None:
    path = str(tmp_path / "x.ckpt")
    io = io_type()
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "hp": {"obj": _Opaque("kept")}}, path)
    state = io.load_checkpoint(path, weights_only=False)
    assert state["hp"]["obj"].tag == "kept" and torch.equal(state["state_dict"]["w"], torch.ones(2))
    io.remove_checkpoint(path)
    io.teardown()
    assert not os.path.exists(path)


# ------------------------------------------------------------------------- overlapped: in a Trainer


def test_overlapped_saves_every_n_steps_leave_exactly_what_model_checkpoint_reports(tmp_path: Any) -> None:
    root, ckdir = str(tmp_path), str(tmp_path / "ck")
    keep = rotation(ckdir, every_n_train_steps=2)
    model = seeded_model()
    trainer(root, 3, FastPersistAsyncCheckpointIO(), callbacks=[keep]).fit(model, loader())

    reported = {os.path.basename(p) for p in keep.best_k_models} | {os.path.basename(keep.last_model_path)}
    assert reported == {"epoch=2-step=10.ckpt", "epoch=2-step=12.ckpt", "last.ckpt"}
    assert _listed(ckdir) == sorted(reported)  # the removed ones are gone, nothing hidden is left
    for name in reported:
        path = os.path.join(ckdir, name)
        state = FastPersistCheckpointIO().load_checkpoint(path)  # the synchronous plug-in reads it too
        assert state["global_step"] == (12 if name == "last.ckpt" else _step_of(name))
    last = _read(os.path.join(ckdir, "last.ckpt"))
    assert torch.equal(last["state_dict"]["layer.weight"], model.layer.weight)


def test_training_goes_on_while_a_save_is_written(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    root, ckdir = str(tmp_path), str(tmp_path / "ck")
    gate = _hold_commits(monkeypatch)  # no save can commit until step 3 has trained
    seen: dict[int, bytes] = {}

    class Release(pl.Callback):  # type: ignore[misc, name-defined]
        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step == 3:
                with open(os.path.join(ckdir, "epoch=0-step=2.ckpt"), "rb") as f:
                    seen[3] = f.read()
                gate.set()

    keep = pl.callbacks.ModelCheckpoint(dirpath=ckdir, every_n_train_steps=2, save_top_k=-1)
    trainer(root, 1, FastPersistAsyncCheckpointIO(), callbacks=[keep, Release()]).fit(seeded_model(), loader())
    assert seen[3] == RESERVED  # step 3 trained while step 2's checkpoint was being written (its name reserved)
    assert _listed(ckdir) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    assert [_read(os.path.join(ckdir, n))["global_step"] for n in _listed(ckdir)] == [2, 4]


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
    _fail_commit(monkeypatch, nth=3).set()  # epoch 1's top-k save fails in the background
    with pytest.raises(OSError, match="simulated") as caught:  # raised by the save of last.ckpt after it
        trainer(root, 4, FastPersistAsyncCheckpointIO(), callbacks=[rotation(ckdir)]).fit(seeded_model(), loader())
    assert caught.value.errno == errno.ENOSPC
    assert _listed(ckdir) == ["epoch=0-step=4.ckpt", "last.ckpt"]  # the failed save's placeholder went with it
    assert _read(os.path.join(ckdir, "last.ckpt"))["global_step"] == STEPS_PER_EPOCH


def test_the_docs_recipe_runs_and_resumes(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/integrations.md's Lightning recipe, run as a script twice: the second run resumes."""
    docs = os.path.join(REPO_DIR, "docs", "integrations.md")
    with open(docs, encoding="utf-8") as f:
        section = f.read().split("\n## Lightning\n", 1)[1]
    recipe = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    first: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(recipe, "train.py", "exec"), first)
    assert _listed("ckpt") == ["epoch=1-step=64.ckpt", "epoch=2-step=96.ckpt", "last.ckpt"]
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
    gate = _hold_commits(monkeypatch)
    io.save_checkpoint(_checkpoint(2), newer)  # returns staged: the write goes on
    with open(newer, "rb") as f:
        assert f.read() == RESERVED  # the name is taken, the checkpoint not there yet
    io.remove_checkpoint(older)  # what top-k rotation asks right after saving the successor
    assert _read(older)["global_step"] == 1  # still there: its successor is not durable yet
    gate.set()
    io.teardown()
    assert _listed(str(tmp_path)) == ["epoch=1.ckpt"] and _read(newer)["global_step"] == 2


def test_a_background_failure_is_raised_by_the_next_call_and_its_predecessor_kept(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    older, newer = str(tmp_path / "epoch=0.ckpt"), str(tmp_path / "epoch=1.ckpt")
    io = FastPersistAsyncCheckpointIO()
    io.save_checkpoint(_checkpoint(1), older)
    io.wait()
    gate = _fail_commit(monkeypatch)
    io.save_checkpoint(_checkpoint(2), newer)  # staged; its commit will fail
    io.remove_checkpoint(older)
    gate.set()
    with pytest.raises(OSError) as caught:
        io.save_checkpoint(_checkpoint(3), older)
    assert caught.value.errno == errno.ENOSPC
    assert _read(older)["global_step"] == 1 and not os.path.exists(newer)  # the successor failed: kept

    io.save_checkpoint(_checkpoint(3), older)  # raised once; a new save of the path drops its removal
    io.teardown()
    assert _listed(str(tmp_path)) == ["epoch=0.ckpt"] and _read(older)["global_step"] == 3


def test_teardown_raises_a_failure_no_call_raised_and_says_what_it_kept(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    older, newer = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    io = FastPersistAsyncCheckpointIO()
    io.save_checkpoint(_checkpoint(1), older)
    io.wait()
    gate = _fail_commit(monkeypatch)
    io.save_checkpoint(_checkpoint(2), newer)
    io.remove_checkpoint(older)
    gate.set()
    with caplog.at_level("WARNING", logger="fastpersist"), pytest.raises(OSError, match="simulated"):
        io.teardown()
    assert "kept" in caplog.text and "a.ckpt" in caplog.text
    assert _listed(str(tmp_path)) == ["a.ckpt"]
    io.teardown()  # raised once


def test_removing_the_path_being_saved_cancels_that_save(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "last.ckpt")
    io = FastPersistAsyncCheckpointIO()
    io.save_checkpoint(_checkpoint(1), path)
    io.wait()
    gate = _hold_commits(monkeypatch)
    _release_on_cancel(monkeypatch, gate)
    io.save_checkpoint(_checkpoint(2), path)
    io.remove_checkpoint(path)
    assert gate.is_set() and not os.path.exists(path)  # neither the new checkpoint nor the old one
    io.teardown()  # the cancellation was the plug-in's own: nothing to raise
    assert os.listdir(tmp_path) == []


def test_removing_a_new_path_being_saved_removes_its_placeholder(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "epoch=0.ckpt")
    io = FastPersistAsyncCheckpointIO()
    gate = _hold_commits(monkeypatch)
    io.save_checkpoint(_checkpoint(1), path)
    assert os.path.isfile(path)  # reserved
    _release_on_cancel(monkeypatch, gate)
    io.remove_checkpoint(path)
    io.teardown()
    assert os.listdir(tmp_path) == []
