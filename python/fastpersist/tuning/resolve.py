"""``Config(chunk_bytes="auto", queue_depth="auto")`` made concrete for one directory.

A save or load resolves its config once, where it begins, for its target's device: explicit
integers stay as they are; an ``"auto"`` takes the tuned value from the cache
(:mod:`fastpersist.tuning.cache`), else the safe default (8 MiB, depth 8). No sweep ever runs
here. The pool stays a hard limit: a tuned chunk larger than half of ``pool_bytes`` is cut to
fit two slots (never below the default), and a tuned depth is cut to the slots the pool has.

:meth:`fastpersist.Config.resolved_for` (and :func:`fastpersist.config.resolve`) apply it; this
module knows no Config (config.py imports it).

Example:
    >>> settle("auto", 4, 256 << 20, (), "/tmp", "write")[1]
    4
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Literal

import fastpersist._core as _core

from .cache import TuneEntry, lookup
from .defaults import DEFAULT_CHUNK_BYTES, DEFAULT_QUEUE_DEPTH
from .identity import device_identity

__all__ = ["pool_chunk_cap", "settle"]

log = logging.getLogger("fastpersist")


def _entry_for(path: str | os.PathLike[str]) -> tuple[TuneEntry | None, str]:
    try:
        identity = device_identity(path)
    except OSError as e:  # never let the cache break a save: an unknown device is an untuned one
        log.debug("tuning: no device for %s (%s): default settings", path, e)
        return None, ""
    entry = lookup(identity)
    return entry, f"tuned {entry.date} for {identity.describe()}" if entry else ""


def pool_chunk_cap(pool_bytes: int) -> int:
    """The largest tuned chunk a pool of `pool_bytes` takes: two slots, aligned, at least the default."""
    align = _core.DIRECT_ALIGN_BYTES
    return min(_core.MAX_CHUNK_BYTES, max(DEFAULT_CHUNK_BYTES, pool_bytes // 2 // align * align))


def settle(
    chunk_bytes: int | Literal["auto"],
    queue_depth: int | Literal["auto"],
    pool_bytes: int,
    stripes: Sequence[str | os.PathLike[str]] | None,
    path: str | os.PathLike[str],
    op: Literal["write", "read"],
    *,
    tuned_chunk: bool = True,
) -> tuple[int, int, str]:
    """``(chunk_bytes, queue_depth, source)`` with ``"auto"`` settled for `op` on `path`'s device;
    `source` is ``"explicit"``, ``"default"`` or ``"tuned YYYY-MM-DD for <device>"`` (when the
    chunk size and the depth differ, ``"chunk <source>, depth <source>"``).

    `tuned_chunk=False` keeps an ``"auto"`` chunk at the default: the ranks of a process group
    plan one stream together and must agree on it, while each may sit on another device. With
    `stripes` the first stripe's device is the one looked up.
    """
    if isinstance(chunk_bytes, int) and isinstance(queue_depth, int):
        return chunk_bytes, queue_depth, "explicit"
    # The data goes to the stripes when there are some (the directory keeps only the manifest);
    # their first device speaks for all of them.
    entry, tuned = _entry_for(stripes[0] if stripes else path)
    best = (entry.read or entry.write) if entry and op == "read" else entry.write if entry else None
    if isinstance(chunk_bytes, int):
        chunk, chunk_from = chunk_bytes, "explicit"
    elif best is not None and tuned_chunk:
        chunk, chunk_from = min(best.chunk_bytes, pool_chunk_cap(pool_bytes)), tuned
    else:
        chunk, chunk_from = (
            DEFAULT_CHUNK_BYTES,
            "default" if tuned_chunk else "default: a process group plans one stream",
        )
    if isinstance(queue_depth, int):
        depth, depth_from = queue_depth, "explicit"
    elif best is not None:
        # A write keeps at most one chunk per slot in flight; a read has no pool.
        slots = max(2, pool_bytes // chunk) if op == "write" else _core.MAX_QUEUE_DEPTH
        depth, depth_from = max(1, min(best.queue_depth, _core.MAX_QUEUE_DEPTH, slots)), tuned
    else:
        depth, depth_from = DEFAULT_QUEUE_DEPTH, "default"
    source = chunk_from if chunk_from == depth_from else f"chunk {chunk_from}, depth {depth_from}"
    return chunk, depth, source
