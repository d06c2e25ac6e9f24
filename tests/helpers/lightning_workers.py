"""A tiny Lightning fit shared by the Lightning tests (tests/integrations/test_lightning*.py):
the model, its data, a Trainer and the top-k rotation they use."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

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
