"""The sweep behind ``fastpersist tune``: chunk size x queue depth, writes then reads, on one
directory's device, through the engine exactly as a save and a load use it (O_DIRECT where the
filesystem takes it, crc32c, fsync).

It is bounded: a time box (``seconds``, writes about two thirds of it), a cap on the bytes of one
trial, the staging pool a save would have (a chunk needs two slots; a depth beyond the slots
adds nothing), and a quarter of the free space. It is a coordinate search, not the full grid:
every chunk size at the default depth, then every depth at the best chunk size; reads sweep
the depth at the chosen chunk size (a load reads with the chunk size its manifest records).
One trial per setting cannot rank settings on a drive whose speed drifts by a quarter between
trials (a 4 MiB setting beat 64 MiB by one trial here and lost to it by 10-22% in the bench that
followed), so the :data:`FINALISTS` fastest writes of the search are timed again, interleaved,
in :data:`FINAL_ROUNDS` rounds, and the writes are ranked by the median of each finalist's
trials. Among settings within :data:`CLOSE_FRACTION` of the best figure it picks the one with
the fewest bytes in flight. Each trial's file is removed at once, its directory at the end.

Before a setting is timed, its pool's slots are made resident by an untimed write (a pool
allocates a slot at first use; in a process that saves repeatedly they are resident, and
faulting in 256 MiB at the first 64 MiB trial would count against large chunks only). Every
extent of a trial's plan reads the same 16 MiB block, so a trial costs no memory for its source.

Example:
    >>> result = sweep("/tmp", SweepLimits(seconds=0.5, chunk_sizes=(1 << 20,), depths=(1, 2),
    ...                                    max_trial_bytes=4 << 20))   # doctest: +SKIP
    >>> result.write.queue_depth in (1, 2)                              # doctest: +SKIP
    True
"""

from __future__ import annotations

import collections
import math
import os
import shutil
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import fastpersist._core as _core

from ..config import Config
from ..engine import ReadRange, WriteOptions, WriteRequest, read_ranges, start_write
from ..loading.reading import aligned_uint8
from ..tuning.cache import Best, Figure
from ..tuning.defaults import DEFAULT_CHUNK_BYTES, DEFAULT_QUEUE_DEPTH
from ..tuning.identity import DeviceIdentity, device_identity

__all__ = ["CLOSE_FRACTION", "FINALISTS", "FINAL_ROUNDS", "SweepLimits", "SweepResult", "pick_best", "sweep"]

MiB = 1 << 20
#: Settings within this fraction of the best figure count as equally fast (the noise of a short trial).
CLOSE_FRACTION = 0.03
#: How many of the search's fastest write settings are timed again, and how many more times each.
FINALISTS = 3
FINAL_ROUNDS = 2
_WRITE_SHARE = 0.65
_SEARCH_SHARE = 0.45  # of the time box: the search; the finals run until _WRITE_SHARE
_BLOCK_BYTES = 16 * MiB
_POOLS_KEPT = 2


@dataclass(frozen=True)
class SweepLimits:
    """How far a sweep may go.

    Attributes:
        seconds: the time box for one device, writes and reads together (a trial that has
            started finishes, so a run may overshoot by one trial).
        chunk_sizes: chunk sizes to try (those the pool cannot hold twice are skipped).
        depths: queue depths to try (those beyond the pool's slots are skipped).
        pool_bytes: the staging pool the settings must fit (a save's ``Config.pool_bytes``).
        max_trial_bytes: the most bytes one trial writes or reads.
    """

    seconds: float = 15.0
    chunk_sizes: tuple[int, ...] = tuple(MiB << k for k in range(7))
    depths: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    pool_bytes: int = Config().pool_bytes
    max_trial_bytes: int = 512 * MiB

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"seconds={self.seconds!r}: expected a positive number")
        if not self.chunk_sizes or not self.depths:
            raise ValueError("chunk_sizes and depths must each name at least one value")
        for chunk in self.chunk_sizes:
            _core.check_chunk_bytes(chunk)
        for depth in self.depths:
            if not 1 <= depth <= _core.MAX_QUEUE_DEPTH:
                raise ValueError(f"queue depth {depth}: expected 1..{_core.MAX_QUEUE_DEPTH}")
        if self.max_trial_bytes < _core.DIRECT_ALIGN_BYTES:
            raise ValueError(f"max_trial_bytes={self.max_trial_bytes}: expected at least {_core.DIRECT_ALIGN_BYTES}")


@dataclass(frozen=True)
class SweepResult:
    """What a sweep measured on one device."""

    identity: DeviceIdentity
    figures: list[Figure]
    write: Best
    read: Best | None
    direct: bool
    seconds: float
    writers_per_drive: int | None = None
    #: Each write finalist's median over its search trial and its final rounds, fastest first.
    finals: list[Figure] = field(default_factory=list)


def pick_best(figures: list[Figure]) -> Best:
    """The best figure, preferring fewer bytes in flight among those within CLOSE_FRACTION."""
    top = max(f.gb_per_s for f in figures)
    close = [f for f in figures if f.gb_per_s >= top * (1 - CLOSE_FRACTION)]
    chosen = min(close, key=lambda f: (f.chunk_bytes * f.queue_depth, f.chunk_bytes))
    return Best(chosen.chunk_bytes, chosen.queue_depth, chosen.gb_per_s)


class _Trials:
    """Runs trials in one scratch directory, within a deadline, and records their figures."""

    def __init__(self, folder: str, limits: SweepLimits, clock: Callable[[], float]) -> None:
        self.folder, self.limits, self.clock = folder, limits, clock
        self.started = clock()
        self.figures: list[Figure] = []
        self.rate_bytes_per_s = 0.0
        free = shutil.disk_usage(folder).free
        self.cap_bytes = max(_core.DIRECT_ALIGN_BYTES, min(limits.max_trial_bytes, free // 4))
        # One incompressible block, given as the source of every extent of a trial: a trial of
        # any size costs no more memory than this, and no time to fill.
        block_bytes = min(_BLOCK_BYTES, self.cap_bytes) // _core.DIRECT_ALIGN_BYTES * _core.DIRECT_ALIGN_BYTES
        self.block = torch.randint(0, 256, (block_bytes,), dtype=torch.uint8)
        self.pools: collections.OrderedDict[int, _core.Pool] = collections.OrderedDict()
        self.warm_slots: dict[int, int] = {}
        self.writer_pools: dict[tuple[int, int], list[_core.Pool]] = {}
        self.direct = False

    def left_s(self) -> float:
        return self.limits.seconds - (self.clock() - self.started)

    def trial_bytes(self, chunk: int, depth: int, slice_s: float) -> int:
        """Bytes for one trial: about `slice_s` at the rate seen so far, at least two full
        queues, at most the cap; whole chunks."""
        want = max(self.rate_bytes_per_s * slice_s, 2 * chunk * depth)
        nbytes = min(int(want), self.cap_bytes) // chunk * chunk
        return max(nbytes, min(chunk, self.cap_bytes // _core.DIRECT_ALIGN_BYTES * _core.DIRECT_ALIGN_BYTES))

    def _extents(self, nbytes: int) -> tuple[list[int], list[Any]]:
        whole, rest = divmod(nbytes, self.block.numel())
        lengths = [self.block.numel()] * whole + ([rest] if rest else [])
        return lengths, [self.block.numpy()] * whole + ([self.block[:rest].numpy()] if rest else [])

    def _pool(self, chunk: int) -> _core.Pool:
        if chunk in self.pools:
            self.pools.move_to_end(chunk)
        else:
            while len(self.pools) >= _POOLS_KEPT:  # the best chunk's pool and the one being tried
                self.warm_slots.pop(self.pools.popitem(last=False)[0], None)
            self.pools[chunk] = _core.Pool(chunk, self.limits.pool_bytes)
        return self.pools[chunk]

    def warm(self, chunk: int, depth: int) -> None:
        """Makes the pool's slots that a trial at `depth` uses resident, untimed, as they are
        in a process that saves repeatedly: a pool allocates a slot at its first use, and
        faulting in 256 MiB would count against large chunks only."""
        pool = self._pool(chunk)
        wanted = min(pool.slot_count, 2 * (depth + 1))
        if self.warm_slots.get(chunk, 0) < wanted:
            self.write(chunk, depth, min(wanted * chunk, max(chunk, self.cap_bytes // chunk * chunk)))
            self.warm_slots[chunk] = wanted

    def write(self, chunk: int, depth: int, nbytes: int, keep: bool = False) -> tuple[str, float]:
        """Writes `nbytes` as a save would; returns (path, GB/s). The file is removed unless `keep`."""
        path = os.path.join(self.folder, f"w-{chunk}-{depth}")
        lengths, sources = self._extents(nbytes)
        plan = _core.Plan(lengths, 1, 1, chunk)
        request = WriteRequest(
            plan=plan, paths=[path], sources=sources, pool=self._pool(chunk), options=WriteOptions(queue_depth=depth)
        )
        report = start_write(request).wait()
        self.direct = report["parts"][0]["direct"]
        if not keep:
            os.remove(path)
        gb_per_s = nbytes / max(report["seconds"], 1e-9) / 1e9
        self.rate_bytes_per_s = max(self.rate_bytes_per_s, gb_per_s * 1e9)
        return path, gb_per_s

    def record_write(self, chunk: int, depth: int, slice_s: float) -> None:
        self.warm(chunk, depth)
        nbytes = self.trial_bytes(chunk, depth, slice_s)
        _, gb_per_s = self.write(chunk, depth, nbytes)
        self.figures.append(Figure("write", chunk, depth, round(gb_per_s, 3), nbytes))

    def write_concurrently(self, chunk: int, depth: int, nbytes: int, writers: int) -> float:
        """`writers` jobs at once, each writing its share of `nbytes` to its own file with its
        share of the pool (as ranks or stripes sharing the drive would); returns the GB/s of all."""
        share = max(nbytes // writers // chunk, 1) * chunk
        pool_bytes = max(self.limits.pool_bytes // writers, 2 * chunk)
        pools = self.writer_pools.get((chunk, writers))
        if pools is None:
            self.writer_pools.clear()
            pools = self.writer_pools[(chunk, writers)] = [_core.Pool(chunk, pool_bytes) for _ in range(writers)]
            self._write_all(pools, chunk, depth, min(pool_bytes, share))  # untimed: the slots become resident
        start = self.clock()
        self._write_all(pools, chunk, depth, share)
        return share * writers / max(self.clock() - start, 1e-9) / 1e9

    def _write_all(self, pools: list[_core.Pool], chunk: int, depth: int, nbytes: int) -> None:
        lengths, sources = self._extents(nbytes)
        paths = [os.path.join(self.folder, f"c-{i}") for i in range(len(pools))]
        handles = [
            start_write(
                WriteRequest(
                    plan=_core.Plan(lengths, 1, 1, chunk),
                    paths=[path],
                    sources=sources,
                    pool=pool,
                    options=WriteOptions(queue_depth=depth),
                )
            )
            for path, pool in zip(paths, pools, strict=True)
        ]
        for handle in handles:
            handle.wait()
        for path in paths:
            os.remove(path)

    def record_read(self, path: str, nbytes: int, chunk: int, depth: int, dest: torch.Tensor) -> None:
        start = self.clock()
        read_ranges([ReadRange(path, nbytes, 0, nbytes, 0, [])], dest.numpy(), chunk_bytes=chunk, queue_depth=depth)
        gb_per_s = nbytes / max(self.clock() - start, 1e-9) / 1e9
        self.figures.append(Figure("read", chunk, depth, round(gb_per_s, 3), nbytes))


def _nearest(values: tuple[int, ...], wanted: int) -> int:
    return min(values, key=lambda v: (abs(v - wanted), v))


def _sweep_writes(t: _Trials, chunks: list[int], depths: tuple[int, ...], pool_bytes: int) -> Best:
    def slots(chunk: int) -> int:
        return max(2, pool_bytes // chunk)

    first_depth = _nearest(depths, DEFAULT_QUEUE_DEPTH)
    t.warm(_nearest(tuple(chunks), DEFAULT_CHUNK_BYTES), first_depth)  # also the first estimate of the rate
    todo = len(chunks) + len(depths) - 1
    deadline_s = t.limits.seconds * _SEARCH_SHARE
    # Outward from the default size, so that a time box cut short still spans both directions.
    outward = sorted(chunks, key=lambda c: (abs(math.log2(c / DEFAULT_CHUNK_BYTES)), c))
    sizes_deadline_s = deadline_s * len(chunks) / todo  # leave the depths their share
    for chunk in outward:  # every chunk size at the default depth
        if t.figures and t.clock() - t.started > sizes_deadline_s:
            break
        t.record_write(chunk, min(first_depth, slots(chunk)), max(deadline_s - (t.clock() - t.started), 0) / todo)
        todo -= 1
    best = pick_best(t.figures)
    for depth in depths:  # every depth at the best chunk size
        if depth == best.queue_depth or depth > slots(best.chunk_bytes) or t.clock() - t.started > deadline_s:
            continue
        t.record_write(best.chunk_bytes, depth, max(deadline_s - (t.clock() - t.started), 0) / max(todo, 1))
        todo -= 1
    return pick_best(t.figures)


def _final_writes(t: _Trials, search: Best) -> tuple[Best, list[Figure]]:
    """Times the search's fastest write settings again, round by round in alternating order,
    and picks among the medians of their trials (see the module's docstring)."""
    first: dict[tuple[int, int], Figure] = {}
    for f in t.figures:
        if f.op == "write" and f.writers == 1:
            first.setdefault((f.chunk_bytes, f.queue_depth), f)
    ranked = sorted(first.values(), key=lambda f: -f.gb_per_s)[:FINALISTS]
    if len(ranked) < 2:
        return search, []
    trials = {(f.chunk_bytes, f.queue_depth): [f] for f in ranked}
    deadline_s = t.limits.seconds * _WRITE_SHARE
    order = list(trials)
    for round_ in range(FINAL_ROUNDS):
        for chunk, depth in order if round_ % 2 else order[::-1]:
            if t.clock() - t.started > deadline_s:
                break
            left_s = max(deadline_s - (t.clock() - t.started), 0.0)
            t.record_write(chunk, depth, left_s / (len(order) * (FINAL_ROUNDS - round_)))
            trials[(chunk, depth)].append(t.figures[-1])
    finals = [
        Figure("write", chunk, depth, round(statistics.median(f.gb_per_s for f in fs), 3), sum(f.bytes for f in fs))
        for (chunk, depth), fs in trials.items()
    ]
    finals.sort(key=lambda f: -f.gb_per_s)
    return pick_best(finals), finals


def _sweep_writers(t: _Trials, write: Best, counts: tuple[int, ...]) -> int:
    """Concurrent writers at the best write setting; returns the count that wrote fastest
    (fewer among near ties). One writer is the best write figure already measured."""
    figures = [Figure("write", write.chunk_bytes, write.queue_depth, write.gb_per_s, 0, 1)]
    for writers in counts:
        if writers == 1 or (len(figures) > 1 and t.left_s() <= 0):
            continue
        nbytes = t.trial_bytes(write.chunk_bytes, write.queue_depth * writers, max(t.left_s(), 0.0) / 4)
        gb_per_s = t.write_concurrently(write.chunk_bytes, write.queue_depth, nbytes, writers)
        figures.append(Figure("write", write.chunk_bytes, write.queue_depth, round(gb_per_s, 3), nbytes, writers))
        t.figures.append(figures[-1])
    top = max(f.gb_per_s for f in figures)
    return min(f.writers for f in figures if f.gb_per_s >= top * (1 - CLOSE_FRACTION))


def _sweep_reads(t: _Trials, write: Best, depths: tuple[int, ...]) -> Best | None:
    slice_s = max(t.left_s(), 0.0) / (len(depths) + 1)
    nbytes = t.trial_bytes(write.chunk_bytes, max(depths), slice_s)
    path, _ = t.write(write.chunk_bytes, write.queue_depth, nbytes, keep=True)
    dest = aligned_uint8(nbytes)
    dest.fill_(0)  # fault the pages in now, not in the first timed read
    reads_start = len(t.figures)
    for depth in depths:
        if len(t.figures) > reads_start and t.left_s() <= 0:
            break
        t.record_read(path, nbytes, write.chunk_bytes, depth, dest)
    os.remove(path)
    figures = t.figures[reads_start:]
    return pick_best(figures) if figures else None


def sweep(
    directory: str | os.PathLike[str],
    limits: SweepLimits | None = None,
    *,
    writers: int = 1,
    clock: Callable[[], float] = time.monotonic,
) -> SweepResult:
    """Measures writes and reads on `directory`'s device (see the module's docstring); with
    `writers` > 1 (several stripes on this device), also 2, 4 ... up to `writers` concurrent writers."""
    limits = limits or SweepLimits()
    directory = os.path.abspath(os.fspath(directory))
    identity = device_identity(directory)
    chunks = sorted(c for c in set(limits.chunk_sizes) if 2 * c <= max(limits.pool_bytes, 2 * min(limits.chunk_sizes)))
    depths = tuple(sorted(set(limits.depths)))
    folder = os.path.join(directory, f".fastpersist-tune-{uuid.uuid4().hex[:12]}")
    os.mkdir(folder)
    try:
        t = _Trials(folder, limits, clock)
        write, finals = _final_writes(t, _sweep_writes(t, chunks, depths, limits.pool_bytes))
        counts = tuple(k for k in (1, 2, 4, 8, 16) if k < writers) + ((writers,) if writers > 1 else ())
        best_writers = _sweep_writers(t, write, counts) if writers > 1 else None
        read = _sweep_reads(t, write, depths)
        seconds = clock() - t.started
        return SweepResult(identity, t.figures, write, read, bool(t.direct), seconds, best_writers, finals)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
