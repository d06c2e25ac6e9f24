"""fastpersist: near-free deep-learning checkpoints.

Large page-aligned O_DIRECT writes through io_uring (thread-pool fallback), striped across
drives and data-parallel ranks, overlapped with training. See ``fastpersist.save``,
``fastpersist.save_async`` and ``fastpersist.load``.
"""

from . import _core
from .api import inspect, load, save, save_async, verify
from .checkpointer import Checkpointer
from .cleanup import clean
from .config import Config, SaveResult
from .errors import (
    BackendUnavailableError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    FastPersistError,
    SaveCancelledError,
    UnsupportedValueError,
)
from .futures import SaveFuture

__version__: str = _core.__version__

__all__ = [
    "BackendUnavailableError",
    "CheckpointNotFoundError",
    "Checkpointer",
    "ChecksumMismatchError",
    "Config",
    "CorruptCheckpointError",
    "FastPersistError",
    "SaveCancelledError",
    "SaveFuture",
    "SaveResult",
    "UnsupportedValueError",
    "__version__",
    "clean",
    "inspect",
    "load",
    "save",
    "save_async",
    "verify",
]
