"""A read of the engine, started in one place: byte ranges of part files into a buffer, every
chunk's crc32c checked in Rust with the GIL released (bytes already in memory are checked by
``_core.check_chunks``, with the same error).

Every reader (a load's stream and windows, the partner level's transfers, the remote level's
uploads, the DCP reader, the tuner and ``fastpersist bench``) calls :func:`read_ranges`; the
engine raises the library's own exceptions (:class:`~fastpersist.errors.ChecksumMismatchError`
with the file, byte range and both checksums; ``OSError`` with the path), a part file missing
from a checkpoint becomes :class:`~fastpersist.errors.CorruptCheckpointError` here, and a
caller that knows more (a load knows which tensors lie in a range) only adds that.

Example:
    >>> import os, tempfile
    >>> from fastpersist import _core
    >>> path = os.path.join(tempfile.mkdtemp(), "part")
    >>> _ = open(path, "wb").write(b"hello")
    >>> dest = bytearray(_core.DIRECT_ALIGN_BYTES)
    >>> read_ranges([ReadRange(path, 5, 0, 5, 0, [_core.crc32c(b"hello")])], dest, chunk_bytes=1 << 20)
    5
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import fastpersist._core as _core

from ..errors import CorruptCheckpointError
from ..format.quote import shown

__all__ = ["ReadRange", "read_file_range", "read_ranges"]


class ReadRange(NamedTuple):
    """One range of one part file: it starts on a chunk boundary of the file, and
    `chunk_crc32c` holds the checksums of its chunks (empty: unchecked)."""

    path: str | os.PathLike[str]
    file_len_bytes: int
    file_offset_bytes: int
    len_bytes: int
    dest_offset_bytes: int
    chunk_crc32c: Sequence[int]


def read_ranges(
    ranges: Sequence[ReadRange | tuple[Any, int, int, int, int, Sequence[int]]],
    dest: Any,
    *,
    chunk_bytes: int,
    backend: Literal["auto", "io_uring", "threads"] = "auto",
    direct_io: Literal["auto", "require", "off"] = "auto",
    queue_depth: int = 8,
    stats: dict[str, float] | None = None,
    named_in: str | None = None,
) -> int:
    """Reads `ranges` into the writable buffer `dest` (O_DIRECT where the filesystem takes it);
    returns the bytes read and adds ``bytes`` and ``crc32c_s`` to `stats`. Raises
    ChecksumMismatchError naming the file and range of the first chunk that differs; with
    `named_in` (the file that names the parts: a manifest, DCP's ``.metadata``), a missing part
    raises CorruptCheckpointError saying so."""
    try:
        return _core.read_ranges_into(
            ranges,
            dest,
            chunk_bytes=chunk_bytes,
            backend=backend,
            direct_io=direct_io,
            queue_depth=queue_depth,
            stats=stats,
        )
    except FileNotFoundError as e:
        if named_in is None:
            raise
        raise CorruptCheckpointError(f"data file {shown(e.filename, 300)} named in {named_in} is missing") from None


def read_file_range(
    path: str, file_len_bytes: int, offset: int, length: int, crcs: Sequence[int], dest: Any, chunk_bytes: int
) -> None:
    """Reads bytes ``[offset, offset + length)`` of one part file (chunk-aligned `offset`) into
    the start of `dest`, checking them against `crcs`, the checksums of every chunk of the
    file (empty: unchecked)."""
    first = offset // chunk_bytes
    wanted = list(crcs[first : first + _core.chunk_count(length, chunk_bytes)]) if crcs else []
    read_ranges([ReadRange(path, file_len_bytes, offset, length, 0, wanted)], dest, chunk_bytes=chunk_bytes)
