"""Which file bytes hold which bytes of a checkpoint's stream, and each chunk's content hash.

Format 1.x: each data file holds one contiguous range of the stream, from its
``stream_offset_bytes``. Format 2.0 (an incremental save, docs/format.md): each file holds
chunks of the stream in runs ``[file_chunk, stream_chunk, count]`` (``stream_chunks``), so a
step's own file holds only the chunks it wrote and a file linked from an earlier step holds
the chunks it still shares; a linked file may hold chunks no run names (bytes that changed
since), which a load never reads. Since 1.3 a manifest may carry ``chunk_xxh3_128``: the XXH3-128
of each chunk of the stream, what the next incremental save compares its own chunks with.

Example:
    >>> runs_in_bytes(None, 0, 10_000, chunk_bytes=4096, total_bytes=10_000)
    [(0, 0, 10000)]
    >>> runs_in_bytes(((0, 2, 1),), 0, 1808, chunk_bytes=4096, total_bytes=10_000)
    [(0, 8192, 1808)]
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import fastpersist._core as _core

from ..errors import CorruptCheckpointError
from .quote import shown

__all__ = [
    "CHUNK_HASH_FIELD",
    "HASH_BYTES",
    "Run",
    "check_coverage",
    "hashes_from_json",
    "hashes_to_json",
    "parse_runs",
    "runs_in_bytes",
]

#: One run of a format 2.0 file: (first file chunk, first stream chunk, chunks).
Run = tuple[int, int, int]

#: The manifest member of the chunks' content hashes (format 1.3).
CHUNK_HASH_FIELD = "chunk_xxh3_128"
HASH_BYTES = 16
_HEX = re.compile(r"^[0-9a-f]{32}$")


def runs_in_bytes(
    runs: Sequence[Run] | None, stream_offset_bytes: int, len_bytes: int, *, chunk_bytes: int, total_bytes: int
) -> list[tuple[int, int, int]]:
    """A file's ``(file offset, stream offset, length)`` ranges in bytes: one for a file of
    format 1.x (`runs` None), one per run for format 2.0."""
    if runs is None:
        return [(0, stream_offset_bytes, len_bytes)]
    return [
        (fc * chunk_bytes, sc * chunk_bytes, min((sc + n) * chunk_bytes, total_bytes) - sc * chunk_bytes)
        for fc, sc, n in runs
    ]


def _chunk_len(index: int, len_bytes: int, chunk_bytes: int) -> int:
    return min(chunk_bytes, len_bytes - index * chunk_bytes)


def parse_runs(item: object, at: str, *, len_bytes: int, chunk_bytes: int, total_bytes: int) -> tuple[Run, ...]:
    """A format 2.0 file's ``stream_chunks``, checked: runs in increasing file order, inside the
    file and the stream, each mapped chunk as long in the file as in the stream.

    Raises:
        CorruptCheckpointError: naming `at` and the run.
    """
    if not isinstance(item, list) or not item:
        raise CorruptCheckpointError(
            f"{at}: stream_chunks must be a non-empty list of [file chunk, stream chunk, count]"
        )
    file_chunks = _core.chunk_count(len_bytes, chunk_bytes)
    stream_chunks = _core.chunk_count(total_bytes, chunk_bytes)
    runs: list[Run] = []
    next_free = 0
    for i, run in enumerate(item):
        if (
            not isinstance(run, list)
            or len(run) != 3
            or not all(type(v) is int for v in run)
            or run[0] < next_free
            or run[1] < 0
            or run[2] < 1
            or run[0] + run[2] > file_chunks
            or run[1] + run[2] > stream_chunks
        ):
            raise CorruptCheckpointError(
                f"{at}: stream_chunks[{i}] = {shown(run)} is not a run of the file's {file_chunks} chunks (after "
                f"chunk {next_free}) into the stream's {stream_chunks}"
            )
        fc, sc, n = run
        last_file, last_stream = fc + n - 1, sc + n - 1
        if _chunk_len(last_file, len_bytes, chunk_bytes) != _chunk_len(last_stream, total_bytes, chunk_bytes):
            raise CorruptCheckpointError(
                f"{at}: stream_chunks[{i}] maps file chunk {last_file} to stream chunk {last_stream} of another length"
            )
        runs.append((fc, sc, n))
        next_free = fc + n
    return tuple(runs)


def check_coverage(
    files: Sequence[tuple[str, Sequence[Run]]], *, chunk_bytes: int, total_bytes: int, where: str
) -> None:
    """Format 2.0: the files' runs (by file name) hold every chunk of the stream exactly once.

    Raises:
        CorruptCheckpointError: naming the chunk held twice or by none.
    """
    placed = sorted((sc, n, name) for name, runs in files for _, sc, n in runs)
    cursor = 0
    for sc, n, name in placed:
        if sc != cursor:
            kind = "holds again" if sc < cursor else "leaves unheld"
            raise CorruptCheckpointError(
                f"{where}: file {shown(name)} {kind} chunk {min(sc, cursor)} of the data stream"
            )
        cursor += n
    if cursor != _core.chunk_count(total_bytes, chunk_bytes):
        raise CorruptCheckpointError(
            f"{where}: the files hold {cursor} chunks of the stream's {_core.chunk_count(total_bytes, chunk_bytes)}"
        )


def hashes_to_json(hashes: bytes) -> list[str]:
    """``chunk_xxh3_128`` from ``_core.chunk_hashes``' bytes (16 per chunk)."""
    return [hashes[i : i + HASH_BYTES].hex() for i in range(0, len(hashes), HASH_BYTES)]


def hashes_from_json(item: object, where: str, *, chunk_bytes: int, total_bytes: int) -> bytes | None:
    """``chunk_xxh3_128`` checked (one per chunk of the stream), as 16 bytes per chunk; None when absent.

    Raises:
        CorruptCheckpointError: not one 32-hex-digit string per chunk.
    """
    if item is None:
        return None
    chunks = _core.chunk_count(total_bytes, chunk_bytes)
    if not isinstance(item, list) or len(item) != chunks or not all(isinstance(h, str) and _HEX.match(h) for h in item):
        raise CorruptCheckpointError(
            f"{where}: {CHUNK_HASH_FIELD} must hold one 32-hex-digit hash per chunk of the stream ({chunks})"
        )
    return bytes.fromhex("".join(item))
