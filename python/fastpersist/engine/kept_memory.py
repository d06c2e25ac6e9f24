"""The memory a process keeps between saves and loads: one registry, one rule per kind.

Three kinds of buffer outlive the save or load that made them, because making them again costs
more than keeping them (fresh pages are faulted in and zeroed; CUDA registers pinned memory at
about a second per 4-10 GB):

* ``"staging pools"``: the page-aligned slots host saves stage into (``saving/pools.py``), one
  per (chunk size, ``Config.pool_bytes``);
* ``"device-load rings"``: the pinned host buffers a load to a device reads into
  (``loading/todevice.py``), one ring per buffer size;
* ``"staging arenas"``: the pinned arenas device saves and the in-memory level stage into
  (``gpu/arenas.py``), with their own leasing.

The bound, in one place: :func:`kept_bound_bytes` (a config's), the sum of what each kind
registers with :func:`count_kept`. Pools and rings are each a :class:`KeptCache`, which keeps the
:data:`KEPT_PER_KIND` most recently used and lets go of the oldest: two pools, each its slots
(``Config.pool_bytes`` in whole chunks, at least two) and the block of its early copies (at
most 64 MiB), and two rings of two windows each; the arenas together stay within
``Config.pinned_bytes`` (docs/gpu.md). A Checkpointer holds its own pool besides, for its life.
:func:`kept_bytes` reports what each kind holds now.

Example:
    >>> cache = KeptCache("example", size_of=len)
    >>> cache.get_or_make("a", lambda: b"xx"), cache.get_or_make("b", lambda: b"yyy")
    (b'xx', b'yyy')
    >>> cache.get_or_make("c", lambda: b"z"), len(cache), cache.total_bytes()
    (b'z', 2, 4)
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from typing import Generic, NamedTuple, TypeVar

from ..config import Config

__all__ = ["KEPT_PER_KIND", "KeptCache", "count_kept", "kept_bound_bytes", "kept_bytes"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: Buffers of one kind kept between uses: the one in use and the one before it, so that a
#: process alternating between two sizes (a save and a differently chunked one, two loads)
#: makes nothing after the first round, and one that saves states of many sizes keeps no more.
KEPT_PER_KIND = 2


class _Kind(NamedTuple):
    total_bytes: Callable[[], int]
    bound_bytes: Callable[[Config], int]


#: Each kind's report of the bytes it holds now and of its bound, by name.
_kinds: dict[str, _Kind] = {}
_kinds_lock = threading.Lock()


def count_kept(kind: str, total_bytes: Callable[[], int], bound_bytes: Callable[[Config], int]) -> None:
    """Names a kind of kept memory, how to measure it (:func:`kept_bytes`) and the most it keeps
    for saves and loads made with a (resolved) config (:func:`kept_bound_bytes`)."""
    with _kinds_lock:
        _kinds[kind] = _Kind(total_bytes, bound_bytes)


def kept_bytes() -> dict[str, int]:
    """Bytes each kind of kept memory holds now, by kind (see the module docs)."""
    with _kinds_lock:
        kinds = dict(_kinds)
    return {name: kind.total_bytes() for name, kind in kinds.items()}


def kept_bound_bytes(config: Config) -> int:
    """The most memory a process keeps between its saves and loads made with `config` (resolved
    for their directory; loads of checkpoints written with it), beyond the pool each live
    Checkpointer holds: the sum of every kind's bound (see the module docs)."""
    with _kinds_lock:
        kinds = list(_kinds.values())
    return sum(kind.bound_bytes(config) for kind in kinds)


class KeptCache(Generic[K, V]):
    """Buffers of one kind by key, the :data:`KEPT_PER_KIND` most recently used kept.

    `size_of` measures a buffer for :func:`kept_bytes`; `release` is called on each buffer let
    go of (outside the lock: it may wait, e.g. for copies that still read it). `bound_of_one`:
    the most one buffer of the kind holds for a config; with it the cache is counted by
    :func:`kept_bytes` and :func:`kept_bound_bytes` under `kind`. A buffer is
    either shared (:meth:`get_or_make`: stays in the cache while used) or taken for one use
    (:meth:`take` then :meth:`give_back`).
    """

    def __init__(
        self,
        kind: str,
        *,
        size_of: Callable[[V], int],
        bound_of_one: Callable[[Config], int] | None = None,
        release: Callable[[V], None] | None = None,
        keep: int = KEPT_PER_KIND,
    ) -> None:
        self._kept: collections.OrderedDict[K, V] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._size_of = size_of
        self._release = release
        self.keep = keep
        if bound_of_one is not None:
            count_kept(kind, self.total_bytes, lambda config: self.keep * bound_of_one(config))

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        """The buffer kept for `key` (now the most recently used), else a new one from `make`,
        kept."""
        with self._lock:
            value = self._kept.pop(key, None)
            if value is None:
                value = make()
            self._kept[key] = value
            dropped = self._overflow()
        self._let_go(dropped)
        return value

    def take(self, key: K) -> V | None:
        """The buffer kept for `key`, removed from the cache for one use, or None."""
        with self._lock:
            return self._kept.pop(key, None)

    def give_back(self, key: K, value: V) -> None:
        """Keeps `value` for `key` as the most recently used; one kept meanwhile for the same
        key (a concurrent use made its own) is let go of, as are the oldest over the bound."""
        with self._lock:
            previous = self._kept.pop(key, None)
            self._kept[key] = value
            dropped = self._overflow()
        if previous is not None and previous is not value:
            dropped.insert(0, previous)
        self._let_go(dropped)

    def clear(self) -> None:
        """Lets go of every buffer kept (released as when dropped)."""
        with self._lock:
            dropped = list(self._kept.values())
            self._kept.clear()
        self._let_go(dropped)

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._kept

    def total_bytes(self) -> int:
        """Bytes of every buffer kept (not those taken)."""
        with self._lock:
            values = list(self._kept.values())
        return sum(self._size_of(v) for v in values)

    def _overflow(self) -> list[V]:
        dropped = []
        while len(self._kept) > self.keep:
            dropped.append(self._kept.popitem(last=False)[1])
        return dropped

    def _let_go(self, dropped: list[V]) -> None:
        if self._release is not None:
            for value in dropped:
                self._release(value)
