"""Replicated loads shared across real gloo process groups: each rank reads ~1/N of the stream."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from fastpersist.loading.shared_read import read_pieces, read_shares

from gloo import run_ranks
from group_load_workers import CHUNK_BYTES, run


def run_group(world: int, scenario: str, workdir: str, backend: str, timeout_s: float = 120) -> list[dict[str, Any]]:
    """Runs `scenario` on `world` spawned ranks; returns each rank's result (or its traceback)."""
    return run_ranks(run, world, (scenario, workdir, backend), workdir, timeout_s)


def test_a_group_of_one_reads_the_whole_stream_as_before(workdir: str) -> None:
    (res,) = run_group(1, "shared_read", workdir, "threads")
    assert "traceback" not in res and res["same"] and res["same_old"], res
    assert res["share"] == res["old"] == {"shared": 0, "whole": res["total_bytes"]}


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_reads_its_share_and_ends_with_the_whole_state(workdir: str, backend: str, world: int) -> None:
    results = run_group(world, "shared_read", workdir, backend)
    for r, res in enumerate(results):
        assert "traceback" not in res, res
        assert res["same"] and res["same_old"], f"rank {r}"
    total = results[0]["total_bytes"]
    shares = [res["share"]["shared"] for res in results]
    assert sum(shares) == total, shares  # every byte read once, by one rank
    assert max(shares) - min(shares) <= CHUNK_BYTES, shares  # ~1/N each
    assert all(res["share"]["whole"] == 0 for res in results)
    # shared_read=False: every rank reads the whole stream, as before.
    assert all(res["old"] == {"shared": 0, "whole": total} for res in results), results


def test_a_corrupt_chunk_makes_every_rank_raise(workdir: str, backend: str) -> None:
    world = 2
    results = run_group(world, "corrupt_share", workdir, backend, timeout_s=90)
    for res in results:
        assert "traceback" not in res, res
        assert res["error"].startswith("ChecksumMismatchError"), res
        assert res["checksum"], "the error names the file and byte range on every rank"
        assert res["elapsed"] < 20, res
    assert f"rank {world - 1} failed to read its share" in results[0]["error"]
    assert "checksum mismatch" in results[world - 1]["error"]


def test_a_hung_rank_makes_the_others_raise_after_the_timeout(workdir: str) -> None:
    results = run_group(2, "hung_reader", workdir, "threads", timeout_s=90)
    assert all("traceback" not in res for res in results), results
    assert "GroupLoadError" in results[0]["error"] and "timeout_s=3.0" in results[0]["error"], results[0]
    assert results[0]["elapsed"] < 3.0 + 8, results[0]
    assert "GroupLoadError" in results[1]["error"], results[1]  # the stalled rank raises too, once it wakes
    assert results[0]["group_error"] and results[1]["group_error"]  # fp.GroupLoadError, a FastPersistError


def test_read_shares_are_whole_chunks_covering_the_stream() -> None:
    for total in [1, 4096, 10 << 20, (10 << 20) + 5, 3 << 20]:
        for ranks in [1, 2, 3, 4, 7]:
            shares = read_shares(total, 1 << 20, ranks)
            assert shares[0][0] == 0 and shares[-1][1] == total
            assert all(a[1] == b[0] for a, b in itertools.pairwise(shares))
            assert all(lo % (1 << 20) == 0 for lo, _ in shares)
            sizes = [hi - lo for lo, hi in shares]
            assert max(sizes) - min(sizes) <= 1 << 20


def test_read_pieces_are_whole_chunks_of_a_run() -> None:
    chunk = 1 << 20
    assert read_pieces(0, 0, chunk) == []
    assert read_pieces(4 * chunk, 4 * chunk + 5, chunk, piece_bytes=3 * chunk) == [(4 * chunk, 4 * chunk + 5)]
    pieces = read_pieces(2 * chunk, 9 * chunk + 7, chunk, piece_bytes=3 * chunk + 1)
    assert pieces == [(2 * chunk, 5 * chunk), (5 * chunk, 8 * chunk), (8 * chunk, 9 * chunk + 7)]
    assert read_pieces(0, 3 * chunk, chunk, piece_bytes=1) == [(0, chunk), (chunk, 2 * chunk), (2 * chunk, 3 * chunk)]
