"""The exception tree of fastpersist (the Rust core raises these too).

Operating-system failures are not wrapped: they stay real :class:`OSError` subclasses with
``errno`` and ``filename`` set, so ``except FileNotFoundError`` and ``e.errno == errno.ENOSPC``
work as usual.
"""

from __future__ import annotations

import concurrent.futures

__all__ = [
    "BackendUnavailableError",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "FastPersistError",
    "GroupLoadError",
    "GroupSaveError",
    "SaveCancelledError",
    "UnsupportedValueError",
]


class FastPersistError(Exception):
    """Base class of every error fastpersist raises (besides ``OSError`` and ``ValueError``)."""


class CorruptCheckpointError(FastPersistError):
    """A checkpoint is unreadable: bad manifest, truncated file, inconsistent layout.

    The message names the file, the tensor key path or the byte range involved.
    """


class CheckpointNotFoundError(FastPersistError, FileNotFoundError):
    """There is no committed checkpoint at a path: the directory or its ``manifest.json`` is missing.

    Also a ``FileNotFoundError`` (``errno == ENOENT``, ``filename`` set), so existing
    ``except FileNotFoundError`` code keeps working.
    """


class ChecksumMismatchError(CorruptCheckpointError):
    """A chunk's crc32c differs from the one recorded at save time (bit rot, torn write).

    Attributes (None when unknown): ``filename``, ``offset_bytes`` and ``len_bytes`` (the chunk's
    byte range in that file), ``expected`` and ``found`` (the checksums), and ``tensors`` (key
    paths of the tensors stored in that range).
    """

    filename: str | None = None
    offset_bytes: int | None = None
    len_bytes: int | None = None
    expected: int | None = None
    found: int | None = None
    tensors: list[str] | None = None


class BackendUnavailableError(FastPersistError):
    """A ``"require"``-style setting (``backend="io_uring"``, ``direct_io="require"``) cannot be honoured here."""


class UnsupportedValueError(FastPersistError, TypeError):
    """A leaf of the state cannot be stored without pickling; the message names its key path."""


class SaveCancelledError(FastPersistError, concurrent.futures.CancelledError):
    """A save stopped before it committed: cancelled, or a source tensor was modified in place
    before its bytes were staged. Nothing was committed; the previous checkpoint is untouched."""


class GroupSaveError(FastPersistError):
    """A save in a process group failed on some rank, or a rank stopped answering within
    ``Config.timeout_s``; nothing was committed. The message names the rank and what failed."""


class GroupLoadError(FastPersistError):
    """A load in a process group failed on another rank (not because of damage to the
    checkpoint), or a rank stopped answering within ``Config.timeout_s``."""
