"""Replicated loads shared across the ranks of a process group.

Without sharing, ``load(path, group=g)`` of a replicated checkpoint reads the whole stream on
every rank. With it (the default), the stream is cut into near-equal runs of whole chunks, one
per rank (the split the writer uses); each rank reads only its run with the engine (O_DIRECT,
the chunks' crc32c checked) into its place in one page-aligned buffer of the whole stream, and
the runs are then broadcast over the group's private gloo control group (see
:mod:`fastpersist.distributed`), so every rank ends with the same bytes a single-process load
reads. Each rank reads about ``1/N`` of the stream from disk.

Before any data moves, the ranks exchange a status (under ``Config.timeout_s``): if a rank's
read failed (a checksum mismatch, a missing file) every rank raises. The rank that failed
raises its own error; the others raise the same class of error for checkpoint damage
(:class:`~fastpersist.ChecksumMismatchError` with the file and byte range, or
:class:`~fastpersist.CorruptCheckpointError`), else :class:`GroupLoadError`, naming that rank.

Every rank of the group must call ``load`` with the same path and arguments.

Example:
    >>> read_shares(total_bytes=10 << 20, chunk_bytes=4 << 20, rank_count=2)
    [(0, 4194304), (4194304, 10485760)]
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from . import _core
from .config import Config
from .distributed import ControlGroup, control_for, forget_control
from .errors import ChecksumMismatchError, CorruptCheckpointError, FastPersistError
from .manifest import Manifest
from .reading import direct_padded, read_window

__all__ = ["GroupLoadError", "read_shares", "read_stream_shared"]

T = TypeVar("T")

#: The attributes of a ChecksumMismatchError that travel to the other ranks.
_CHECKSUM_FIELDS = ("filename", "offset_bytes", "len_bytes", "expected", "found", "tensors")


class GroupLoadError(FastPersistError):
    """A load in a process group failed on another rank (not because of damage to the
    checkpoint), or a rank stopped answering within ``Config.timeout_s``."""


def read_shares(total_bytes: int, chunk_bytes: int, rank_count: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of the stream that each of `rank_count` ranks reads: near-equal runs of whole
    chunks (a rank gets an empty run when there are fewer chunks than ranks)."""
    chunks = -(-total_bytes // chunk_bytes)

    def at(rank: int) -> int:
        return min(chunks * rank // rank_count * chunk_bytes, total_bytes)

    return [(at(r), at(r + 1)) for r in range(rank_count)]


def read_stream_shared(root: str, m: Manifest, verify: bool, config: Config, group: Any) -> _core.PagedBuffer:
    """The whole stream of the replicated checkpoint at `root`, this rank having read only its
    share (see the module docstring). `m` must be windowable (:func:`reading.windowable`)."""
    control = control_for(group, config.timeout_s)
    stream = _core.PagedBuffer(direct_padded(m.total_bytes))
    shares = read_shares(m.total_bytes, m.chunk_bytes, control.size)
    lo, hi = shares[control.rank]
    own_error: BaseException | None = None
    try:
        if hi > lo:
            read_window(root, m, lo, hi, stream.span(lo, direct_padded(hi - lo)), verify, config)
        status: tuple[Any, ...] = ("ok", control.rank, m.checkpoint_id, m.total_bytes)
    except Exception as e:
        own_error = e
        status = _error_status(control.rank, e)
    statuses = _collective(control, root, "exchange read results", lambda: control.all_gather(status))
    _raise_failures(root, statuses, own_error)
    whole = torch.frombuffer(stream, dtype=torch.uint8)
    for rank, (a, b) in enumerate(shares):
        if b > a:
            _collective(
                control,
                root,
                f"receive rank {rank}'s bytes [{a}, {b})",
                partial(dist.broadcast, whole[a:b], group=control.pg, group_src=rank),
            )
    return stream


def _error_status(rank: int, error: BaseException) -> tuple[Any, ...]:
    if isinstance(error, ChecksumMismatchError):
        kind = "checksum"
    elif isinstance(error, CorruptCheckpointError):
        kind = "corrupt"
    else:
        kind = "other"
    fields = {name: getattr(error, name, None) for name in _CHECKSUM_FIELDS} if kind == "checksum" else {}
    return ("error", rank, kind, f"{type(error).__name__}: {error}", fields)


def _raise_failures(root: str, statuses: list[tuple[Any, ...]], own_error: BaseException | None) -> None:
    """Raises on every rank if any rank failed, or if the ranks did not load the same checkpoint."""
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
    if len({(s[2], s[3]) for s in statuses}) > 1:
        seen = ", ".join(f"rank {s[1]}: {s[2]}" for s in statuses)
        raise GroupLoadError(
            f"the ranks loaded different checkpoints at {root} ({seen}); every rank of the group must load the same one"
        )


def _collective(control: ControlGroup, root: str, what: str, op: Callable[[], T]) -> T:
    try:
        return op()
    except Exception as e:
        forget_control(control)
        raise GroupLoadError(
            f"rank {control.rank}: the process group stopped answering while trying to {what} of {root} "
            f"(a rank failed, was killed, or took longer than timeout_s={control.timeout_s}): {e}"
        ) from e
