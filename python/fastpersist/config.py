"""`Config` (the knobs of a save or load) and `SaveResult` (what a save reports)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

import fastpersist._core as _core

from .arguments import given_paths
from .tuning.defaults import DEFAULT_CHUNK_BYTES, DEFAULT_QUEUE_DEPTH
from .tuning.resolve import pool_chunk_cap, settle

__all__ = [
    "ARENA_GRANULE_BYTES",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_QUEUE_DEPTH",
    "Config",
    "Resolved",
    "given_config",
    "granules",
    "min_pinned_bytes",
    "MAX_STAGING_THREADS",
    "ranks_on_node",
    "resolve",
    "snapshot_pool_bytes",
]

#: A pinned arena's size is a whole number of these (its mapping's huge pages): the rule
#: ``Config.pinned_bytes`` is checked by and ``gpu/arenas.py`` sizes arenas by.
ARENA_GRANULE_BYTES = 2 << 20


def granules(nbytes: int) -> int:
    """`nbytes` rounded up to the arenas' granule (never less than one)."""
    return max(1, -(-nbytes // ARENA_GRANULE_BYTES)) * ARENA_GRANULE_BYTES


#: The most staging threads ``Config.staging_threads="auto"`` takes: past a few threads a
#: socket's memory bandwidth, not its cores, bounds a copy.
MAX_STAGING_THREADS = 8


def min_pinned_bytes(chunk_bytes: int) -> int:
    """The least ``Config.pinned_bytes`` that holds an arena of one chunk of `chunk_bytes`: an
    arena is never smaller than a chunk, and comes in whole granules.

    Example:
        >>> min_pinned_bytes(8 << 20), min_pinned_bytes(4096)
        (8388608, 2097152)
    """
    return granules(chunk_bytes)


_BACKENDS = ("auto", "io_uring", "threads")
_DIRECT = ("auto", "require", "off")
_CHECKSUMS = ("crc32c", "off")
_GUARDS = ("version", "copy")


@dataclass(frozen=True)
class Config:
    """How a checkpoint is written and read.

    Args:
        stripes: directories (one per SSD) to spread the data files over; ``None`` keeps them
            inside the checkpoint directory. Each must be on a filesystem that survives as long
            as the checkpoint; the manifest records their absolute paths.
        chunk_bytes: size of one aligned write (a multiple of 4096, at most 1 GiB), or
            ``"auto"``: the size ``fastpersist tune`` measured best for the target's device
            (docs/performance.md), else 8 MiB. A tuned size is capped so that the pool holds
            two chunks. A load reads with the chunk size its manifest records.
        queue_depth: writes (or reads) in flight per save (or load), or ``"auto"``: the tuned
            depth for the device, else 8 (capped by the pool's slots).
        pool_bytes: page-aligned staging memory. When it is at least the state's size a save
            snapshots the whole state at once ("snapshot mode": ``wait_staged()`` returns after
            one memory copy); otherwise staging proceeds as writes drain the pool ("bounded
            mode": less memory, staging lasts as long as the write).
        backend: ``"auto"`` (io_uring where it works, else threads; ``FASTPERSIST_BACKEND``
            overrides), ``"io_uring"`` (or :class:`BackendUnavailableError`), ``"threads"``.
        direct_io: ``"auto"`` (O_DIRECT where the filesystem accepts it), ``"require"``, ``"off"``.
        checksum: ``"crc32c"`` per chunk, verified on load; or ``"off"``.
        durable: fsync data, manifest and directories before a save reports success.
        writers: in a process group, which ranks write data: ``"rank"`` (every rank),
            ``"node"`` (one per node), or an integer k (the first k ranks of each node).
        timeout_s: in a process group, how long a rank waits for the others at each step of
            the commit before it gives up and raises (a failed or killed rank).
        guard: how a save protects itself from writes to the state while it stages
            (docs/overlap.md). ``"version"``: ``save_async`` returns at once and the save fails
            if torch's version counter shows an in-place change before a tensor was staged; it
            cannot see writes through ``.data``, ``.numpy()``, other storages or CUDA kernels.
            ``"copy"``: ``save_async`` and ``Checkpointer.save`` return only once every byte is
            in the staging pool (a GPU tensor's device-to-host copies included), so no later
            write of any kind can tear the save (with a pool
            smaller than the state, that waits until the disk has taken all but ``pool_bytes``).
        pinned_bytes: the most host memory a process keeps in staging arenas for saves of
            device (GPU) tensors (docs/gpu.md): an arena holds a save's share of the stream,
            is registered with CUDA once, and is reused by every later save. ``"auto"``: a
            quarter of the machine's memory divided by the ranks on the node
            (``LOCAL_WORLD_SIZE``). A save larger than what the bound allows stages in
            arena-sized windows (``wait_staged()`` then waits for the disk to take all but the
            last window). An integer must hold one chunk (an ``"auto"`` chunk counts as the
            largest a tuned size may be, half of ``pool_bytes``). Saves of host tensors use
            ``pool_bytes`` instead.
        staging_threads: the most threads that copy a save's host bytes into staging (and
            checksum them) at once. ``"auto"``: the cores this process may run on divided by the
            ranks on the node (``LOCAL_WORLD_SIZE``), less one for the training loop's own
            thread, at least 1 and at most :data:`MAX_STAGING_THREADS`. An integer is used up to
            the process's share of the cores. The stream, its order and its checks do not
            depend on it (docs/performance.md, "Host staging on every core").

    Example:
        >>> import fastpersist as fp
        >>> cfg = fp.Config(pool_bytes=1 << 30, queue_depth=16)
        >>> cfg.chunk_bytes
        'auto'
        >>> fp.Config(chunk_bytes=8 << 20, queue_depth=16).resolved_for("/tmp").chunk_bytes
        8388608
    """

    stripes: Sequence[str | os.PathLike[str]] | None = None
    chunk_bytes: int | Literal["auto"] = "auto"
    queue_depth: int | Literal["auto"] = "auto"
    pool_bytes: int = 256 << 20
    backend: Literal["auto", "io_uring", "threads"] = "auto"
    direct_io: Literal["auto", "require", "off"] = "auto"
    checksum: Literal["crc32c", "off"] = "crc32c"
    durable: bool = True
    writers: Literal["rank", "node"] | int = "rank"
    timeout_s: float = 600.0
    guard: Literal["version", "copy"] = "version"
    pinned_bytes: int | Literal["auto"] = "auto"
    staging_threads: int | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        def bad(name: str, value: object, expected: str) -> ValueError:
            return ValueError(f"Config.{name}={value!r}: expected {expected}")

        if self.chunk_bytes != "auto":
            if type(self.chunk_bytes) is not int or not 0 < self.chunk_bytes < 1 << 63:
                expected = f'"auto" or a positive integer (a multiple of {_core.DIRECT_ALIGN_BYTES})'
                raise bad("chunk_bytes", self.chunk_bytes, expected)
            try:
                _core.check_chunk_bytes(self.chunk_bytes)  # the engine's one rule
            except ValueError as e:
                raise ValueError(f"Config.chunk_bytes={self.chunk_bytes!r}: {e}") from None
        max_depth = _core.MAX_QUEUE_DEPTH
        if self.queue_depth != "auto" and (type(self.queue_depth) is not int or not 1 <= self.queue_depth <= max_depth):
            raise bad("queue_depth", self.queue_depth, f'"auto" or an integer in 1..{max_depth}')
        if type(self.pool_bytes) is not int or self.pool_bytes < 0:
            raise bad("pool_bytes", self.pool_bytes, "a non-negative integer")
        if self.backend not in _BACKENDS:
            raise bad("backend", self.backend, " | ".join(_BACKENDS))
        if self.direct_io not in _DIRECT:
            raise bad("direct_io", self.direct_io, " | ".join(_DIRECT))
        if self.checksum not in _CHECKSUMS:
            raise bad("checksum", self.checksum, " | ".join(_CHECKSUMS))
        if not isinstance(self.durable, bool):
            raise bad("durable", self.durable, "True or False")
        if not (self.writers in ("rank", "node") or (type(self.writers) is int and self.writers >= 1)):
            raise bad("writers", self.writers, '"rank", "node" or an integer >= 1')
        if not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise bad("timeout_s", self.timeout_s, "a positive number of seconds")
        if self.pinned_bytes != "auto":
            if type(self.pinned_bytes) is not int or self.pinned_bytes <= 0:
                raise bad("pinned_bytes", self.pinned_bytes, '"auto" or a positive number of bytes')
            self._check_pinned_bytes_hold_a_chunk(self.pinned_bytes)
        if self.staging_threads != "auto" and (type(self.staging_threads) is not int or self.staging_threads < 1):
            raise bad("staging_threads", self.staging_threads, '"auto" or an integer >= 1')
        if self.guard not in _GUARDS:
            raise bad("guard", self.guard, " | ".join(_GUARDS) + " (see docs/overlap.md)")
        if self.stripes is not None:
            stripes = given_paths(self.stripes, "stripes", "Config")
            if not stripes:
                raise bad("stripes", self.stripes, "None or a non-empty list of directories")
            object.__setattr__(self, "stripes", tuple(os.path.abspath(s) for s in stripes))

    def _check_pinned_bytes_hold_a_chunk(self, pinned_bytes: int) -> None:
        """A device save stages through an arena of at least one chunk: a bound below that
        could never make one. An ``"auto"`` chunk counts as the largest it may resolve to (a
        tuned size, capped by ``pool_bytes``), so a config accepted here fails on no machine."""
        given = isinstance(self.chunk_bytes, int)
        chunk = self.chunk_bytes if isinstance(self.chunk_bytes, int) else pool_chunk_cap(self.pool_bytes)
        least = min_pinned_bytes(chunk)
        if pinned_bytes < least:
            of = f"chunk_bytes={chunk}" if given else f'chunk_bytes="auto", which a tuned size may make {chunk}'
            fix = "lower chunk_bytes" if given else "give chunk_bytes as an integer"
            raise ValueError(
                f"Config.pinned_bytes={pinned_bytes!r}: expected at least {least} bytes (a device save stages "
                f"through an arena of at least one chunk, {of}, in whole arena granules); raise pinned_bytes, "
                f"or {fix}"
            )

    def resolved_for(
        self, path: str | os.PathLike[str], op: Literal["write", "read"] = "write", *, tuned_chunk: bool = True
    ) -> Config:
        """This config with ``"auto"`` chunk size and queue depth settled for `op` on `path`'s
        device: from ``fastpersist tune``'s cache, else the defaults (8 MiB, 8). Integers stay.
        `tuned_chunk=False` keeps an ``"auto"`` chunk at the default (a process group's ranks
        plan one stream and must agree on it). Never measures anything.

        Example:
            >>> Config(queue_depth=4).resolved_for("/tmp").queue_depth
            4
        """
        return resolve(self, path, op, tuned_chunk=tuned_chunk).config

    @property
    def resolved_chunk_bytes(self) -> int:
        """``chunk_bytes`` of a resolved config (see :meth:`resolved_for`); raises on ``"auto"``."""
        if isinstance(self.chunk_bytes, int):
            return self.chunk_bytes
        raise ValueError('Config.chunk_bytes is still "auto": resolve it with config.resolved_for(path) first')

    @property
    def resolved_queue_depth(self) -> int:
        """``queue_depth`` of a resolved config (see :meth:`resolved_for`); raises on ``"auto"``."""
        if isinstance(self.queue_depth, int):
            return self.queue_depth
        raise ValueError('Config.queue_depth is still "auto": resolve it with config.resolved_for(path) first')

    @property
    def resolved_staging_threads(self) -> int:
        """The staging threads a save of this process uses (``staging_threads``; see the class).

        Example:
            >>> 1 <= Config().resolved_staging_threads <= MAX_STAGING_THREADS
            True
            >>> Config(staging_threads=1).resolved_staging_threads
            1
        """
        mine = max(1, len(os.sched_getaffinity(0)) // ranks_on_node())
        if self.staging_threads == "auto":
            return max(1, min(mine - 1, MAX_STAGING_THREADS))
        return min(self.staging_threads, mine)


def ranks_on_node() -> int:
    """The ranks that share this node's cores and memory: ``LOCAL_WORLD_SIZE`` (as torchrun sets
    it), else 1; what ``"auto"`` bounds (pinned memory, staging threads) divide among."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def snapshot_pool_bytes(state_bytes: int, chunk_bytes: int) -> int:
    """A staging pool that holds a state of `state_bytes` whole, so that staging it is a memory
    copy, not a wait for the disk (docs/overlap.md): whole chunks of `chunk_bytes`, at least the
    default pool, at most a quarter of the machine's memory. What a Checkpointer and the
    overlapped integrations size their pool by when no Config is given.

    Example:
        >>> snapshot_pool_bytes(1 << 30, 8 << 20) >= 1 << 30 or os.sysconf("SC_PHYS_PAGES") < 1 << 20
        True
    """
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    wanted = -(-state_bytes // chunk_bytes) * chunk_bytes
    return max(Config().pool_bytes, min(wanted, ram // 4 // chunk_bytes * chunk_bytes))


def given_config(config: object, where: str = "config") -> Config:
    """`config` as a caller passed it (`where` names the argument): itself, or ``Config()`` for
    None; raises ``TypeError`` for anything else (a plain dict, a path), at the call.

    Example:
        >>> given_config(None) == Config(), given_config(Config(durable=False)).durable
        (True, False)
    """
    if config is None:
        return Config()
    if not isinstance(config, Config):
        raise TypeError(f"{where}={config!r}: expected a fastpersist.Config or None, not {type(config).__name__}")
    return config


class Resolved(NamedTuple):
    """A config with integer ``chunk_bytes`` and ``queue_depth``, and where they came from."""

    config: Config
    #: ``"explicit"``, ``"default"`` or ``"tuned YYYY-MM-DD for <device>"``; when the chunk
    #: size and the depth differ, ``"chunk <source>, depth <source>"``.
    source: str


def resolve(
    config: Config, path: str | os.PathLike[str], op: Literal["write", "read"], *, tuned_chunk: bool = True
) -> Resolved:
    """`config` with its ``"auto"`` values settled for `op` on `path`'s device
    (:mod:`fastpersist.tuning.resolve`), and where they came from.

    Example:
        >>> r = resolve(Config(queue_depth=4), "/tmp", "write")
        >>> r.config.queue_depth, isinstance(r.config.chunk_bytes, int)
        (4, True)
    """
    chunk, depth, source = settle(
        config.chunk_bytes, config.queue_depth, config.pool_bytes, config.stripes, path, op, tuned_chunk=tuned_chunk
    )
    if (chunk, depth) == (config.chunk_bytes, config.queue_depth):
        return Resolved(config, source)
    return Resolved(replace(config, chunk_bytes=chunk, queue_depth=depth), source)
