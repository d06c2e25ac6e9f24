"""The registry of kept memory: one rule (the most recent few per kind), every kind reported."""

from __future__ import annotations

import os
import pathlib
import threading

import pytest
import torch

import fastpersist as fp
from fastpersist.engine.kept_memory import KEPT_PER_KIND, KeptCache, kept_bound_bytes, kept_bytes


def test_the_most_recently_used_are_kept_and_the_oldest_released() -> None:
    released: list[bytes] = []
    cache: KeptCache[str, bytes] = KeptCache(
        "test: lru", size_of=len, bound_of_one=lambda config: 3, release=released.append
    )
    made = [cache.get_or_make(k, lambda k=k: k.encode() * 2) for k in "abc"]
    assert made == [b"aa", b"bb", b"cc"] and released == [b"aa"] and len(cache) == KEPT_PER_KIND
    assert cache.get_or_make("b", lambda: b"new") == b"bb"  # kept: not made again, now the newest
    cache.get_or_make("d", lambda: b"dd")
    assert released == [b"aa", b"cc"] and "b" in cache and "d" in cache
    assert cache.total_bytes() == 4 and kept_bytes()["test: lru"] == 4
    cache.clear()
    assert released == [b"aa", b"cc", b"bb", b"dd"] and len(cache) == 0 and kept_bytes()["test: lru"] == 0


def test_a_taken_buffer_is_not_shared_and_a_concurrent_one_is_let_go_when_both_come_back() -> None:
    released: list[bytearray] = []
    cache: KeptCache[int, bytearray] = KeptCache("test: take", size_of=len, release=released.append)
    first = bytearray(8)
    cache.give_back(8, first)
    taken = cache.take(8)
    assert taken is first and cache.take(8) is None  # a second user makes its own
    second = bytearray(8)
    cache.give_back(8, second)
    cache.give_back(8, first)
    assert released == [second] and cache.take(8) is first
    cache.give_back(8, first)
    cache.give_back(8, first)  # the same buffer twice is not released
    assert released == [second] and len(cache) == 1


def test_release_runs_outside_the_lock_so_it_may_use_the_cache() -> None:
    cache: KeptCache[int, int] = KeptCache("test: reentrant", size_of=lambda v: v, keep=1)
    seen: list[int] = []

    def release(value: int) -> None:  # would deadlock if called under the cache's lock
        seen.append(len(cache))

    cache._release = release
    done = threading.Event()

    def fill() -> None:
        cache.get_or_make(1, lambda: 1)
        cache.get_or_make(2, lambda: 2)
        done.set()

    threading.Thread(target=fill, daemon=True).start()
    assert done.wait(10) and seen == [1]


def test_every_kind_of_kept_memory_is_reported(tmp_path: pathlib.Path) -> None:
    from fastpersist.saving.pools import POOLS

    path = os.path.join(str(tmp_path), "ck")
    config = fp.Config(chunk_bytes=1 << 20, pool_bytes=4 << 20)
    fp.save({"w": torch.ones(1 << 20)}, path, config=config)
    kinds = kept_bytes()
    assert {"staging pools", "device-load rings", "staging arenas"} <= set(kinds)
    assert kinds["staging pools"] == POOLS.total_bytes() >= 1 << 20  # the slots the save staged in
    assert all(isinstance(v, int) and v >= 0 for v in kinds.values())


@pytest.mark.parametrize("keep", [0, 1, 3])
def test_the_bound_is_the_cache_s_own(keep: int) -> None:
    cache: KeptCache[int, int] = KeptCache("test: bound", size_of=lambda v: 1, keep=keep)
    for k in range(5):
        cache.get_or_make(k, lambda k=k: k)
    assert len(cache) == keep


def test_what_a_process_keeps_stays_within_one_bound(tmp_path: pathlib.Path) -> None:
    """Saves of states of several sizes and loads, all with one config: every kind stays within
    its bound, and all of them within kept_bound_bytes (the bound is the sum, said once)."""
    from fastpersist.saving.pools import POOLS

    config = fp.Config(chunk_bytes=1 << 20, pool_bytes=4 << 20).resolved_for(str(tmp_path))
    POOLS.clear()
    for k, nbytes in enumerate([1 << 20, 8 << 20, 3 << 20]):
        path = str(tmp_path / f"s{k}")
        state = {"w": torch.ones(nbytes // 4), "small": torch.ones(100)}
        fp.save_async(state, path, config=config).wait()
        assert torch.equal(fp.load(path, config=config)["w"], state["w"])
    kinds = kept_bytes()
    assert 0 < kinds["staging pools"] <= KEPT_PER_KIND * (4 << 20) + KEPT_PER_KIND * (64 << 20)
    assert sum(v for k, v in kinds.items() if not k.startswith("test: ")) <= kept_bound_bytes(config)
    # the bound counts what it says: two pools of 4 slots and an early-copy block each, two rings
    # of two 64 MiB windows, and Config.pinned_bytes of arenas
    from fastpersist.gpu.arenas import pinned_cap_bytes

    expected = 2 * ((4 << 20) + (64 << 20)) + 2 * 2 * (64 << 20) + pinned_cap_bytes(config.pinned_bytes)
    assert kept_bound_bytes(config) - sum(kind_bound for kind_bound in _test_kinds_bounds(config)) == expected


def _test_kinds_bounds(config: fp.Config) -> list[int]:
    from fastpersist.engine import kept_memory

    return [kind.bound_bytes(config) for name, kind in kept_memory._kinds.items() if name.startswith("test: ")]
