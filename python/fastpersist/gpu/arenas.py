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
earlier save that is still writing and the bound allows no other, it waits for one. A bound
that cannot hold an arena of one chunk fails the save at once (``Config`` refuses such an
integer ``pinned_bytes``; an ``"auto"`` one may be that small on a small machine shared by many
ranks).

On the in-memory level (a root on tmpfs, e.g. under ``/dev/shm``) the arena of a save whose
share is one recycled data file is that file itself (:meth:`Arenas.lease_file`): the device
copies land in the file's pages and the job only checksums them, so the step costs one copy.
The file keeps its inode as retention recycles it (``memory_level/recycle.py``), so its arena, mapped
once and registered once (by a thread of its own, after the save that mapped it), serves every
later save that takes it. A file that has an arena is only ever written through it: a save
that would write it another way lets go of the arena first. Such arenas count against the same
bound; one whose file is deleted is forgotten at the next lease. The arenas are one kind of the
process's kept memory (``engine/kept_memory.py``, which reports them with the others).

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
from collections.abc import Sequence
from typing import NamedTuple

import torch

import fastpersist._core as _core

from ..config import ARENA_GRANULE_BYTES, granules, min_pinned_bytes, ranks_on_node
from ..engine.kept_memory import count_kept
from .pinned import pin_host

__all__ = ["ARENAS", "Arenas", "ArenasBusy", "auto_pinned_bytes", "granules", "min_pinned_bytes", "pinned_cap_bytes"]

log = logging.getLogger("fastpersist")


def auto_pinned_bytes() -> int:
    """``Config.pinned_bytes="auto"``: a quarter of the machine's memory, divided among the
    ranks on this node (``LOCAL_WORLD_SIZE``, as torchrun sets it; else 1)."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return physical // 4 // ranks_on_node()


def pinned_cap_bytes(pinned_bytes: int | str) -> int:
    """The bound on a process's arenas for ``Config.pinned_bytes``."""
    return auto_pinned_bytes() if pinned_bytes == "auto" else int(pinned_bytes)


class ArenasBusy(RuntimeError):
    """Every arena is held and the bound allows no other (``Arenas.lease(wait=False)``)."""


class _Kept(NamedTuple):
    arena: _core.Arena
    #: A 1-D uint8 tensor over the whole arena: the copies' destinations are views of it.
    host: torch.Tensor
    #: The arena is a data file's mapping (:meth:`Arenas.lease_file`): only that file's save
    #: may lease it.
    over_file: bool = False


class Arenas:
    """The arenas of a process (see the module docs)."""

    def __init__(self) -> None:
        self._kept: list[_Kept] = []
        self._lock = threading.Lock()
        self._warned_windows = False
        self._warned_waiting = False
        self._warned_files = False
        #: Threads registering file arenas with CUDA (:meth:`lease_file`).
        self._pinners: list[threading.Thread] = []

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
        arenas with CUDA. `wait=False`: raise :class:`ArenasBusy` instead of waiting for one.
        Raises ValueError where `cap_bytes` cannot hold an arena of `min_bytes`: no save would
        ever give that room back."""
        need = granules(need_bytes)
        floor = min_pinned_bytes(min_bytes)
        if cap_bytes < floor:
            raise _below_one_chunk(cap_bytes, min_bytes)
        pause_s = 0.001
        while True:
            with self._lock:
                self._forget_deleted_files()
                found = self._take(need, floor, cap_bytes, pin)
                held = found is None and any(k.arena.leased for k in self._kept)
            if found is not None:
                return found
            if not held:  # nothing will give room back: waiting would be forever
                raise _below_one_chunk(cap_bytes, min_bytes)
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

    def lease_file(
        self, path: str, file_len: int, *, cap_bytes: int, pin: bool
    ) -> tuple[_core.ArenaLease, torch.Tensor] | None:
        """A lease on an arena that is the recycled data file at `path` (on a memory filesystem,
        `file_len` bytes, every one allocated), and a tensor over its bytes; else None, and the
        save takes an arena of :meth:`lease` (a new file gets none: it may never be written again).

        The file's arena is kept for its later saves; the first is mapped here (a shared mapping
        whose page tables are populated: about a third of a memcpy), and with `pin` registered
        with CUDA by a thread of its own once this save's job has let go of it (registration costs
        about a second per 4-10 GB, never inside a save; this one save copies unpinned). A kept
        arena of the file at another length is let go first: the save that writes the file
        another way may truncate it, and pinned pages must not outlive that."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            need = -(-file_len // _core.DIRECT_ALIGN_BYTES) * _core.DIRECT_ALIGN_BYTES
            whole = st.st_size == file_len and st.st_blocks * 512 >= file_len
            found = self._file_arena((st.st_dev, st.st_ino))
            if found is not None:
                held = _lease_waiting(found.arena)  # only its pinning thread can hold it
                if whole and found.arena.len_bytes == need:
                    return held, found.host
                self._let_go(found)
                del held
            with self._lock:
                if not whole or not self._room_for_file(need, cap_bytes):
                    return None
                started = time.perf_counter()
                arena = _core.Arena.over_file(fd, file_len, path)
                kept = _Kept(arena, torch.frombuffer(arena, dtype=torch.uint8), True)
                self._kept.append(kept)
                lease = arena.try_lease()
                assert lease is not None, "a new arena is free"
            log.info(
                "staging arena over %s (%d bytes) mapped in %.3f s%s",
                path,
                arena.len_bytes,
                time.perf_counter() - started,
                ", to be pinned once this save lets go of it" if pin else "",
            )
            if pin:
                pinner = threading.Thread(target=_pin_when_free, args=(kept,), name="fastpersist-pin", daemon=True)
                self._pinners.append(pinner)
                pinner.start()
            return lease, kept.host
        finally:
            os.close(fd)

    def wait_pinned(self) -> None:
        """Waits for the threads registering file arenas with CUDA (benchmarks, tests)."""
        while self._pinners:
            self._pinners.pop().join()

    def let_go_of_files(self, paths: Sequence[str]) -> None:
        """Lets go of the arenas of the files at `paths`, which a save is about to write another
        way (host tensors through mappings of their own, or several files): that write may
        truncate them, and a file's pinned pages must not outlive that."""
        if not any(k.over_file for k in self._kept):
            return
        for path in paths:
            try:
                st = os.stat(path, follow_symlinks=False)
            except OSError:
                continue
            kept = self._file_arena((st.st_dev, st.st_ino))
            if kept is not None:
                lease = _lease_waiting(kept.arena)
                self._let_go(kept)
                del lease

    def _file_arena(self, identity: tuple[int, int]) -> _Kept | None:
        with self._lock:
            self._forget_deleted_files()
            for kept in self._kept:
                status = _file_of(kept.arena) if kept.over_file else None
                if status is not None and status[0] == identity:
                    return kept
        return None

    def _let_go(self, kept: _Kept) -> None:
        with self._lock:
            if kept in self._kept:
                self._kept.remove(kept)  # unpinned and unmapped once its last view goes

    def _room_for_file(self, need: int, cap_bytes: int) -> bool:
        """Whether the bound holds a file arena of `need` bytes, once free arenas of no file
        (made for saves of new files) are let go if it needs their room."""
        total = sum(k.arena.len_bytes for k in self._kept)
        free = sorted(
            (k for k in self._kept if not k.arena.leased and not k.over_file), key=lambda k: -k.arena.len_bytes
        )
        while total + need > cap_bytes and free:
            total -= free[0].arena.len_bytes
            self._kept.remove(free.pop(0))
        return total + need <= cap_bytes

    def _forget_deleted_files(self) -> None:
        """Lets go of free arenas whose file is deleted: they would hold its memory."""
        gone = [k for k in self._kept if k.over_file and not k.arena.leased and _deleted(k.arena)]
        for kept in gone:
            self._kept.remove(kept)

    def _take(self, need: int, floor: int, cap_bytes: int, pin: bool) -> tuple[_core.ArenaLease, torch.Tensor] | None:
        free = sorted(
            (k for k in self._kept if not k.arena.leased and not k.over_file), key=lambda k: k.arena.len_bytes
        )
        for kept in free:
            if kept.arena.len_bytes >= need:
                lease = kept.arena.try_lease()
                if lease is not None:
                    return lease, kept.host
        total = sum(k.arena.len_bytes for k in self._kept)
        for kept in [k for k in self._kept if k.over_file and not k.arena.leased]:
            if total + need <= cap_bytes:
                break
            self._kept.remove(kept)  # only its file's saves lease it: never wait for it
            total -= kept.arena.len_bytes
            self._say_files_dropped(cap_bytes)
        if total + need > cap_bytes and free and total - free[-1].arena.len_bytes + need <= cap_bytes:
            self._kept.remove(free[-1])  # too small for this save: make room for one that is not
            total -= free.pop().arena.len_bytes
        size = min(need, _room(cap_bytes, total))
        if free and free[-1].arena.len_bytes >= max(size, floor):
            kept = free[-1]  # the largest one there is: the save goes in windows
            lease = kept.arena.try_lease()
            if lease is not None:
                self._say_windows(need, kept.arena.len_bytes, cap_bytes)
                return lease, kept.host
        small = sum(k.arena.len_bytes for k in free)
        if size < floor and free and _room(cap_bytes, total - small) >= floor:
            for kept in free:  # each smaller than a chunk of this save: their room serves it
                self._kept.remove(kept)
            total -= small
            size = min(need, _room(cap_bytes, total))
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

    def _say_files_dropped(self, cap_bytes: int) -> None:
        if not self._warned_files:
            self._warned_files = True
            log.warning(
                "Config.pinned_bytes (%d) holds fewer staging arenas than the memory root's files "
                "and the saves' other arenas: a file's arena is let go and made again (and, on a "
                "GPU, registered again) by a later save; raise pinned_bytes to (keep + 1) x the "
                "state, plus one state for saves of new files",
                cap_bytes,
            )

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


def _lease_waiting(arena: _core.Arena) -> _core.ArenaLease:
    """A lease on a file's arena, waiting while its pinning thread holds it (a registration:
    bounded). Nothing else can hold it: only saves of its one file lease it, one at a time."""
    pause_s = 0.001
    while (lease := arena.try_lease()) is None:
        time.sleep(pause_s)
        pause_s = min(pause_s * 2, 0.02)
    return lease


def _pin_when_free(kept: _Kept) -> None:
    """Registers a file's arena with CUDA once the save that mapped it has let go of it, holding
    its lease meanwhile: no copy lands in memory being registered."""
    lease = _lease_waiting(kept.arena)
    try:
        started = time.perf_counter()
        pinned = pin_host(kept.host, kept.arena)
        log.info(
            "staging arena of %d bytes over a file %s in %.3f s",
            kept.arena.len_bytes,
            "pinned" if pinned else "not pinned",
            time.perf_counter() - started,
        )
    finally:
        del lease


def _file_of(arena: _core.Arena) -> tuple[tuple[int, int], int] | None:
    """``((st_dev, st_ino), st_nlink)`` of the file an arena maps; None for anonymous memory, or
    where the file cannot be looked at."""
    try:
        return arena.file_status
    except OSError:
        return None


def _deleted(arena: _core.Arena) -> bool:
    """Whether the file an arena maps is deleted (or cannot be looked at)."""
    status = _file_of(arena)
    return status is None or status[1] == 0


def _room(cap_bytes: int, total_bytes: int) -> int:
    """Bytes of a new arena the bound allows beside `total_bytes` of arenas: whole granules."""
    return (cap_bytes - total_bytes) // ARENA_GRANULE_BYTES * ARENA_GRANULE_BYTES


def _below_one_chunk(cap_bytes: int, min_bytes: int) -> ValueError:
    return ValueError(
        f"Config.pinned_bytes ({cap_bytes} bytes) cannot hold a staging arena of one chunk: a device save "
        f"of chunk_bytes={min_bytes} needs at least {min_pinned_bytes(min_bytes)} bytes, in whole arena "
        "granules; raise pinned_bytes, or lower chunk_bytes"
    )


#: The arenas of this process.
ARENAS = Arenas()
count_kept("staging arenas", ARENAS.total_bytes, lambda config: pinned_cap_bytes(config.pinned_bytes))
