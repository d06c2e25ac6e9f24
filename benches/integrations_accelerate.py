"""Accelerate's side of benches/integrations.py: ``save_state`` stock against FastPersistStateHooks.

One process, the MLP of the DeepSpeed and Lightning runs with Adam, prepared by
``Accelerator(cpu=True)``; ``save_state`` every ``--every`` steps into a project with automatic
naming (every folder kept). Writers: Accelerate's own (``model.safetensors`` and the rest, no
fsync), the hooks as installed (``save_state`` returns with its folder committed and fsynced)
and the hooks with ``background=True`` (``save_state`` returns once the weights are staged; the
loop's time ends after ``hooks.wait()``). Same measurements as the other stacks.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from typing import Any

import integrations_workers as workers
import torch
import torch.nn.functional as F

ACC_STOCK, ACC_OURS, ACC_BACKGROUND = (
    "save_state (stock)",
    "FastPersistStateHooks()",
    "FastPersistStateHooks(background=True)",
)


class AccelerateStack:
    """Accelerate's own ``save_state`` against the hooks, both ways."""

    def __init__(self, o: dict[str, Any], root: str) -> None:
        self.o, self.root = o, root
        self.width = workers.mlp_width(o["params"])
        self.data = workers.batches(self.width, o["steps"], seed=0)
        params = sum(p.numel() for p in workers.mlp(o["params"]).parameters())
        self.title = f"MLP (8 layers, width {self.width}, {params / 1e6:.1f}M parameters), batch 8, Adam, one process"
        self.writers = [ACC_STOCK, ACC_OURS, ACC_BACKGROUND]

    def run(self, name: str, rep: int) -> dict[str, Any]:
        from accelerate import Accelerator
        from accelerate.utils import ProjectConfiguration

        from fastpersist.integrations.hf_accelerate import FastPersistStateHooks

        out = os.path.join(self.root, f"acc-{rep}-{self.writers.index(name) if name in self.writers else 'none'}")
        project = ProjectConfiguration(project_dir=out, automatic_checkpoint_naming=True)
        accelerator = Accelerator(cpu=True, project_config=project)
        torch.manual_seed(0)
        model = workers.mlp(self.o["params"])
        model, optimizer = accelerator.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-4))
        hooks = None
        if name in (ACC_OURS, ACC_BACKGROUND):
            hooks = FastPersistStateHooks(background=name == ACC_BACKGROUND).install(accelerator)
        start = time.perf_counter()
        for step, (x, y) in enumerate(self.data, 1):
            accelerator.backward(F.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            if name != workers.NONE and step % self.o["every"] == 0:
                accelerator.save_state()
        if hooks is not None:
            hooks.wait()
        result: dict[str, Any] = {"loop_s": time.perf_counter() - start}
        checkpoints = os.path.join(out, "checkpoints")
        result["ckpts"] = len(os.listdir(checkpoints)) if name != workers.NONE else 0
        if name != workers.NONE:
            os.sync()  # untimed: the loop's checkpoints still in the page cache are not written back meanwhile
            start = time.perf_counter()
            path = accelerator.save_state()
            if hooks is not None:
                hooks.wait()
            workers.fsync_tree(path)
            result |= {"durable_s": time.perf_counter() - start, "bytes": workers.tree_bytes(path)}
        del accelerator, model, optimizer, hooks
        gc.collect()
        shutil.rmtree(out, ignore_errors=True)
        return result
