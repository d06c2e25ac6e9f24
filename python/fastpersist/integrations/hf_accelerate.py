"""Accelerate's ``save_state``/``load_state`` with the models' weights written by fastpersist,
through the two hooks Accelerate offers (``register_save_state_pre_hook``,
``register_load_state_pre_hook``): :class:`FastPersistStateHooks`.

    >>> hooks = FastPersistStateHooks().install(accelerator)      # doctest: +SKIP
    >>> accelerator.save_state("ckpt/step-100")                   # returns once the weights are staged
    >>> hooks.wait()                                              # doctest: +SKIP
    >>> accelerator.load_state("ckpt/step-100")                   # doctest: +SKIP

The save hook takes each model's state dict out of the list Accelerate would write and starts
:func:`fastpersist.save_async` of it into ``model_fastpersist`` (``model_{i}_fastpersist``)
beside Accelerate's files: a fastpersist checkpoint (aligned O_DIRECT writes, crc32c on every
chunk, atomic rename), written during the next steps. Each prepared optimizer's ``step()``
first waits until those weights are staged. The load hook waits for the saves in flight, then
fills each model's tensors in place from its checkpoint (all or nothing, checksums verified)
and takes the model out of the list Accelerate would load; a folder saved without the hooks
(no ``model_fastpersist``) is left to Accelerate's own loader.

What the hooks cannot reach, since Accelerate writes and reads it itself after the hook: the
optimizer state (``optimizer.bin``), schedulers, the grad scaler, the RNG states
(``random_states_*.pkl``), dataloader samplers and ``register_for_checkpointing`` objects.
They stay ``torch.save`` files written synchronously by ``save_state``, with no checksum and
no fsync; :meth:`FastPersistStateHooks.wait` fsyncs them (and the directory) after the fact,
so the directory is durable once it returns, but a crash during ``save_state`` can leave them
partial. Nor can the hooks order a save's visibility: ``save_state`` writes into the folder in
place, and with ``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=k)`` it
deletes the oldest folders before the hooks run, that is, before the new one is durable, and
``load_state()`` picks the newest folder whether it is complete or not. Models of FSDP,
DeepSpeed or Megatron-LM runs are saved by Accelerate itself (their hook list is empty). For
checkpoints that appear only when complete, use :class:`~fastpersist.Checkpointer` or, under
the Trainer, :mod:`.hf_trainer`.
"""

from __future__ import annotations

import os
from typing import Any

import fastpersist._core as _core

from ..api import load, save_async
from ..config import Config
from ..futures import SaveFuture, SaveResult
from ..saving.optimizer_guard import guard_optimizer
from .hf_checkpoint import snapshot_pool_config

__all__ = ["FastPersistStateHooks", "model_dir_name"]


def model_dir_name(index: int) -> str:
    """The checkpoint directory of the `index`-th prepared model, beside Accelerate's files
    (its own names are ``model.safetensors``, ``model_1.safetensors``, ...)."""
    return "model_fastpersist" if index == 0 else f"model_{index}_fastpersist"


class FastPersistStateHooks:
    """The save and load hooks of one ``Accelerator``, and the saves they started.

    Args:
        config: engine knobs for the models' saves and loads. Without it, a model's weights are
            staged in snapshot mode (a pool of their size, capped at a quarter of RAM), so the
            step after ``save_state`` waits for one memory copy, not for the disk.

    Example:
        >>> hooks = FastPersistStateHooks().install(accelerator)   # doctest: +SKIP
        >>> accelerator.save_state(out); hooks.wait()              # doctest: +SKIP
    """

    def __init__(self, config: Config | None = None) -> None:
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config={config!r}: expected a fastpersist.Config (or None for the defaults)")
        self.config = config
        self.accelerator: Any = None
        self._in_flight: list[SaveFuture] = []
        self._last_dir: str | None = None
        self._handles: list[Any] = []
        self._guarded: set[int] = set()

    def install(self, accelerator: Any) -> FastPersistStateHooks:
        """Registers both hooks on `accelerator`; returns self. :meth:`remove` undoes it."""
        if self.accelerator is not None:
            raise RuntimeError("these hooks are installed already; make a FastPersistStateHooks per Accelerator")
        if not callable(getattr(accelerator, "register_save_state_pre_hook", None)):
            raise TypeError(
                f"accelerator={accelerator!r}: expected an accelerate.Accelerator (with register_save_state_pre_hook)"
            )
        self.accelerator = accelerator
        self._handles = [
            accelerator.register_save_state_pre_hook(self._save_hook),
            accelerator.register_load_state_pre_hook(self._load_hook),
        ]
        return self

    def remove(self) -> None:
        """Waits for the saves in flight and unregisters the hooks (the optimizer guards stay)."""
        self.wait()
        for handle in self._handles:
            handle.remove()
        self._handles, self.accelerator = [], None

    @property
    def saves_in_flight(self) -> list[SaveFuture]:
        """The models' saves started by the last ``save_state`` and not yet waited for."""
        return list(self._in_flight)

    def wait_staged(self, timeout: float | None = None) -> None:
        """Returns once the weights being saved may be modified (what ``optimizer.step()`` calls;
        `timeout` applies to each model's save)."""
        for fut in self._in_flight:
            fut.wait_staged(timeout)

    def wait(self) -> list[SaveResult]:
        """Blocks until the models' checkpoints are committed, then fsyncs the files Accelerate
        wrote into the same folder; returns the models' :class:`SaveResult`. Raises a save's error."""
        futures, self._in_flight = self._in_flight, []
        results = [fut.wait() for fut in futures]
        folder, self._last_dir = self._last_dir, None
        if folder is not None:
            ours = {r.path for r in results}
            for root, dirs, files in os.walk(folder):
                dirs[:] = [d for d in dirs if os.path.join(root, d) not in ours]  # durable already
                for name in files:
                    path = os.path.join(root, name)
                    if os.path.isfile(path) and not os.path.islink(path):
                        _core.fsync_path(path)
                _core.fsync_dir(root)
        return results

    def _save_hook(self, models: list[Any], weights: list[dict[str, Any]], output_dir: str) -> None:
        self.wait()  # one save_state in flight at a time
        for optimizer in self.accelerator._optimizers:
            inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer's step bypasses its own hooks
            if id(inner) not in self._guarded:
                guard_optimizer(inner, self)
                self._guarded.add(id(inner))
        self._last_dir = output_dir
        self._in_flight = []
        for i, state in enumerate(weights):
            path = os.path.join(output_dir, model_dir_name(i))
            config = self.config or snapshot_pool_config(state.values(), output_dir)
            self._in_flight.append(save_async(state, path, config=config))
        weights.clear()  # Accelerate writes no model file of its own

    def _load_hook(self, models: list[Any], input_dir: str) -> None:
        self.wait()
        paths = [os.path.join(input_dir, model_dir_name(i)) for i in range(len(models))]
        found = [os.path.isdir(p) for p in paths]
        if not any(found):
            return  # a folder saved without these hooks: Accelerate loads its own model files
        if not all(found):
            missing = [p for p, there in zip(paths, found, strict=True) if not there]
            raise FileNotFoundError(
                f"load_state({input_dir!r}): {len(models)} models are prepared but {missing} hold no fastpersist "
                "checkpoint; prepare the same models, in the same order, as the run that saved this folder"
            )
        for model, path in zip(models, paths, strict=True):
            load(path, out=model.state_dict(), config=self.config or Config())
        models.clear()  # loaded: Accelerate must not look for its own model files
