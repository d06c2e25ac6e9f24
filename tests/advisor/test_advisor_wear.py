"""Drive wear: the hourly log, endurance arithmetic, and the projection in ``advise``."""

from __future__ import annotations

import datetime
import math

import pytest

import fastpersist as fp
from fastpersist.advisor.model import outcome
from fastpersist.advisor.wear import KEEP_DAYS, Endurance, WearLog, bytes_per_day_allowed, days_of_endurance

T0 = datetime.datetime(2026, 11, 1, tzinfo=datetime.UTC).timestamp()


def synthetic_log(hours: int = 48) -> WearLog:
    """1 GB every 10 minutes for `hours` hours, split over two stripe directories."""
    log = WearLog()
    for i in range(hours * 6):
        when = T0 + i * 600.0
        log.add("/mnt/nvme0/ck", 500_000_000, when_s=when)
        log.add("/mnt/nvme1/ck", 500_000_000, when_s=when)
    return log


def test_a_synthetic_history_gives_its_rate() -> None:
    log = synthetic_log()
    assert log.total_bytes() == 48 * 6 * 10**9
    assert log.span_s() == 48 * 3600.0
    assert log.bytes_per_day() == pytest.approx(144e9)
    assert log.bytes_per_day("/mnt/nvme0/ck") == pytest.approx(72e9)
    assert log.daily() == {"2026-11-01": 144 * 10**9, "2026-11-02": 144 * 10**9}


def test_the_log_round_trips_and_stays_bounded() -> None:
    log = synthetic_log(hours=3)
    again = WearLog.from_json(log.to_json())
    assert again == log
    with pytest.raises(ValueError, match="wear log"):
        WearLog.from_json({"hourly": []})
    log.add("/mnt/nvme0/ck", 1, when_s=T0 + (KEEP_DAYS + 2) * 86_400.0)
    assert min(log.targets["/mnt/nvme0/ck"]) > T0  # buckets older than KEEP_DAYS are dropped


def test_endurance_arithmetic() -> None:
    e = Endurance.from_dwpd(1.0, capacity_bytes=3.84e12, warranty_years=5)
    assert e.tbw_bytes == pytest.approx(3.84e12 * 365 * 5)
    half = Endurance.from_tbw(1000.0, used_fraction=0.5)
    assert half.remaining_bytes == pytest.approx(500e12)
    assert days_of_endurance(half, 1e12) == pytest.approx(500.0)
    assert math.isinf(days_of_endurance(half, 0.0))
    today = datetime.date(2026, 12, 1)
    assert bytes_per_day_allowed(half, datetime.date(2027, 12, 1), today) == pytest.approx(500e12 / 365)
    assert math.isinf(bytes_per_day_allowed(half, today, today))
    with pytest.raises(ValueError, match="used_fraction"):
        Endurance(1e12, used_fraction=1.5)


def test_advise_shows_the_interval_whose_wear_fits() -> None:
    # 100 GB per save over 10 drives, every step of 10 s: 86.4 TB per drive per day.
    endurance = Endurance.from_tbw(7000.0)
    today, until = datetime.date(2026, 12, 1), datetime.date(2031, 12, 1)
    failures = fp.Failures(process_mtbf_s=1e4)
    costs = fp.CostOverrides(step_s=10.0, stall_s=1e-4, write_s=1.0, nbytes=10**11)
    wear = fp.Wear(drives=10, endurance=endurance, until=until, today=today)
    a = fp.advise(failures=failures, costs=costs, wear=wear, every=1, probe_devices=False)
    allowed = bytes_per_day_allowed(endurance, until, today)
    assert a.bytes_per_drive_day(a.best) > allowed
    assert a.wear_fit is not None
    assert a.bytes_per_drive_day(a.wear_fit) <= allowed
    shorter = outcome(a.wear_fit.every - 1, a.costs, a.mtbf_s)
    assert a.bytes_per_drive_day(shorter) > allowed  # the shortest interval that fits
    runs_out = [w for w in a.warnings if "endurance runs out" in w and f"every={a.wear_fit.every}" in w]
    assert len(runs_out) == 2 and "recommended every=1" in runs_out[0] and "current every=1" in runs_out[1]
    assert "lasts to 2031-12-01" in str(a)
    # Without a date: no fit needed, the endurance is shown in days.
    b = fp.advise(failures=failures, costs=costs, wear=fp.Wear(drives=10, endurance=endurance), probe_devices=False)
    assert b.wear_fit is None
    assert b.endurance_days(b.every_step) == pytest.approx(7000e12 / (86_400 / 10.0001 * 1e10))
