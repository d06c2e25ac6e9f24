"""The staging pools kept between saves: one per (chunk size, pool budget), the most recent few
(``engine/kept_memory.py`` holds them, with the process's other kept memory)."""

from __future__ import annotations

import logging
import threading
import time

import fastpersist._core as _core

from ..config import Config
from ..engine.kept_memory import KeptCache
from ..gpu.early import EARLY_COPY_BUDGET_BYTES

__all__ = ["POOLS", "pool_for", "prefault_in_background"]

log = logging.getLogger("fastpersist")


def _pool_bound(config: Config) -> int:
    """The most one pool for `config` holds: its slots and its early copies' block. The slots
    are the engine's own rule (a pool allocates nothing until used, so asking one is free)."""
    shape = _core.Pool(config.resolved_chunk_bytes, config.pool_bytes)
    return shape.slot_count * shape.slot_bytes + EARLY_COPY_BUDGET_BYTES


#: Pools kept alive between saves, by (chunk size, budget). Bounded, so a process that saves
#: states of many sizes does not keep a pool per size (a Checkpointer holds its own).
POOLS: KeptCache[tuple[int, int], _core.Pool] = KeptCache(
    "staging pools", size_of=lambda pool: pool.allocated_bytes + pool.spare_bytes, bound_of_one=_pool_bound
)


def pool_for(config: Config) -> _core.Pool:
    """The process-wide staging pool for this (resolved) chunk size and budget, reused across saves."""
    key = (config.resolved_chunk_bytes, config.pool_bytes)
    return POOLS.get_or_make(key, lambda: _core.Pool(*key))


def prefault_in_background(pool: _core.Pool) -> threading.Thread:
    """Faults `pool`'s memory in on a daemon thread (the GIL released), so that the first save
    staging into it does not pay the pages' first touch; logs at DEBUG what that cost. A save
    that starts meanwhile takes the slots already made and makes the others itself."""

    def prefault() -> None:
        start = time.perf_counter()
        faulted = pool.prefault()
        if faulted:
            log.debug(
                "faulted in %d MiB of staging pool in %.3f s, ahead of the first save",
                faulted >> 20,
                time.perf_counter() - start,
            )

    thread = threading.Thread(target=prefault, name="fastpersist-prefault", daemon=True)
    thread.start()
    return thread
