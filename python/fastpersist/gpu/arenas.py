"""The pinned arenas that device saves stage into: made once, reused by every later save.

A save with device tensors leases one arena for its job: the device-to-host copies land there
and the engine writes straight from it (``rust/fastpersist-core/src/arena.rs``). Making an
arena costs a mapping and, for CUDA, a ``cudaHostRegister`` (about a second per 4-10 GB), so
arenas are kept for the process and reused: a steady training loop allocates and registers
nothing after its first save.

The process keeps a few arenas, their total bounded by ``Config.pinned_bytes`` (by default a
quarter of the machine's memory, shared by the local ranks). A save takes the smallest free
arena that holds its share of the stream; else it makes one of the share's size if the bound
allows (replacing a free smaller one if that makes room); else it stages in windows through
the largest arena it can have (said once in the log); and while every arena is held by an
earlier save that is still writing and the bound allows no other, it waits for one.

Example:
    >>> arenas = Arenas()
    >>> lease, host = arenas.lease(3 << 20, cap_bytes=1 << 30, min_bytes=1 << 20, pin=False)
    >>> lease.arena.len_bytes, host.numel() == lease.arena.len_bytes, arenas.total_bytes()
    (4194304, True, 4194304)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import NamedTuple

import torch

import fastpersist._core as _core

from .pinned import pin_host

__all__ = ["ARENAS", "Arenas", "ArenasBusy", "auto_pinned_bytes", "granules", "pinned_cap_bytes"]

log = logging.getLogger("fastpersist")

#: An arena's size is a whole number of these (its mapping's huge pages).
ARENA_GRANULE_BYTES = 2 << 20


def auto_pinned_bytes() -> int:
    """``Config.pinned_bytes="auto"``: a quarter of the machine's memory, divided among the
    ranks on this node (``LOCAL_WORLD_SIZE``, as torchrun sets it; else 1)."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_ranks = 1
    return physical // 4 // local_ranks


def pinned_cap_bytes(pinned_bytes: int | str) -> int:
    """The bound on a process's arenas for ``Config.pinned_bytes``."""
    return auto_pinned_bytes() if pinned_bytes == "auto" else int(pinned_bytes)


class ArenasBusy(RuntimeError):
    """Every arena is held and the bound allows no other (``Arenas.lease(wait=False)``)."""


class _Kept(NamedTuple):
    arena: _core.Arena
    #: A 1-D uint8 tensor over the whole arena: the copies' destinations are views of it.
    host: torch.Tensor


class Arenas:
    """The arenas of a process (see the module docs)."""

    def __init__(self) -> None:
        self._kept: list[_Kept] = []
        self._lock = threading.Lock()
        self._warned_windows = False
        self._warned_waiting = False

    def total_bytes(self) -> int:
        """Bytes of every arena kept (leased or free)."""
        with self._lock:
            return sum(k.arena.len_bytes for k in self._kept)

    def lease(
        self, need_bytes: int, *, cap_bytes: int, min_bytes: int, pin: bool, wait: bool = True
    ) -> tuple[_core.ArenaLease, torch.Tensor]:
        """A lease on an arena for a save whose share of the stream takes `need_bytes`, and a
        tensor over the arena's bytes. An arena is never smaller than `min_bytes` (one chunk);
        one smaller than `need_bytes` means the save stages in windows. `pin`: register new
        arenas with CUDA. `wait=False`: raise :class:`ArenasBusy` instead of waiting for one."""
        need = granules(need_bytes)
        floor = granules(min_bytes)
        pause_s = 0.001
        while True:
            with self._lock:
                found = self._take(need, floor, cap_bytes, pin)
            if found is not None:
                return found
            if not wait:
                raise ArenasBusy(f"no staging arena of {need} bytes is free within {cap_bytes} bytes")
            if not self._warned_waiting:
                self._warned_waiting = True
                log.warning(
                    "every staging arena is held by an earlier save that is still writing, and "
                    "Config.pinned_bytes (%d) allows no other: this save waits for one",
                    cap_bytes,
                )
            time.sleep(pause_s)
            pause_s = min(pause_s * 2, 0.02)

    def _take(self, need: int, floor: int, cap_bytes: int, pin: bool) -> tuple[_core.ArenaLease, torch.Tensor] | None:
        free = sorted((k for k in self._kept if not k.arena.leased), key=lambda k: k.arena.len_bytes)
        for kept in free:
            if kept.arena.len_bytes >= need:
                lease = kept.arena.try_lease()
                if lease is not None:
                    return lease, kept.host
        total = sum(k.arena.len_bytes for k in self._kept)
        if total + need > cap_bytes and free and total - free[-1].arena.len_bytes + need <= cap_bytes:
            self._kept.remove(free[-1])  # too small for this save: make room for one that is not
            total -= free.pop().arena.len_bytes
        room = (cap_bytes - total) // ARENA_GRANULE_BYTES * ARENA_GRANULE_BYTES
        size = min(need, room)
        if free and free[-1].arena.len_bytes >= size:
            kept = free[-1]  # the largest one there is: the save goes in windows
            lease = kept.arena.try_lease()
            if lease is not None:
                self._say_windows(need, kept.arena.len_bytes, cap_bytes)
                return lease, kept.host
        if size < floor:
            return None
        kept = self._make(size, pin)
        if size < need:
            self._say_windows(need, size, cap_bytes)
        lease = kept.arena.try_lease()
        assert lease is not None, "a new arena is free"
        return lease, kept.host

    def _make(self, len_bytes: int, pin: bool) -> _Kept:
        started = time.perf_counter()
        arena = _core.Arena(len_bytes)
        host = torch.frombuffer(arena, dtype=torch.uint8)
        pinned = pin_host(host, arena) if pin else False
        kept = _Kept(arena, host)
        self._kept.append(kept)
        log.info(
            "staging arena of %d bytes made%s in %.3f s (%d bytes of arenas in this process)",
            arena.len_bytes,
            " and pinned" if pinned else "",
            time.perf_counter() - started,
            sum(k.arena.len_bytes for k in self._kept),
        )
        return kept

    def _say_windows(self, need: int, have: int, cap_bytes: int) -> None:
        if not self._warned_windows:
            self._warned_windows = True
            log.warning(
                "a save of %d bytes stages in windows through an arena of %d bytes "
                "(Config.pinned_bytes=%d bounds the arenas): wait_staged() then waits for the "
                "disk to take all but the last window; raise pinned_bytes to stage it at once",
                need,
                have,
                cap_bytes,
            )

    def clear(self) -> None:
        """Forgets the free arenas (their memory goes once nothing else holds them)."""
        with self._lock:
            self._kept = [k for k in self._kept if k.arena.leased]


def granules(nbytes: int) -> int:
    """`nbytes` rounded up to the arenas' granule (never less than one)."""
    return max(1, -(-nbytes // ARENA_GRANULE_BYTES)) * ARENA_GRANULE_BYTES


#: The arenas of this process.
ARENAS = Arenas()
