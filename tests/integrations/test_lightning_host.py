"""The Lightning plug-ins in the host's hands: what Lightning and its users do with a checkpoint.

Each ``.ckpt`` is the file Lightning's own TorchCheckpointIO writes (torch.load, pl_load,
load_from_checkpoint and os.path.isfile see an ordinary checkpoint), a stock ``.ckpt`` resumes
through the plug-ins, the plug-ins pickle (torch.save(trainer), ddp_spawn), Lightning's
AsyncCheckpointIO wrapper ends fit with every save committed, and ModelCheckpoint's ``-vN``
names come out as with TorchCheckpointIO although the saves are still in flight.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
import zipfile
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from lightning.fabric.utilities.cloud_io import _load as pl_load  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO  # noqa: E402

import fastpersist as fp  # noqa: E402
from fastpersist.integrations.lightning import (  # noqa: E402
    RESERVED,
    FastPersistAsyncCheckpointIO,
    FastPersistCheckpointIO,
)
from fastpersist.interop.torchasync import ArchiveSaveJob  # noqa: E402

from lightning_workers import STEPS_PER_EPOCH, Tiny, loader, rotation, seeded_model, trainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

PLUG_INS = [FastPersistCheckpointIO, FastPersistAsyncCheckpointIO]


def _members(data: bytes) -> dict[str, bytes]:
    """A torch.save archive's records by name, less the id torch derives from its own running CRC."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {n.split("/", 1)[1]: z.read(n) for n in z.namelist() if not n.endswith("serialization_id")}


def _committed(path: str) -> bool:
    """Whether `path` holds a checkpoint (neither missing nor a placeholder)."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(len(RESERVED) + 1) != RESERVED


# ------------------------------------------------------------------------- the host's format


@pytest.mark.parametrize("io_type", PLUG_INS)
def test_a_ckpt_is_the_file_torch_checkpoint_io_writes_and_every_reader_reads_it(tmp_path: Any, io_type: type) -> None:
    ckdir = str(tmp_path / "ck")
    model = seeded_model()
    trainer(str(tmp_path), 2, io_type(), callbacks=[rotation(ckdir)]).fit(model, loader())
    last = os.path.join(ckdir, "last.ckpt")
    assert os.path.isfile(last)

    state = torch.load(last, weights_only=False)
    assert state["global_step"] == 2 * STEPS_PER_EPOCH
    assert torch.equal(pl_load(last)["state_dict"]["layer.weight"], model.layer.weight)  # weights_only as torch's
    restored = Tiny.load_from_checkpoint(last)
    assert restored.hparams.hidden == 8 and torch.equal(restored.layer.weight, model.layer.weight)

    ours, stock = str(tmp_path / "ours.ckpt"), str(tmp_path / "stock.ckpt")
    plug_in = io_type()
    plug_in.save_checkpoint(state, ours)
    plug_in.teardown()
    TorchCheckpointIO().save_checkpoint(state, stock)
    with open(ours, "rb") as a, open(stock, "rb") as b:
        assert _members(a.read()) == _members(b.read())  # every record, byte for byte


@pytest.mark.parametrize("io_type", PLUG_INS)
def test_a_stock_ckpt_resumes_through_the_plug_in_exactly(tmp_path: Any, io_type: type) -> None:
    reference = seeded_model()
    trainer(str(tmp_path / "ref"), 4, TorchCheckpointIO(), enable_checkpointing=False).fit(reference, loader())

    root, ckdir = str(tmp_path / "run"), str(tmp_path / "run" / "ck")
    trainer(root, 2, TorchCheckpointIO(), callbacks=[rotation(ckdir)]).fit(seeded_model(), loader())
    resumed = seeded_model(seed=1)
    trainer(root, 4, io_type(), callbacks=[rotation(ckdir)]).fit(
        resumed, loader(), ckpt_path=os.path.join(ckdir, "last.ckpt")
    )
    assert resumed.losses == reference.losses[2 * STEPS_PER_EPOCH :]
    for a, b in zip(reference.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    assert sorted(os.listdir(ckdir)) == ["epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt", "last.ckpt"]


@pytest.mark.parametrize("io_type", PLUG_INS)
def test_a_checkpoint_directory_of_earlier_versions_still_loads_and_is_removed(tmp_path: Any, io_type: type) -> None:
    root, ckdir = str(tmp_path), str(tmp_path / "ck")
    trainer(root, 1, TorchCheckpointIO(), callbacks=[rotation(ckdir)]).fit(seeded_model(), loader())
    state = torch.load(os.path.join(ckdir, "last.ckpt"), weights_only=False)
    state["hyper_parameters"] = dict(state["hyper_parameters"])  # earlier versions stored plain dicts
    old = os.path.join(ckdir, "old.ckpt")
    fp.save(state, old)  # what earlier versions of the plug-ins wrote at a .ckpt path

    resumed = trainer(root, 2, io_type())
    resumed.fit(seeded_model(seed=1), loader(), ckpt_path=old)
    assert resumed.global_step == 2 * STEPS_PER_EPOCH
    plug_in = io_type()
    plug_in.remove_checkpoint(old)
    plug_in.teardown()
    assert not os.path.exists(old)


# ------------------------------------------------------------------------- pickling


def test_the_async_plug_in_pickles_with_a_save_in_flight_and_the_copy_starts_afresh(tmp_path: Any) -> None:
    plug_in = FastPersistAsyncCheckpointIO(config=fp.Config(pool_bytes=32 << 20))
    path = str(tmp_path / "a.ckpt")
    plug_in.save_checkpoint({"w": torch.arange(1 << 20)}, path)
    copy = pickle.loads(pickle.dumps(plug_in))  # waits for the save in flight
    assert _committed(path) and copy.config.pool_bytes == 32 << 20
    assert torch.equal(copy.load_checkpoint(path)["w"], torch.arange(1 << 20))
    copy.save_checkpoint({"w": torch.zeros(4)}, str(tmp_path / "b.ckpt"))
    copy.teardown()
    plug_in.teardown()
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "b.ckpt"]


class _PicklePlugIn(pl.Callback):  # type: ignore[misc, name-defined]
    """Pickles the Trainer's plug-in at each batch's start, with the previous step's save in flight."""

    def __init__(self) -> None:
        self.pickled: list[bytes] = []

    def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
        self.pickled.append(pickle.dumps(trainer.strategy.checkpoint_io))


def test_a_trainer_pickles_during_and_after_fit(tmp_path: Any) -> None:
    during = _PicklePlugIn()
    keep = rotation(str(tmp_path / "ck"), every_n_train_steps=1)
    t = trainer(str(tmp_path), 1, FastPersistAsyncCheckpointIO(), callbacks=[keep, during])
    t.fit(seeded_model(), loader())
    buffer = io.BytesIO()
    torch.save(t, buffer)  # as Lightning's own tests pickle a Trainer
    assert len(during.pickled) == STEPS_PER_EPOCH and buffer.tell() > 0
    assert sorted(os.listdir(tmp_path / "ck")) == ["epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]


def test_ddp_spawn_carries_the_plug_in_into_its_process(tmp_path: Any) -> None:
    ckdir = str(tmp_path / "ck")
    t = trainer(
        str(tmp_path),
        1,
        FastPersistAsyncCheckpointIO(),
        callbacks=[rotation(ckdir)],
        strategy="ddp_spawn",
        accelerator="cpu",
        devices=1,
    )
    t.fit(seeded_model(), loader())
    assert sorted(os.listdir(ckdir)) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert torch.load(os.path.join(ckdir, "last.ckpt"), weights_only=False)["global_step"] == STEPS_PER_EPOCH


# ------------------------------------------------------------------------- Lightning's AsyncCheckpointIO


def test_under_lightning_async_checkpoint_io_fit_ends_with_every_save_committed(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    finish = ArchiveSaveJob.finish

    def slow(job: ArchiveSaveJob, timeout: float | None = None) -> Any:
        threading.Event().wait(0.2)  # a commit well behind its save's return
        return finish(job, timeout)

    monkeypatch.setattr(ArchiveSaveJob, "finish", slow)
    at_return: list[bool] = []

    class Recording(FastPersistAsyncCheckpointIO):
        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            super().save_checkpoint(checkpoint, path, storage_options)
            at_return.append(_committed(path))

    ckdir = str(tmp_path / "ck")
    keep = pl.callbacks.ModelCheckpoint(dirpath=ckdir, save_top_k=-1, save_last=True, every_n_train_steps=2)
    trainer(str(tmp_path), 2, AsyncCheckpointIO(Recording()), callbacks=[keep]).fit(seeded_model(), loader())
    assert len(at_return) == 8 and all(at_return)  # run by the wrapper, each save returned durable
    names = sorted(os.listdir(ckdir))
    steps = [torch.load(os.path.join(ckdir, n), weights_only=False)["global_step"] for n in names]
    assert dict(zip(names, steps, strict=True)) == {
        "epoch=0-step=2.ckpt": 2,
        "epoch=0-step=4.ckpt": 4,
        "epoch=1-step=6.ckpt": 6,
        "epoch=1-step=8.ckpt": 8,
        "last.ckpt": 8,
    }


# ------------------------------------------------------------------------- ModelCheckpoint's -vN names


def test_version_suffixes_see_the_saves_in_flight(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    permits = threading.Semaphore(0)
    finish = ArchiveSaveJob.finish

    def one_behind(job: ArchiveSaveJob, timeout: float | None = None) -> Any:
        assert permits.acquire(timeout=60), "the test never released the save"
        return finish(job, timeout)

    class OneCommitBehind(FastPersistAsyncCheckpointIO):
        """Each save commits only once the next save (or teardown) is called: ModelCheckpoint
        always picks its next name while the previous save is in flight."""

        saves = 0

        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            if self.saves:
                permits.release()
            self.saves += 1
            super().save_checkpoint(checkpoint, path, storage_options)

        def teardown(self) -> None:
            permits.release()
            super().teardown()

    monkeypatch.setattr(ArchiveSaveJob, "finish", one_behind)
    outcomes = {}
    for name, plug_in in [("stock", TorchCheckpointIO()), ("ours", OneCommitBehind())]:
        ckdir = str(tmp_path / name)
        keep = pl.callbacks.ModelCheckpoint(
            dirpath=ckdir, filename="test", save_top_k=-1, monitor="step", mode="max", every_n_train_steps=1
        )
        trainer(str(tmp_path), 2, plug_in, callbacks=[keep]).fit(seeded_model(), loader())
        names = sorted(os.listdir(ckdir))
        outcomes[name] = {n: torch.load(os.path.join(ckdir, n), weights_only=False)["global_step"] for n in names}
    assert len(outcomes["stock"]) == 2 * STEPS_PER_EPOCH  # one file per save, none replaced
    assert outcomes["ours"] == outcomes["stock"]
