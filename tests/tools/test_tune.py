"""``fastpersist tune`` on a small directory (tiny sizes, a short time box): the table, the
cache it writes, the scratch files it removes, its refusals; and what ``bench`` says it used."""

from __future__ import annotations

import argparse
import collections
import json
import os

import pytest

from fastpersist.tools import cli
from fastpersist.tools import sweep as sweep_module
from fastpersist.tools.bench.settings import settle_settings
from fastpersist.tools.sweep import FINAL_ROUNDS, SweepLimits, pick_best, sweep
from fastpersist.tools.tune import result_table
from fastpersist.tuning.cache import CACHE_ENV, Best, Figure, lookup
from fastpersist.tuning.identity import device_identity

TINY = ["--seconds", "0.5", "--chunk-sizes", "64KiB,128KiB", "--depths", "1,2", "--max-trial-bytes", "1MiB"]


@pytest.fixture
def cache_file(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> str:
    path = str(tmp_path_factory.mktemp("cache") / "tune.json")
    monkeypatch.setenv(CACHE_ENV, path)
    return path


def test_tune_writes_the_cache_and_prints_the_table(
    cache_file: str, workdir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["tune", *TINY, workdir, workdir]) == 0
    out = capsys.readouterr().out
    identity = device_identity(workdir)
    assert f"tuning {identity.describe()}" in out and "same device as an earlier directory" in out
    assert "chunk MiB" in out and "best: write" in out and f"cached in {cache_file}" in out
    assert " *" in out  # the chosen settings are marked
    entry = lookup(identity)
    assert entry is not None and entry.read is not None
    assert entry.write.chunk_bytes in (64 << 10, 128 << 10) and entry.write.queue_depth in (1, 2)
    ops = {f.op for f in entry.figures}
    assert ops == {"write", "read"} and all(f.gb_per_s > 0 and f.bytes <= 1 << 20 for f in entry.figures)
    # Two directories on one drive: two concurrent writers were measured against one.
    two = [f for f in entry.figures if f.writers == 2]
    assert (
        len(two) == 1
        and two[0].op == "write"
        and (two[0].chunk_bytes, two[0].queue_depth)
        == (
            entry.write.chunk_bytes,
            entry.write.queue_depth,
        )
    )
    assert entry.writers_per_drive in (1, 2) and "writer(s) per drive" in out
    assert json.load(open(cache_file))["devices"][identity.key]["tuned_at"][:4].isdigit()
    assert not [n for n in os.listdir(workdir) if n.startswith(".fastpersist-tune")]  # scratch removed


def test_tune_refuses_an_unwritable_cache_before_measuring(
    workdir: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = os.path.join(workdir, "a-file")
    open(blocker, "w").close()
    monkeypatch.setenv(CACHE_ENV, os.path.join(blocker, "tune.json"))
    assert cli.main(["tune", *TINY, workdir]) == 2
    captured = capsys.readouterr()
    assert "cannot write the tuning cache" in captured.err and CACHE_ENV in captured.err
    assert "tuning " not in captured.out  # nothing was measured


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_tune_refuses_a_read_only_cache_dir(
    workdir: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = os.path.join(workdir, "ro")
    os.mkdir(folder, 0o500)
    monkeypatch.setenv(CACHE_ENV, os.path.join(folder, "tune.json"))
    assert cli.main(["tune", *TINY, workdir]) == 2
    assert "Permission denied" in capsys.readouterr().err


def test_tune_rejects_bad_limits(cache_file: str, workdir: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["tune", "--chunk-sizes", "1000", workdir]) == 2
    assert "4096" in capsys.readouterr().err
    assert cli.main(["tune", "--seconds", "1", os.path.join(workdir, "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_sweep_limits_reject_a_bad_depth() -> None:
    with pytest.raises(ValueError, match="queue depth 0"):
        SweepLimits(depths=(0,))


def test_sweep_skips_chunks_the_pool_cannot_hold_twice(workdir: str) -> None:
    limits = SweepLimits(
        seconds=0.5, chunk_sizes=(64 << 10, 1 << 20), depths=(1, 4), pool_bytes=256 << 10, max_trial_bytes=1 << 20
    )
    result = sweep(workdir, limits)
    assert {f.chunk_bytes for f in result.figures if f.op == "write"} == {64 << 10}
    assert all(f.queue_depth <= 4 for f in result.figures)


def _bench_args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"chunk_bytes": "auto", "queue_depth": "auto", "pool_bytes": 256 << 20, **kw})


def test_bench_says_which_settings_it_used(cache_file: str, workdir: str) -> None:
    args = _bench_args()
    assert settle_settings(args, workdir) == "settings: chunk 8 MiB, write depth 8 (default); read depth 8 (default)"
    assert cli.main(["tune", *TINY, workdir]) == 0
    entry = lookup(device_identity(workdir))
    assert entry is not None and entry.read is not None
    args = _bench_args()
    line = settle_settings(args, workdir)
    assert f"tuned {entry.date} for {device_identity(workdir).describe()}" in line
    assert (args.chunk_bytes, args.queue_depth, args.read_queue_depth) == (
        entry.write.chunk_bytes,
        entry.write.queue_depth,
        entry.read.queue_depth,
    )
    explicit = _bench_args(chunk_bytes=1 << 20, queue_depth=2)
    assert "(explicit)" in settle_settings(explicit, workdir)


def test_the_finals_rank_writes_by_the_median_of_repeated_trials(workdir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 1 MiB wins its one search trial by luck and is slower in every later one; 2 MiB is steady.
    trials: collections.Counter[tuple[int, int]] = collections.Counter()
    steady = {1 << 20: 1.0, 2 << 20: 2.5, 4 << 20: 2.0}

    def scripted(self: sweep_module._Trials, chunk: int, depth: int, slice_s: float) -> None:
        lucky = chunk == 1 << 20 and trials[(chunk, depth)] == 0
        trials[(chunk, depth)] += 1
        self.figures.append(Figure("write", chunk, depth, 3.0 if lucky else steady[chunk], 1 << 20))

    monkeypatch.setattr(sweep_module._Trials, "record_write", scripted)
    limits = SweepLimits(seconds=60, chunk_sizes=tuple(steady), depths=(1,), max_trial_bytes=4 << 20)
    result = sweep(workdir, limits)
    assert trials == {(c, 1): 1 + FINAL_ROUNDS for c in steady}  # every finalist timed again
    assert [(f.chunk_bytes, f.gb_per_s) for f in result.finals] == [(2 << 20, 2.5), (4 << 20, 2.0), (1 << 20, 1.0)]
    assert result.write == Best(2 << 20, 1, 2.5)
    assert result.read is not None and result.read.chunk_bytes == 2 << 20  # reads at the chosen chunk size
    assert "write finalists, GB/s median of their trials: 2 MiB x 1 2.50" in result_table(result)


def test_pick_best_prefers_fewer_bytes_in_flight_among_near_ties() -> None:
    figures = [
        Figure("write", 64 << 20, 4, 3.10, 1 << 30),
        Figure("write", 8 << 20, 8, 3.05, 1 << 30),  # within 3%: 64 MiB in flight instead of 256
        Figure("write", 1 << 20, 8, 2.00, 1 << 30),
    ]
    assert pick_best(figures) == Best(8 << 20, 8, 3.05)
    assert pick_best(figures[:1] + figures[2:]) == Best(64 << 20, 4, 3.10)


def test_one_directory_measures_no_writers_and_old_entries_still_load(workdir: str) -> None:
    limits = SweepLimits(seconds=0.3, chunk_sizes=(64 << 10,), depths=(1, 2), max_trial_bytes=1 << 20)
    result = sweep(workdir, limits)
    assert result.writers_per_drive is None and {f.writers for f in result.figures} == {1}
    four = sweep(workdir, limits, writers=4)
    assert {f.writers for f in four.figures} == {1, 2, 4} and four.writers_per_drive in (1, 2, 4)
    assert not [n for n in os.listdir(workdir) if n.startswith(".fastpersist-tune")]
    old = {"op": "write", "chunk_bytes": 1 << 20, "queue_depth": 8, "gb_per_s": 2.0, "bytes": 1 << 20}
    assert Figure(**old).writers == 1  # a cache written before writers were measured
