"""Replicated loads shared across the ranks of a process group.

Without sharing, ``load(path, group=g)`` of a replicated checkpoint reads the whole stream on
every rank. With it (the default), the stream is cut into near-equal runs of whole chunks, one
per rank (the split the writer uses); each rank reads only its run with the engine (O_DIRECT,
the chunks' crc32c checked) into its place in one page-aligned buffer of the whole stream, and
each run is broadcast from its reader over the group's private gloo control group (see
:mod:`fastpersist.distributed.control`), so every rank ends with the same bytes a single-process load
reads. Each rank reads about ``1/N`` of the stream from disk. Runs are read in pieces of
:data:`PIECE_BYTES`, one piece ahead in a background thread, so reading overlaps broadcasting.

The ranks first check that they load the same checkpoint; after the broadcasts they exchange a
status (every collective under ``Config.timeout_s``): if a rank's read failed (a checksum
mismatch, a missing file) every rank raises. The rank that failed raises its own error; the
others raise the same class of error for checkpoint damage
(:class:`~fastpersist.ChecksumMismatchError` with the file and byte range, or
:class:`~fastpersist.CorruptCheckpointError`), else :class:`~fastpersist.GroupLoadError`, naming that rank.
A rank whose read failed still takes part in the remaining broadcasts, so nobody waits for it.

Every rank of the group must call ``load`` with the same path and arguments.

Example:
    >>> read_shares(total_bytes=10 << 20, chunk_bytes=4 << 20, rank_count=2)
    [(0, 4194304), (4194304, 10485760)]
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist

import fastpersist._core as _core

from ..config import Config
from ..distributed.control import ControlGroup, collective, control_for
from ..errors import ChecksumMismatchError, CorruptCheckpointError, FastPersistError, GroupLoadError
from ..format.manifest import Manifest
from ..format.quote import shown
from .opened import real_paths
from .reading import direct_padded, read_window

__all__ = ["PIECE_BYTES", "read_and_broadcast", "read_pieces", "read_shares", "read_stream_shared"]

T = TypeVar("T")

#: Bytes of a rank's run read at a time: reading the next piece overlaps the broadcasts of the
#: previous ones.
PIECE_BYTES = 64 << 20

#: The attributes of a ChecksumMismatchError that travel to the other ranks.
_CHECKSUM_FIELDS = ("filename", "offset_bytes", "len_bytes", "expected", "found", "tensors")


def read_shares(total_bytes: int, chunk_bytes: int, rank_count: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of the stream that each of `rank_count` ranks reads: near-equal runs of whole
    chunks (a rank gets an empty run when there are fewer chunks than ranks)."""
    return _core.chunk_runs(0, total_bytes, chunk_bytes, rank_count)


def read_pieces(lo: int, hi: int, chunk_bytes: int, piece_bytes: int = PIECE_BYTES) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into pieces of whole chunks of about `piece_bytes` (the last may be shorter)."""
    step = max(chunk_bytes, piece_bytes // chunk_bytes * chunk_bytes)
    return [(a, min(a + step, hi)) for a in range(lo, hi, step)]


def read_stream_shared(root: str, m: Manifest, verify: bool, config: Config, group: Any) -> _core.PagedBuffer:
    """The whole stream of the replicated checkpoint at `root`, this rank having read only its
    share (see the module docstring). `m` must be windowable (:func:`reading.windowable`)."""
    control = control_for(group, config.timeout_s)
    mine = (m.checkpoint_id, m.total_bytes, m.chunk_bytes)
    seen = _collective(control, root, "agree on the checkpoint", lambda: control.all_gather(mine))
    if len(set(seen)) > 1:
        which = ", ".join(f"rank {r}: {shown(s[0])}" for r, s in enumerate(seen))
        raise GroupLoadError(
            f"the ranks are loading different checkpoints at {root} ({which}); every rank of the group must "
            "load the same one"
        )
    stream = _core.PagedBuffer(direct_padded(m.total_bytes))
    runs = [read_pieces(lo, hi, m.chunk_bytes) for lo, hi in read_shares(m.total_bytes, m.chunk_bytes, control.size)]

    def read(lo: int, hi: int) -> None:
        read_window(root, m, lo, hi, stream.span(lo, direct_padded(hi - lo)), verify, config)

    own_error = read_and_broadcast(control, root, runs, stream, read)
    status = ("ok", control.rank) if own_error is None else _error_status(control.rank, own_error)
    statuses = _collective(control, root, "exchange read results", lambda: control.all_gather(status))
    _raise_failures(root, statuses, own_error)
    return stream


def read_and_broadcast(
    control: ControlGroup,
    root: str,
    runs: list[list[tuple[int, int]]],
    stream: _core.PagedBuffer,
    read: Callable[[int, int], None],
) -> BaseException | None:
    """Reads this rank's pieces in a background thread, one piece ahead, while every rank's
    earlier pieces are broadcast from their readers, round by round; returns this rank's read
    error. After an error the rank reads no more but still takes part in every broadcast (the
    bytes are discarded after the status exchange), so no rank waits for it."""
    whole = torch.frombuffer(stream, dtype=torch.uint8)
    mine = runs[control.rank]
    error: BaseException | None = None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastpersist-read") as reader:
        pending = reader.submit(read, *mine[0]) if mine else None
        for k in range(max(len(run) for run in runs)):
            if pending is not None:
                try:
                    pending.result()
                except Exception as e:
                    error = e
                pending = None
            if error is None and k + 1 < len(mine):
                pending = reader.submit(read, *mine[k + 1])
            for src, run in enumerate(runs):
                if k < len(run):
                    a, b = run[k]
                    _collective(
                        control,
                        root,
                        f"receive rank {src}'s bytes [{a}, {b})",
                        partial(_broadcast, control, whole[a:b], src),
                    )
    return error


def _broadcast(control: ControlGroup, piece: torch.Tensor, src: int) -> None:
    control.wait(dist.broadcast(piece, group=control.pg, group_src=src, async_op=True))


def _error_status(rank: int, error: BaseException) -> tuple[Any, ...]:
    if isinstance(error, ChecksumMismatchError):
        kind = "checksum"
    elif isinstance(error, CorruptCheckpointError):
        kind = "corrupt"
    else:
        kind = "other"
    fields = {name: getattr(error, name, None) for name in _CHECKSUM_FIELDS} if kind == "checksum" else {}
    filename = fields.get("filename")
    if isinstance(filename, str):
        fields["filename"] = real_paths(filename)
    # Paths go to the other ranks as the caller named them, not as this process's handle on them.
    return ("error", rank, kind, real_paths(f"{type(error).__name__}: {error}"), fields)


def _raise_failures(root: str, statuses: list[tuple[Any, ...]], own_error: BaseException | None) -> None:
    """Raises on every rank if any rank failed."""
    failures = [s for s in statuses if s[0] == "error"]
    if own_error is not None:
        raise own_error
    if failures:
        _, rank, kind, message, fields = failures[0]
        text = f"rank {rank} failed to read its share of {root}: {message}"
        if len(failures) > 1:
            text += f" (and {len(failures) - 1} other rank(s) failed too)"
        if kind == "checksum":
            error: FastPersistError = ChecksumMismatchError(text)
            for name, value in fields.items():
                setattr(error, name, value)
            raise error
        if kind == "corrupt":
            raise CorruptCheckpointError(text)
        raise GroupLoadError(text)


def _collective(control: ControlGroup, root: str, what: str, op: Callable[[], T]) -> T:
    return collective(control, f"{what} of {root}", op, GroupLoadError)
