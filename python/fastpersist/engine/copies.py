"""Part files written from bytes that come from elsewhere, and part files checked whole, both by
the engine: a level copying a share to a directory, a drain downloading an object, a rank
receiving a peer's share (:class:`PartFile`), and ``fastpersist.verify`` (:func:`check_part_file`).

A :class:`PartFile` takes pieces in order, of any size; each chunk's crc32c is checked in Rust
before its last byte is written, the writes are O_DIRECT where the filesystem takes it (large and
aligned whatever the pieces), and ``finish`` sets the size and fsyncs. A copy that fails is
removed, so a part file either is whole and checked or is not there.

Example:
    >>> import os, tempfile
    >>> from fastpersist import _core
    >>> path = os.path.join(tempfile.mkdtemp(), "part")
    >>> with PartFile(path, 10, [_core.crc32c(b"helloworld")], 1 << 20) as f:
    ...     f.append(b"hello")
    ...     f.append(b"world")
    >>> open(path, "rb").read()
    b'helloworld'
    >>> check_part_file(path, 10, [_core.crc32c(b"helloworld")], 1 << 20)
    1
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import fastpersist._core as _core

from .reads import ReadRange, read_ranges

__all__ = ["CHECK_WINDOW_BYTES", "PartFile", "check_part_file"]

#: How much of a file :func:`check_part_file` reads at a time (whole chunks).
CHECK_WINDOW_BYTES = 64 << 20


class PartFile:
    """A new part file written front to back (see the module docs). Used as a context manager:
    finished (`durable`: fsynced) when the block ends, removed when it raises."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        len_bytes: int,
        chunk_crc32c: Sequence[int],
        chunk_bytes: int,
        *,
        replace: bool = False,
        durable: bool = True,
    ) -> None:
        self.path, self.durable = os.fspath(path), durable
        self._writer = _core.PartFileWriter(path, len_bytes, list(chunk_crc32c), chunk_bytes, replace=replace)

    @property
    def written_bytes(self) -> int:
        return self._writer.written_bytes

    def append(self, data: Any) -> None:
        """Appends `data` (any C-contiguous buffer). Raises ChecksumMismatchError for a chunk it
        completes that differs, naming the file and the byte range."""
        self._writer.append(data)

    def finish(self) -> None:
        self._writer.finish(durable=self.durable)

    def discard(self) -> None:
        self._writer.discard()

    def __enter__(self) -> PartFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if error is None:
            try:
                self.finish()
                return
            except BaseException:
                self.discard()
                raise
        self.discard()


def check_part_file(
    path: str | os.PathLike[str],
    len_bytes: int,
    chunk_crc32c: Sequence[int],
    chunk_bytes: int,
    progress: Callable[[int], object] | None = None,
    *,
    named_in: str | None = None,
) -> int:
    """Reads the whole part file (O_DIRECT where the filesystem takes it), a window at a time,
    checking every chunk against `chunk_crc32c`; returns the chunk count. Raises
    ChecksumMismatchError naming the file and range of the first chunk that differs."""
    if not chunk_crc32c or len_bytes == 0:
        return 0
    window = max(chunk_bytes, CHECK_WINDOW_BYTES // chunk_bytes * chunk_bytes)
    buffer = _core.PagedBuffer(min(window, len_bytes) + _core.DIRECT_ALIGN_BYTES)
    for offset in range(0, len_bytes, window):
        length = min(window, len_bytes - offset)
        first = offset // chunk_bytes
        crcs = list(chunk_crc32c[first : first + _core.chunk_count(length, chunk_bytes)])
        read_ranges(
            [ReadRange(path, len_bytes, offset, length, 0, crcs)], buffer, chunk_bytes=chunk_bytes, named_in=named_in
        )
        if progress is not None:
            progress(length)
    return len(chunk_crc32c)
