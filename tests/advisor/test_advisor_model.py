"""The interval model against hand-computed cases, degenerate ones included."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastpersist.advisor.model import (
    Costs,
    best_every,
    daly_interval_s,
    job_mtbf_s,
    optimum_compute_s,
    outcome,
    young_interval_s,
)

from budget import examples


def test_young_and_daly_by_hand() -> None:
    # sqrt(2 * 2 * 3600) = 120; x = sqrt(2 / 7200) = 1/60; 120 * (1 + 1/180 + 1/32400) - 2
    assert young_interval_s(2.0, 3600.0) == pytest.approx(120.0)
    assert daly_interval_s(2.0, 3600.0) == pytest.approx(120.0 * (1 + 1 / 180 + 1 / 32400) - 2.0)
    assert daly_interval_s(2.0, 3600.0) == pytest.approx(118.6704, abs=1e-4)
    # Daly tends to Young as the stall shrinks against the MTBF.
    assert daly_interval_s(1e-3, 1e7) / young_interval_s(1e-3, 1e7) == pytest.approx(1.0, abs=1e-4)


def test_job_mtbf_divides_by_nodes() -> None:
    assert job_mtbf_s(6000 * 3600.0, 16) == pytest.approx(375 * 3600.0)
    with pytest.raises(ValueError, match="nodes"):
        job_mtbf_s(3600.0, 0)
    with pytest.raises(ValueError, match="mtbf_s"):
        job_mtbf_s(-1.0, 1)


def test_outcome_by_hand() -> None:
    c = Costs(stall_s=1.0, write_s=1.0, step_s=1.0, restart_s=0.0, nbytes=10**9)
    o = outcome(9, c, mtbf_s=100.0)
    # τ = 9 s, P = 10 s: 1 s in 10 stalled; a failure loses P/2 + W = 6 s every 100 s.
    assert (o.compute_s, o.period_s, o.stall_s) == (9.0, 10.0, 1.0)
    assert o.stall_fraction == pytest.approx(0.1)
    assert o.failure_fraction == pytest.approx(0.06)
    assert o.lost_fraction == pytest.approx(0.16)
    assert o.saves_per_day == pytest.approx(8640.0)
    assert o.bytes_per_day == pytest.approx(8640.0 * 1e9)


def test_a_write_longer_than_the_interval_blocks_the_loop() -> None:
    c = Costs(stall_s=0.5, write_s=5.0, step_s=1.0, restart_s=10.0)
    o = outcome(2, c, mtbf_s=1000.0)
    # τ = 2 s but the next save waits for the previous commit: P = W = 5 s, 3 s of it stalled.
    assert o.period_s == 5.0 and o.stall_s == pytest.approx(3.0)
    assert o.stall_fraction == pytest.approx(0.6)
    assert o.failure_fraction == pytest.approx((10.0 + 2.5 + 5.0) / 1000.0)
    # The optimum never asks the loop to wait for a commit: τ >= W - δ = 4.5 s.
    assert optimum_compute_s(c, 1000.0) >= 4.5
    assert best_every(c, 1000.0) >= 5


def test_zero_stall_checkpoints_every_step_when_the_write_keeps_up() -> None:
    c = Costs(stall_s=0.0, write_s=0.5, step_s=1.0, restart_s=10.0)
    assert young_interval_s(0.0, 1000.0) == 0.0 and daly_interval_s(0.0, 1000.0) == 0.0
    assert best_every(c, 1000.0) == 1
    o = outcome(1, c, 1000.0)
    assert o.stall_s == 0.0 and o.stall_fraction == 0.0
    assert o.lost_fraction == pytest.approx((10.0 + 0.5 + 0.5) / 1000.0)


def test_zero_stall_with_a_slow_write_picks_the_interval_that_does_not_block() -> None:
    c = Costs(stall_s=0.0, write_s=3.5, step_s=1.0)
    # every=3: P = 3.5, 0.5 s blocked (14% stalled); every=4: P = 4, nothing blocked.
    assert outcome(3, c, 1000.0).stall_fraction == pytest.approx(0.5 / 3.5)
    assert outcome(4, c, 1000.0).stall_fraction == 0.0
    assert best_every(c, 1000.0) == 4


def test_mtbf_shorter_than_a_save() -> None:
    c = Costs(stall_s=100.0, write_s=100.0, step_s=1.0, restart_s=5.0)
    assert daly_interval_s(100.0, 50.0) == 50.0  # δ >= 2M: Daly's rule is τ = M
    every = best_every(c, 50.0)
    assert every == 50
    assert outcome(every, c, 50.0).lost_fraction == 1.0  # no progress expected
    assert outcome(1, c, 50.0).lost_fraction == 1.0


def test_max_every_bounds_the_choice() -> None:
    c = Costs(stall_s=1.0, write_s=1.0, step_s=0.01)
    assert best_every(c, 1e6) > 1000
    assert best_every(c, 1e6, max_every=1000) == 1000
    with pytest.raises(ValueError, match="max_every"):
        best_every(c, 1e6, max_every=0)


def test_bad_inputs_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="step_s"):
        Costs(stall_s=1.0, write_s=1.0, step_s=0.0)
    with pytest.raises(ValueError, match="stall_s"):
        Costs(stall_s=-1.0, write_s=1.0, step_s=1.0)
    with pytest.raises(ValueError, match="write_s"):
        Costs(stall_s=1.0, write_s=math.nan, step_s=1.0)
    with pytest.raises(ValueError, match="every"):
        outcome(0, Costs(stall_s=1.0, write_s=1.0, step_s=1.0), 100.0)
    with pytest.raises(ValueError, match="mtbf_s"):
        best_every(Costs(stall_s=1.0, write_s=1.0, step_s=1.0), math.inf)


@settings(max_examples=examples(200), deadline=None)
@given(
    stall=st.floats(0.0, 30.0),
    write=st.floats(0.0, 120.0),
    step=st.floats(0.05, 60.0),
    mtbf_h=st.floats(1.0, 10_000.0),
)
def test_best_every_is_near_the_brute_force_minimum(stall: float, write: float, step: float, mtbf_h: float) -> None:
    mtbf = mtbf_h * 3600.0
    c = Costs(stall_s=stall, write_s=write, step_s=step, restart_s=60.0)
    best = best_every(c, mtbf)
    lost = outcome(best, c, mtbf).lost_fraction
    # Every k up to 300, then 400 points spread over [best / 3, 3 * best].
    ks = set(range(1, 301)) | {max(1, round(best * (1 / 3 + 8 / 3 * i / 399))) for i in range(400)}
    brute = min(outcome(k, c, mtbf).lost_fraction for k in ks)
    # Daly's optimum sits a little above the first-order one; the cost curve is flat there.
    assert lost <= brute * 1.02 + 1e-12
