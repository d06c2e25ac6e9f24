"""The multi-level interval model (fastpersist.advisor.multilevel) and its CLI face."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fastpersist.advisor.multilevel import Failures, LevelCosts, advise_levels, best_remote_every, plan_lost

DAY = 86_400.0
COSTS = LevelCosts(
    step_s=1.0,
    stall_s=0.05,
    write_s=0.6,
    replicate_s=0.4,
    drain_s=30.0,
    drain_overhead_s=1.0,
    restart_s=60.0,
    remote_restart_s=300.0,
)


def test_frequent_node_losses_make_the_partner_level_pay() -> None:
    f = Failures(process_mtbf_s=7 * DAY, node_mtbf_s=30 * DAY, nodes=64, cluster_mtbf_s=90 * DAY)
    a = advise_levels(COSTS, f)
    assert a.best.replicas == 1
    no_partner = next(p for p in a.options if p.replicas == 0)
    assert no_partner.lost_fraction > a.best.lost_fraction
    # With no partner copy, node losses fall to the remote level: it drains as often as it can.
    assert no_partner.remote_every is not None and a.best.remote_every is not None
    assert no_partner.remote_every < a.best.remote_every


def test_without_node_losses_replicas_buy_nothing() -> None:
    f = Failures(process_mtbf_s=2 * DAY, nodes=8, cluster_mtbf_s=60 * DAY)
    assert advise_levels(COSTS, f).best.replicas == 0


def test_the_remote_interval_is_never_shorter_than_a_drain() -> None:
    slow = LevelCosts(step_s=1.0, stall_s=0.05, write_s=0.6, drain_s=500.0, drain_overhead_s=0.1)
    f = Failures(process_mtbf_s=DAY, node_mtbf_s=DAY, nodes=4, cluster_mtbf_s=DAY)
    for p in advise_levels(slow, f).options:
        assert p.remote_period_s is not None and p.remote_period_s >= 500.0


def test_lost_time_is_the_sum_of_its_parts() -> None:
    f = Failures(process_mtbf_s=1000.0, node_mtbf_s=None, nodes=1, cluster_mtbf_s=10_000.0)
    p = plan_lost(0, 9, 90, COSTS, f)  # a drain every 10th save
    assert p.period_s == pytest.approx(9.05)
    assert p.stall_fraction == pytest.approx(0.05 / 9.05)
    assert p.remote_period_s == pytest.approx(90.5)
    assert p.drain_fraction == pytest.approx(1.0 / 90.5)
    local = (60.0 + 9.05 / 2 + 0.6) / 1000.0
    remote = (300.0 + 90.5 / 2 + 30.0) / 10_000.0
    assert p.failure_fraction == pytest.approx(local + remote)
    assert p.lost_fraction == pytest.approx(p.stall_fraction + p.drain_fraction + p.failure_fraction)


def test_remote_every_is_in_steps_as_the_checkpointer_takes_it() -> None:
    """The advice's remote_every counts steps (a multiple of every), the unit of
    Checkpointer(remote_every=): read as saves, every=113 with remote_every=35 would drain every save."""
    f = Failures(process_mtbf_s=7 * DAY, node_mtbf_s=30 * DAY, nodes=16, cluster_mtbf_s=90 * DAY)
    for p in advise_levels(COSTS, f).options:
        assert p.remote_every is not None and p.remote_every % p.every == 0 and p.remote_every > p.every
        assert p.remote_period_s == pytest.approx(max(p.remote_every // p.every * p.period_s, COSTS.drain_s))
    assert plan_lost(0, 10, 25, COSTS, f).remote_period_s == pytest.approx(3 * 10.05)  # the save at 30 crosses 25


def test_best_remote_every_for_a_fixed_every_is_the_least_lost() -> None:
    f = Failures(process_mtbf_s=DAY, cluster_mtbf_s=7 * DAY)
    best = best_remote_every(0, 4, COSTS, f)
    assert best % 4 == 0
    lost = {r: plan_lost(0, 4, r, COSTS, f).lost_fraction for r in range(4, 4 * 400, 4)}
    assert lost[best] <= min(lost.values()) * 1.0001


def test_no_level_survives_a_failure_without_a_remote() -> None:
    f = Failures(process_mtbf_s=DAY, cluster_mtbf_s=DAY)
    assert plan_lost(0, 10, None, COSTS, f).lost_fraction == 1.0


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="step_s"):
        LevelCosts(step_s=0.0, stall_s=0.1, write_s=0.1)
    with pytest.raises(ValueError, match="node_mtbf_s"):
        Failures(node_mtbf_s=-1.0)


def test_the_cli_prints_the_levels_table_and_json() -> None:
    args = [
        sys.executable, "-m", "fastpersist", "advise", "--step-seconds", "1", "--stall-seconds", "0.05",
        "--write-seconds", "0.6", "--restart-seconds", "60", "--bytes", "1e9", "--mtbf-hours", "720",
        "--nodes", "64", "--process-mtbf-hours", "168", "--cluster-mtbf-hours", "2160",
        "--replicate-seconds", "0.4", "--drain-seconds", "30", "--drain-overhead-seconds", "1",
    ]  # fmt: skip
    text = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    assert "Across levels" in text and "<- recommended" in text
    doc = json.loads(subprocess.run([*args, "--json"], capture_output=True, text=True, check=True).stdout)
    recommended = [p for p in doc["levels"] if p["recommended"]]
    assert len(recommended) == 1 and recommended[0]["replicas"] == 1
