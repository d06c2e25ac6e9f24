"""fastpersist: near-free deep-learning checkpoints."""

from . import _core
from .errors import (
    BackendUnavailableError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    FastPersistError,
    SaveCancelledError,
    UnsupportedValueError,
)

__version__ = _core.__version__

__all__ = [
    "BackendUnavailableError",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "FastPersistError",
    "SaveCancelledError",
    "UnsupportedValueError",
    "__version__",
]
