"""The README's examples run: every ```python block in order, then its CLI lines."""

from __future__ import annotations

import os
import re
import shlex
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fastpersist.tools import cli

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
SLOW_COMMANDS = {"demo", "bench", "tune"}  # run at small sizes by test_cli.py, test_bench.py, test_tune.py


def blocks(language: str) -> list[str]:
    text = open(README).read()
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


class Model(torch.nn.Module):
    """What the README's training loop calls: ``model(batch).loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def forward(self, batch: Any) -> SimpleNamespace:
        x, y = batch
        return SimpleNamespace(loss=torch.nn.functional.mse_loss(self.layer(x), y))


def namespace() -> dict[str, Any]:
    """The names the README's snippets take as given: a model, its optimizer, a loader."""
    gen = torch.Generator().manual_seed(0)
    loader = DataLoader(
        TensorDataset(torch.randn(400, 4, generator=gen), torch.randn(400, 1, generator=gen)), batch_size=4
    )
    model = Model()
    names: dict[str, Any] = {"model": model, "optimizer": torch.optim.AdamW(model.parameters()), "loader": loader}
    try:
        import lightning.pytorch as pl
    except ImportError:
        return names

    class LitModel(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = Model()

        def training_step(self, batch: Any, _index: int) -> torch.Tensor:
            return self.net(batch).loss  # type: ignore[no-any-return]

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters())

    names["lit_model"] = LitModel()
    return names


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_readme_examples_run(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lightning")
    monkeypatch.chdir(tmp_path)
    assert os.listdir(".") == []  # as a newcomer runs them: an empty directory, nothing made first
    python = blocks("python")
    assert len(python) >= 5
    names = namespace()
    for i, code in enumerate(python):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exec(compile(code, f"README.md python block {i + 1}", "exec"), names)
    assert torch.load("model.pt", weights_only=True)["step"] == 99
    commands = [line.split("#")[0].strip() for block in blocks("bash") for line in block.splitlines()]
    ran = 0
    for command in commands:
        argv = shlex.split(command)
        if argv[:1] == ["fastpersist"] and argv[1] not in SLOW_COMMANDS:
            assert cli.main(argv[1:]) == 0, command
            ran += 1
    assert ran >= 5
    assert os.path.isdir("ckpt/from-safetensors")


def test_the_multi_node_recipe_compiles() -> None:
    """The torchrun script (```python train.py```) needs a real multi-node job, so it is only
    compiled here; tests/levels/test_levels.py runs its scenario on 4 ranks as 2 simulated nodes."""
    scripts = re.findall(r"```python train\.py\n(.*?)```", open(README).read(), flags=re.DOTALL)
    assert len(scripts) == 1 and "replicas=1" in scripts[0] and "ck.load()" in scripts[0]
    compile(scripts[0], "README.md train.py", "exec")
