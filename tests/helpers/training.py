"""A small GPT-style model and training loop, used to prove that resume is exact."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn


class TinyGPT(nn.Module):
    """Embedding -> transformer blocks -> LM head tied to the embedding (like GPT-2)."""

    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 2, heads: int = 2, context: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, batch_first=True) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.context = context

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def make_run(seed: int) -> tuple[TinyGPT, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    return model, opt, sched


def train_step(model: TinyGPT, opt: torch.optim.Optimizer, sched: Any) -> float:
    """One step whose data and dropout draw on the torch, numpy and python RNGs."""
    batch = torch.randint(0, 64, (4, model.context + 1))
    noise_scale = float(np.random.rand()) * 0.01 + random.random() * 0.01
    logits = model(batch[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, 64), batch[:, 1:].reshape(-1)) + noise_scale
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.detach())


def training_state(model: TinyGPT, opt: torch.optim.Optimizer, sched: Any, step: int) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        "step": step,
    }


def restore(state: dict[str, Any], seed: int = 999) -> tuple[TinyGPT, torch.optim.Optimizer, Any, int]:
    model, opt, sched = make_run(seed)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    return model, opt, sched, state["step"]


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
