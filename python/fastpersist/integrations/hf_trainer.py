"""Hugging Face ``Trainer`` checkpoints overlapped with training: :class:`FastPersistTrainer`
and :class:`FastPersistTrainerMixin` (to combine with another ``Trainer`` subclass).

    >>> from fastpersist.integrations.hf_trainer import FastPersistTrainer
    >>> trainer = FastPersistTrainer(model=model, args=args, train_dataset=data)   # doctest: +SKIP
    >>> trainer.train(resume_from_checkpoint=True)                                 # doctest: +SKIP

A checkpoint holds the files ``Trainer`` writes, under their names, in their formats, so a
stock ``Trainer`` resumes from it and ``from_pretrained`` reads its weights:

* the weights (``model.safetensors``, ``config.json``, ...) are written by ``Trainer._save``
  itself, on a background thread, from a copy of the state dict in host memory taken at the
  save (tied weights stay tied in the copy): the copy is the staging, one memory copy of the
  weights, whose buffers are kept and reused by the next save (host memory of the weights'
  size, as fastpersist's snapshot pool);
* ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth`` (and ``scaler.pt``) are written by
  :func:`fastpersist.torch_save_async`: ``torch.load``'s format with real zip CRC-32s, which
  Trainer's own loader reads, staged by the engine from the tensors themselves into its pool
  (by default one of the optimizer state's size: staging is a memory copy), with the mutation
  guard watching them.

The save returns once the copy is taken and the files' writes have started; the writes go on
during the next steps. A checkpoint is assembled in ``.fastpersist-checkpoint-N`` (a name that
neither ``get_last_checkpoint`` nor ``save_total_limit`` rotation matches); once every file of
it is durable, ``trainer_state.json`` is written and fsynced, then the directory is renamed to
``checkpoint-N`` and its parent fsynced. So ``resume_from_checkpoint=True`` only ever finds a
checkpoint that is complete, and rotation runs after that rename: it never deletes a checkpoint
before its successor is durable. A kill -9 mid-save leaves the previous checkpoints as they were
and a staging directory that the next ``train()`` or save removes (:mod:`.hf_checkpoint`).

Where the waits sit in Trainer's loop (``_save_checkpoint`` runs after ``optimizer.step()``):

* before the next ``optimizer.step()`` (a step pre-hook on the torch optimizer): staging of the
  optimizer state ends; the step then modifies nothing a save still reads;
* before a new checkpoint starts: the previous one commits (at most one in flight, so a
  checkpoint slower than the save interval slows the loop rather than queueing);
* at the end of ``train()`` (before ``load_best_model_at_end`` and the final rotation) and at
  its start, and before any load (``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``,
  ``_load_rng_state``, ``_load_best_model``): the checkpoint in flight commits;
* :meth:`FastPersistTrainerMixin.wait_for_checkpoint` waits for it on demand.

Several processes (DDP, ``torchrun``): the process that saves (Trainer's ``should_save``) makes
the staging directory and writes the weights, optimizer and scheduler; every rank writes its
``rng_state_{rank}.pth`` into it; the ranks agree over a private gloo group that every file is
durable before the rename, and again after it, so no rank reads a checkpoint before it is in
place; a failure on any rank fails the checkpoint on every rank. DeepSpeed, FSDP, XLA, SageMaker
and ``push_to_hub`` are refused at the first save, naming the setting; use
``transformers.Trainer`` there.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import random
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

try:
    import transformers
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
    from transformers.utils.import_utils import is_sagemaker_mp_enabled, is_torch_xla_available
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("fastpersist.integrations.hf_trainer needs transformers: pip install transformers") from e
from ..config import Config
from ..distributed.control import ControlGroup, control_for
from ..futures import SaveFuture
from ..interop.torchasync import torch_save_async
from .hf_checkpoint import HFCheckpoint, agree, remove_leftovers, snapshot_pool_config, snapshot_state_dict, staging_dir

__all__ = ["FastPersistTrainer", "FastPersistTrainerMixin"]

log = logging.getLogger("fastpersist")


def _unsupported_setting(trainer: Any) -> str | None:
    """The Trainer setting this integration does not handle, if any (named for the error)."""
    args = trainer.args
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "DeepSpeed (args.deepspeed)"
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_fsdp_xla_enabled", False):
        return "FSDP (args.fsdp)"
    if is_torch_xla_available():
        return "XLA (torch_xla is installed)"
    if is_sagemaker_mp_enabled():
        return "SageMaker model parallelism"
    if args.push_to_hub:
        return "args.push_to_hub=True"
    return None


class FastPersistTrainerMixin:
    """Overrides ``Trainer``'s checkpoint save so it overlaps with training (module docstring).

    Put it first among the bases: ``class MyTrainer(FastPersistTrainerMixin, SFTTrainer)``.
    `fastpersist_config` (keyword of ``__init__``) sets the engine knobs of the
    ``torch_save_async`` writes. Without it, the staging pool is sized to the optimizer state
    (snapshot mode, as a Checkpointer's: capped at a quarter of RAM, at least 256 MiB), so the
    step after a save waits for one memory copy, not for the disk (docs/overlap.md).
    """

    # Set by Trainer; declared for the type checker.
    args: Any
    state: Any
    control: Any
    callback_handler: Any
    optimizer: Any
    lr_scheduler: Any
    accelerator: Any
    hp_search_backend: Any
    model: Any

    def __init__(self, *args: Any, fastpersist_config: Config | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if fastpersist_config is not None and not isinstance(fastpersist_config, Config):
            raise TypeError(
                f"fastpersist_config={fastpersist_config!r}: expected a fastpersist.Config (or None for the defaults)"
            )
        self.fastpersist_config = fastpersist_config
        self._fp_in_flight: HFCheckpoint | None = None
        self._fp_commit: concurrent.futures.Future[str] | None = None
        self._fp_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fastpersist-hf-checkpoint")
        self._fp_guarded: Any = None
        self._fp_guard_handle: Any = None
        self._fp_snapshot: dict[str, torch.Tensor] | None = None

    # ---- the waits ----

    def wait_for_checkpoint(self) -> str | None:
        """Blocks until the checkpoint in flight is durable, renamed and rotated; returns its
        directory (None if none was in flight). Raises the save's error, once."""
        commit, self._fp_commit, self._fp_in_flight = self._fp_commit, None, None
        return None if commit is None else commit.result()

    @property
    def checkpoint_in_flight(self) -> HFCheckpoint | None:
        """The checkpoint saved last, until the next save or wait takes it (None after a wait)."""
        return self._fp_in_flight

    def _fp_wait_staged(self) -> None:
        if self._fp_in_flight is not None:
            self._fp_in_flight.wait_staged()

    def _fp_guard(self) -> None:
        """The step pre-hook on the torch optimizer under Accelerate's wrapper (whose own step
        bypasses hooks registered on the wrapper)."""
        inner = self.optimizer
        while hasattr(inner, "optimizer") and isinstance(inner.optimizer, torch.optim.Optimizer):
            inner = inner.optimizer
        if inner is self._fp_guarded:
            return
        if self._fp_guard_handle is not None:
            self._fp_guard_handle.remove()
        self._fp_guard_handle = inner.register_step_pre_hook(lambda *_: self._fp_wait_staged())
        self._fp_guarded = inner

    def train(self, *args: Any, **kwargs: Any) -> Any:
        self.wait_for_checkpoint()  # resume_from_checkpoint=True must see the newest one
        if self.args.should_save:
            remove_leftovers(self.args.output_dir)
        try:
            result = super().train(*args, **kwargs)  # type: ignore[misc]
        except BaseException:
            try:  # the checkpoint in flight still commits; training's own error is the one to raise
                self.wait_for_checkpoint()
            except Exception:
                log.exception("the checkpoint in flight when training failed did not commit")
            raise
        self.wait_for_checkpoint()
        return result

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        self.wait_for_checkpoint()  # load_best_model_at_end and the last rotation read the checkpoints
        return super()._finalize_training(*args, **kwargs)  # type: ignore[misc]

    def _load_from_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        self.wait_for_checkpoint()
        return super()._load_from_checkpoint(*args, **kwargs)  # type: ignore[misc]

    def _load_optimizer_and_scheduler(self, *args: Any, **kwargs: Any) -> Any:
        self.wait_for_checkpoint()
        return super()._load_optimizer_and_scheduler(*args, **kwargs)  # type: ignore[misc]

    def _load_rng_state(self, *args: Any, **kwargs: Any) -> Any:
        self.wait_for_checkpoint()
        return super()._load_rng_state(*args, **kwargs)  # type: ignore[misc]

    def _load_best_model(self, *args: Any, **kwargs: Any) -> Any:
        self.wait_for_checkpoint()
        return super()._load_best_model(*args, **kwargs)  # type: ignore[misc]

    # ---- the save ----

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        unsupported = _unsupported_setting(self)
        if unsupported is not None:
            raise ValueError(
                f"FastPersistTrainer does not overlap checkpoints with {unsupported}; "
                "use transformers.Trainer (or drop the mixin) for this run"
            )
        self.wait_for_checkpoint()
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.hp_search_backend is None and trial is None:
            self.store_flos()  # type: ignore[attr-defined]
        run_dir = self._get_output_dir(trial=trial)  # type: ignore[attr-defined]
        final = os.path.join(run_dir, name)
        staging = staging_dir(final)
        renames = bool(self.args.should_save)
        control = self._fp_control()
        error: BaseException | None = None
        if renames:
            try:
                os.makedirs(run_dir, exist_ok=True)
                remove_leftovers(run_dir)
                os.makedirs(staging)
            except BaseException as e:
                error = e
        agree(control, f"make {staging}", error, final)  # the other ranks write their RNG files into it

        weights = None
        if renames:
            weights = self._fp_snapshot = snapshot_state_dict(self.model.state_dict(), into=self._fp_snapshot)
        futures = [] if self.args.save_only_model else self._fp_start_training_state(staging)
        self._fp_record_best(run_dir, name)
        checkpoint = HFCheckpoint(
            staging=staging,
            final=final,
            futures=futures,
            trainer_state_json=self._fp_trainer_state_json(),
            save_weights=None if weights is None else lambda: self._save(staging, state_dict=weights),  # type: ignore[attr-defined]
            rotate=self._fp_rotation(run_dir),
            renames=renames,
            control=control,
        )
        self._fp_in_flight = checkpoint
        self._fp_commit = self._fp_thread.submit(checkpoint.commit)
        if futures:
            self._fp_guard()

    def _fp_control(self) -> ControlGroup | None:
        """The ranks' private gloo group (made by the first save, on every rank), None for one process.
        Its collectives run on the checkpoint thread and, while none is in flight, on the loop's."""
        if self.args.world_size <= 1:
            return None
        return control_for(None, (self.fastpersist_config or Config()).timeout_s, lane="hf-trainer")

    def _fp_start_training_state(self, staging: str) -> list[SaveFuture]:
        """Starts the writes of the optimizer, scheduler and scaler files (the process that saves)
        and of this rank's RNG file into `staging`, under Trainer's names."""
        config = self.fastpersist_config or Config()
        futures = []
        if self.args.should_save:
            optimizer = self.optimizer.state_dict()
            if self.fastpersist_config is None:
                tensors = [t for per_param in optimizer["state"].values() for t in per_param.values()]
                config = snapshot_pool_config(tensors, staging)
            futures.append(torch_save_async(optimizer, os.path.join(staging, "optimizer.pt"), config=config))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the scheduler's "please also save the optimizer" warning
                scheduler = self.lr_scheduler.state_dict()
            futures.append(torch_save_async(scheduler, os.path.join(staging, "scheduler.pt"), config=config))
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                futures.append(torch_save_async(scaler.state_dict(), os.path.join(staging, "scaler.pt"), config=config))
        rng: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "cpu": torch.random.get_rng_state(),
        }
        distributed = self.args.world_size > 1
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
        name = f"rng_state_{self.args.process_index}.pth" if distributed else "rng_state.pth"
        futures.append(torch_save_async(rng, os.path.join(staging, name), config=config))
        return futures

    def _fp_record_best(self, run_dir: str, name: str) -> None:
        """``state.best_model_checkpoint`` as Trainer sets it; the checkpoint being saved counts
        as existing (Trainer checks for its directory, which it has already written)."""
        best_step = self.state.best_global_step
        if not best_step or self.args.save_strategy not in ("steps", "epoch", "best"):
            return
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best_step}")
        if best == os.path.join(run_dir, name) or os.path.exists(best):
            self.state.best_model_checkpoint = best

    def _fp_trainer_state_json(self) -> str:
        """trainer_state.json's text now (the state goes on changing while the files are written)."""
        for cb in [c for c in [*self.callback_handler.callbacks, self.control] if isinstance(c, ExportableState)]:
            cb_name = cb.__class__.__name__
            if isinstance(self.state.stateful_callbacks.get(cb_name), list):
                self.state.stateful_callbacks[cb_name].append(cb.state())
            else:
                self.state.stateful_callbacks[cb_name] = cb.state()
        return json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"

    def _fp_rotation(self, run_dir: str) -> Callable[[], None]:
        limit = self.args.save_total_limit
        best = self.state.best_model_checkpoint

        def rotate() -> None:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit, best_model_checkpoint=best, use_mtime=True)

        return rotate


class FastPersistTrainer(FastPersistTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` whose checkpoints are written by fastpersist, overlapped with
    the next steps (module docstring). Takes Trainer's arguments plus `fastpersist_config`.

    Example:
        >>> trainer = FastPersistTrainer(model=model, args=args, train_dataset=data)   # doctest: +SKIP
        >>> trainer.train()                                                            # doctest: +SKIP
        >>> trainer.train(resume_from_checkpoint=True)                                 # doctest: +SKIP
    """
