"""A torchtitan ``CheckpointManager`` whose DCP saves and loads go through fastpersist.

torchtitan's trainer builds its checkpoint manager from ``Trainer.Config.checkpoint``, which
accepts any ``BaseCheckpointManager.Config``; a ``Config`` builds the class that declares it.
So the seam is one line of configuration, and nothing else in torchtitan changes:

    >>> from fastpersist.integrations.torchtitan import FastPersistCheckpointManager
    >>> checkpoint = FastPersistCheckpointManager.Config(enable=True, interval=500)
    >>> config = Trainer.Config(..., checkpoint=checkpoint)                     # doctest: +SKIP

:class:`FastPersistCheckpointManager` keeps torchtitan's whole policy (``step-N`` folders,
``interval``, ``keep_latest_k``, ``load_step``, ``exclude_from_loading``, the model-only last
save, ``async_mode="async"``) and changes only where the bytes go: ``dcp_save`` passes
:class:`~fastpersist.integrations.dcp.FastPersistWriter` (aligned writes, crc32c per chunk,
``.metadata`` written last and durably, so torchtitan's ``_find_load_step``, which counts a
``step-N`` folder only once it holds ``.metadata``, never picks a half-written one), and
``dcp_load`` passes :class:`~fastpersist.integrations.dcp.FastPersistReader` (every chunk read
is checked: a damaged file fails the load, naming the file and byte range, instead of
resuming from wrong weights). A folder written by torchtitan's stock manager (``.distcp``
files, e.g. an ``initial_load_path``) is still read with DCP's own reader, and the Hugging
Face safetensors export and import (``last_save_in_hf``, ``initial_load_in_hf``) stay
torchtitan's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

try:
    from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
    from torchtitan.components.checkpoint import AsyncMode, CheckpointManager
    from torchtitan.components.checkpointer.base import MODEL
    from torchtitan.tools.utils import GarbageCollection
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fastpersist.integrations.torchtitan needs torchtitan: pip install torchtitan "
        "(its checkpoint manager needs torchtitan, torch_checkpointing, spmd_types, torchdata and tyro)"
    ) from e

from ..config import Config
from ..format.layout import DCP_DATA_SUFFIX
from .dcp import FastPersistReader, FastPersistWriter

__all__ = ["FastPersistCheckpointManager"]


def written_by_fastpersist(checkpoint_dir: str) -> bool:
    """Whether `checkpoint_dir` holds fastpersist's DCP data files (``*.fpdcp``).

    Example:
        >>> written_by_fastpersist("/nonexistent")
        False
    """
    try:
        return any(name.endswith(DCP_DATA_SUFFIX) for name in os.listdir(checkpoint_dir))
    except FileNotFoundError:
        return False


class FastPersistCheckpointManager(CheckpointManager):  # type: ignore[misc]  # (torchtitan ships no types)
    """torchtitan's ``CheckpointManager``, saving and loading through fastpersist's DCP plug-in.

    Built by torchtitan from :class:`FastPersistCheckpointManager.Config` with the same
    arguments as ``CheckpointManager`` (``dataloader``, ``model_parts``, ``optimizers``,
    ``lr_schedulers``, ``states``, ``sd_adapter``, ``base_folder``).

    ``async_mode="async"`` overlaps the write with training: the writer copies the state into
    its own staging arena (pinned for GPU tensors) before ``save`` returns, then DCP's thread
    writes it. ``"async_with_pinned_mem"`` (DCP's process-based writer with its own pinned
    shared-memory stager) is refused by the config: our writer already stages into pinned
    memory, and a second stager would copy the state twice.

    Example:
        >>> cfg = FastPersistCheckpointManager.Config(enable=True, folder="ckpt")  # doctest: +SKIP
        >>> manager = cfg.build(dataloader=None, model_parts=[model], optimizers=opts,
        ...                     lr_schedulers=scheds, states={}, sd_adapter=None)  # doctest: +SKIP
        >>> manager.save(curr_step=10)                                             # doctest: +SKIP
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):  # type: ignore[misc]
        """``CheckpointManager.Config``, with ``async_mode`` ``"disabled"`` or ``"async"``."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM.value:
                raise ValueError(
                    "checkpoint.async_mode='async_with_pinned_mem' is not supported by "
                    "FastPersistCheckpointManager: fastpersist's writer stages the state into its "
                    "own pinned arena; use async_mode='async' for overlapped saves"
                )

    #: The engine's knobs for every save and load (``None``: the defaults and environment).
    #: Set it on the built manager (``manager.engine_config = fastpersist.Config(...)``):
    #: torchtitan's ``Config`` holds only what its command line parses.
    engine_config: Config | None = None

    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        """Saves `state_dict` into the folder `checkpoint_id` with :class:`FastPersistWriter`.

        Returns ``None`` (synchronous: durable on return) or, for ``AsyncMode.ASYNC``, the
        future DCP's ``async_save`` returns (durable once it resolves). ``to_hf=True`` (the
        safetensors export) is torchtitan's own.
        """
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        writer = FastPersistWriter(checkpoint_id, self.engine_config)
        if async_mode == AsyncMode.ASYNC:
            # torchtitan purges by listing the folder right after this returns; a folder DCP
            # made later, on its thread, would not count, and keep_latest_k would keep one more.
            # An empty folder is never loaded: torchtitan loads only a folder with a .metadata.
            os.makedirs(checkpoint_id, exist_ok=True)
            ret: Any = state_dict_saver.async_save(
                state_dict, storage_writer=writer, checkpoint_id=checkpoint_id, process_group=self.pg
            )
        elif async_mode == AsyncMode.DISABLED:
            ret = state_dict_saver.save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id)
        else:
            raise ValueError(
                f"async_mode={async_mode.value!r} is not supported by FastPersistCheckpointManager "
                "(use 'disabled' or 'async')"
            )
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        """Loads the folder `checkpoint_id` into `state_dict` with :class:`FastPersistReader`.

        Every chunk read is checked against its crc32c; a mismatch raises
        ``fastpersist.ChecksumMismatchError`` (naming the file and byte range) through DCP's
        ``CheckpointException``. A folder without fastpersist's data files (written by
        torchtitan's stock manager) and ``from_hf=True`` are read by torchtitan's own code.
        """
        if from_hf or not written_by_fastpersist(checkpoint_id):
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        reader = FastPersistReader(checkpoint_id, self.engine_config)
        state_dict_loader.load(state_dict, storage_reader=reader, checkpoint_id=checkpoint_id)
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)
