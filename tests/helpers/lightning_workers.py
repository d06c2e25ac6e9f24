"""A tiny Lightning fit shared by tests/integrations/test_lightning.py and the child it kills.

Run as a script (``python lightning_workers.py ROOT HOLD``), it fits with overlapped saves and
holds the HOLD-th save (counting from 1) before its manifest is written: its data files are
whole in the hidden temporary directory, nothing is at its path yet. It prints ``holding`` then,
and the test kills it with SIGKILL.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from fastpersist.integrations.lightning import FastPersistAsyncCheckpointIO
from fastpersist.saving import job

#: Batches per epoch of loader().
STEPS_PER_EPOCH = 4


class Tiny(pl.LightningModule):  # type: ignore[misc]
    """A linear layer under AdamW and a per-epoch StepLR; records each step's loss."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(4, 1)
        self.losses: list[float] = []

    def training_step(self, batch: Any, _index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)}


def seeded_model(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def loader() -> DataLoader[Any]:
    """The same 64 samples in the same order every epoch and in every process."""
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=gen), torch.randn(64, 1, generator=gen))
    return DataLoader(data, batch_size=64 // STEPS_PER_EPOCH)


def trainer(root: str, epochs: int, io: Any, **kwargs: Any) -> Any:
    return pl.Trainer(
        max_epochs=epochs,
        default_root_dir=root,
        plugins=[io],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def rotation(dirpath: str, **kwargs: Any) -> Any:
    """Top-2 by step (the newest two) and last.ckpt, saved at every epoch's end unless told otherwise."""
    return pl.callbacks.ModelCheckpoint(
        dirpath=dirpath, save_top_k=2, save_last=True, monitor="step", mode="max", **kwargs
    )


def fit_and_hold(root: str, hold: int) -> None:
    """Fits 4 epochs with overlapped saves; the `hold`-th save stops before its manifest forever."""
    write_manifest = job.write_manifest
    calls = 0

    @functools.wraps(write_manifest)
    def held(directory: str, manifest: bytes, *, durable: bool) -> None:
        nonlocal calls
        calls += 1
        if calls == hold:
            print("holding", directory, flush=True)
            time.sleep(600)
        write_manifest(directory, manifest, durable=durable)

    job.write_manifest = held
    ckdir = os.path.join(root, "ck")
    trainer(root, 4, FastPersistAsyncCheckpointIO(), callbacks=[rotation(ckdir)]).fit(seeded_model(), loader())
    print("finished", flush=True)


if __name__ == "__main__":
    fit_and_hold(sys.argv[1], int(sys.argv[2]))
