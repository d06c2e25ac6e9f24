"""The Lightning CheckpointIO plug-in: a tiny Trainer fits, checkpoints, prunes and resumes."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import fastpersist as fp  # noqa: E402
from fastpersist.integrations.lightning import FastPersistCheckpointIO  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


class Tiny(pl.LightningModule):  # type: ignore[misc, name-defined]
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, _index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}


def _loader() -> DataLoader[Any]:
    gen = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(64, 4, generator=gen), torch.randn(64, 1, generator=gen)), batch_size=16
    )


def _trainer(root: str, epochs: int, **kwargs: Any) -> Any:
    return pl.Trainer(
        max_epochs=epochs,
        default_root_dir=root,
        plugins=[FastPersistCheckpointIO()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def test_fit_checkpoint_prune_and_resume(tmp_path: Any) -> None:
    root, ckdir = str(tmp_path), str(tmp_path / "ck")
    keep = pl.callbacks.ModelCheckpoint(dirpath=ckdir, save_last=True, save_top_k=1, monitor="step", mode="max")
    model = Tiny()
    _trainer(root, 3, callbacks=[keep]).fit(model, _loader())
    assert sorted(os.listdir(ckdir)) == ["epoch=2-step=12.ckpt", "last.ckpt"]  # older ones removed through the plug-in
    last = os.path.join(ckdir, "last.ckpt")
    fp.verify(last)
    assert fp.load(last)["hyper_parameters"] == {"hidden": 8}

    resumed = Tiny()
    again = _trainer(root, 3)
    again.fit(resumed, _loader(), ckpt_path=last)  # nothing left to train: the state is the checkpoint's
    assert again.global_step == 12
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    opt_a, opt_b = model.optimizers().optimizer.state_dict(), resumed.optimizers().optimizer.state_dict()
    assert torch.equal(opt_a["state"][0]["exp_avg"], opt_b["state"][0]["exp_avg"])

    more = _trainer(root, 4)
    more.fit(Tiny(), _loader(), ckpt_path=last)
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
