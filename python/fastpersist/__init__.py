"""fastpersist: near-free deep-learning checkpoints.

Large page-aligned O_DIRECT writes through io_uring (thread-pool fallback), striped across
drives and data-parallel ranks, overlapped with training. See ``fastpersist.save``,
``fastpersist.save_async`` and ``fastpersist.load``; ``fastpersist.torch_save`` writes files ``torch.load`` reads
(``fastpersist.torch_save_async``: in the background);
``fastpersist.export_hf`` writes a checkpoint's model as Hugging Face safetensors shards.
"""

from . import _core
from .advisor import CostOverrides, Endurance, Failures, Wear, advise, advise_levels
from .api import inspect, load, prepare, save, save_async, verify
from .checkpointer import Checkpointer
from .cleanup import clean
from .config import Config
from .errors import (
    BackendUnavailableError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    FastPersistError,
    GroupLoadError,
    GroupSaveError,
    SaveCancelledError,
    UnsupportedValueError,
)
from .futures import SaveFuture, SaveResult
from .hfapi import export_hf
from .interop.torchasync import torch_save_async
from .interop.torchfile import torch_save
from .levels.level_objects import HFExport, Partner, Remote
from .saving.incremental import Incremental
from .saving.remover import wait_removed

__version__: str = _core.__version__

__all__ = [
    "BackendUnavailableError",
    "CheckpointNotFoundError",
    "Checkpointer",
    "ChecksumMismatchError",
    "Config",
    "CorruptCheckpointError",
    "CostOverrides",
    "Endurance",
    "Failures",
    "FastPersistError",
    "GroupLoadError",
    "GroupSaveError",
    "HFExport",
    "Incremental",
    "Partner",
    "Remote",
    "SaveCancelledError",
    "SaveFuture",
    "SaveResult",
    "UnsupportedValueError",
    "Wear",
    "__version__",
    "advise",
    "advise_levels",
    "clean",
    "export_hf",
    "inspect",
    "load",
    "prepare",
    "save",
    "save_async",
    "torch_save",
    "torch_save_async",
    "verify",
    "wait_removed",
]
