"""The Hugging Face Trainer run of tests/integrations/test_hf_trainer.py: a tiny GPT-2 built from
a config (nothing downloaded, dropout on, so the RNG state matters), deterministic data, CPU.

Run as a script (``python hf_trainer_workers.py OUT``) it trains in OUT and makes every weights
write after the first checkpoint hang, announcing it in OUT/slow-save, so that the test can
kill it with SIGKILL while a checkpoint is in flight. Under ``torchrun`` as
``hf_trainer_workers.py ddp OUT`` it is one rank of a 2-process run (:func:`ddp_full_then_resumed`).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

#: Optimizer steps of a full run, and the interval between checkpoints.
STEPS, SAVE_STEPS = 8, 2


class TokenData(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """32 fixed sequences of 16 tokens; the labels are the inputs (causal LM)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, 64, (32, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> Any:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def training_args(out: str, **overrides: Any) -> Any:
    import transformers

    settings: dict[str, Any] = dict(
        output_dir=out,
        use_cpu=True,
        per_device_train_batch_size=4,
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        logging_steps=1,
        learning_rate=1e-2,
        seed=0,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    settings.update(overrides)
    return transformers.TrainingArguments(**settings)


def recording(base: type) -> type:
    """`base` (a Trainer class) recording every training step's exact loss in ``self.losses``."""

    class Recording(base):  # type: ignore[valid-type, misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.losses: list[float] = []

        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss: torch.Tensor = super().training_step(*args, **kwargs)
            self.losses.append(loss.item())
            return loss

    return Recording


def make_trainer(out: str, base: type | None = None, **overrides: Any) -> Any:
    from fastpersist.integrations.hf_trainer import FastPersistTrainer

    cls = recording(base or FastPersistTrainer)
    return cls(model=tiny_gpt2(), args=training_args(out, **overrides), train_dataset=TokenData())


def _slow_after_first(out: str) -> type:
    """FastPersistTrainer whose weights writes after the first checkpoint's never end (OUT/slow-save
    names the checkpoint), and which writes how many steps it trained into OUT/steps."""
    from fastpersist.integrations.hf_trainer import FastPersistTrainer

    class SlowSaves(FastPersistTrainer):  # type: ignore[misc]
        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss: torch.Tensor = super().training_step(*args, **kwargs)
            self.trained = getattr(self, "trained", 0) + 1
            with open(os.path.join(out, "steps"), "w") as f:
                f.write(str(self.trained))
            return loss

        def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
            super()._save(output_dir, state_dict)
            if os.path.basename(output_dir or "").endswith(f"-{SAVE_STEPS}"):
                return
            with open(os.path.join(out, "slow-save"), "w") as f:
                f.write(output_dir or "")
            time.sleep(600)

    return SlowSaves


def ddp_full_then_resumed(out: str) -> None:
    """Each rank of a 2-process (gloo) run: a whole run in OUT/full, then one resumed from a copy
    of its checkpoint-4 in OUT/resumed; writes OUT/rank-R.json with both runs' losses and
    whether the final weights are equal."""
    import json
    import shutil

    import torch.distributed as dist

    full = make_trainer(os.path.join(out, "full"), ddp_backend="gloo")
    full.train()
    resumed_dir = os.path.join(out, "resumed")
    if full.args.process_index == 0:
        shutil.copytree(os.path.join(out, "full", f"checkpoint-{2 * SAVE_STEPS}"), resumed_dir + "/checkpoint-4")
    dist.barrier()
    resumed = make_trainer(resumed_dir, ddp_backend="gloo")
    resumed.train(resume_from_checkpoint=True)
    a, b = full.model.state_dict(), resumed.model.state_dict()
    result = {"full": full.losses, "resumed": resumed.losses, "same_weights": all(torch.equal(a[k], b[k]) for k in a)}
    with open(os.path.join(out, f"rank-{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if sys.argv[1] == "ddp":
        ddp_full_then_resumed(sys.argv[2])
    else:
        out_dir = sys.argv[1]
        make_trainer(out_dir, _slow_after_first(out_dir)).train()
