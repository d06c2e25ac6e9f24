"""Drive wear: the bytes checkpoints write per target directory, and how long a drive's rated
endurance lasts at a given write rate.

A :class:`WearLog` keeps bytes in hourly buckets per target directory (the checkpoint root, or
a stripe directory), bounded to the last :data:`KEEP_DAYS` days; ``Checkpointer`` persists it in
``ROOT/history.json``. :class:`Endurance` is one drive's rating: TBW, or DWPD x capacity x
warranty years, less the share already used where the drive reports it. :class:`Wear` is what
``advise`` is told about the drives: how many, their endurance, and the date they must last to.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Endurance", "Wear", "WearLog", "bytes_per_day_allowed", "days_of_endurance"]

HOUR_S = 3600
DAY_S = 86_400.0
KEEP_DAYS = 90


@dataclass(frozen=True)
class Endurance:
    """One drive's rated endurance.

    Attributes:
        tbw_bytes: bytes the drive is rated to absorb over its life (TBW x 1e12).
        used_fraction: share of it already used (NVMe "percentage used" / 100), 0 when unknown.
        source: where the numbers came from, in words.

    Example:
        >>> e = Endurance.from_dwpd(1.0, capacity_bytes=3.84e12, warranty_years=5)
        >>> round(e.tbw_bytes / 1e15, 2)   # petabytes
        7.01
    """

    tbw_bytes: float
    used_fraction: float = 0.0
    source: str = "given"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tbw_bytes) and self.tbw_bytes > 0):
            raise ValueError(f"Endurance.tbw_bytes={self.tbw_bytes!r}: expected a positive number of bytes")
        if not 0.0 <= self.used_fraction <= 1.0:
            raise ValueError(f"Endurance.used_fraction={self.used_fraction!r}: expected a fraction in [0, 1]")

    @classmethod
    def from_tbw(cls, tbw_tb: float, *, used_fraction: float = 0.0) -> Endurance:
        """From a TBW rating in terabytes (1e12 bytes)."""
        return cls(tbw_tb * 1e12, used_fraction, f"rated {tbw_tb:g} TBW (given)")

    @classmethod
    def from_dwpd(
        cls, dwpd: float, *, capacity_bytes: float, warranty_years: float = 5.0, used_fraction: float = 0.0
    ) -> Endurance:
        """From drive writes per day over the warranty: ``dwpd x capacity x 365 x years``."""
        if not (capacity_bytes > 0 and dwpd > 0 and warranty_years > 0):
            raise ValueError("Endurance.from_dwpd needs dwpd, capacity_bytes and warranty_years > 0")
        tbw = dwpd * capacity_bytes * 365.0 * warranty_years
        source = f"{dwpd:g} DWPD x {capacity_bytes / 1e12:.2f} TB x {warranty_years:g} years (given)"
        return cls(tbw, used_fraction, source)

    @property
    def remaining_bytes(self) -> float:
        """Bytes left before the rating is used up."""
        return self.tbw_bytes * (1.0 - self.used_fraction)


def _day(owner: str, value: object) -> None:
    if value is not None and (not isinstance(value, datetime.date) or isinstance(value, datetime.datetime)):
        raise TypeError(f"{owner}={value!r}: expected a datetime.date (a day, not a datetime) or None")


@dataclass(frozen=True)
class Wear:
    """The drives under the checkpoints, for :func:`~fastpersist.advise`'s wear projection.

    Attributes:
        drives: drives one checkpoint is spread over (wear is per drive); None: the source's
            target directories, at least 1.
        endurance: one drive's rated endurance (None: the days until it is used up are not shown).
        until: the day the drives must last to: with `endurance`, ``advise`` finds the shortest
            interval whose writes leave endurance until then, and warns about the shorter ones.
        today: the day the wear starts counting from (None: the clock's date).

    Example:
        >>> w = Wear(drives=64, endurance=Endurance.from_tbw(7008.0), until=datetime.date(2027, 12, 31))
        >>> w.drives, round(w.endurance.tbw_bytes / 1e15, 3)
        (64, 7.008)
    """

    drives: int | None = None
    endurance: Endurance | None = None
    until: datetime.date | None = None
    today: datetime.date | None = None

    def __post_init__(self) -> None:
        if self.drives is not None and (type(self.drives) is not int or self.drives < 1):
            raise ValueError(f"Wear.drives={self.drives!r}: expected an integer >= 1 (drives one checkpoint spans)")
        if self.endurance is not None and not isinstance(self.endurance, Endurance):
            raise TypeError(
                f"Wear.endurance={self.endurance!r}: expected a fastpersist.Endurance "
                "(e.g. Endurance.from_tbw(7008) or Endurance.from_dwpd(1, capacity_bytes=3.84e12))"
            )
        _day("Wear.until", self.until)
        _day("Wear.today", self.today)


def days_of_endurance(endurance: Endurance, bytes_per_day: float) -> float:
    """Days until `endurance` is used up at `bytes_per_day` per drive (``inf`` when nothing is written).

    Example:
        >>> days_of_endurance(Endurance(1e15), 1e12)
        1000.0
    """
    return math.inf if bytes_per_day <= 0 else endurance.remaining_bytes / bytes_per_day


def bytes_per_day_allowed(endurance: Endurance, until: datetime.date, today: datetime.date) -> float:
    """The highest write rate per drive that leaves endurance until `until` (``inf`` if it is today or past).

    Example:
        >>> bytes_per_day_allowed(Endurance(1e15), datetime.date(2027, 1, 10), datetime.date(2026, 12, 1))
        25000000000000.0
    """
    days = (until - today).days
    return math.inf if days <= 0 else endurance.remaining_bytes / days


@dataclass
class WearLog:
    """Bytes written per target directory, in hourly buckets (unix hour start -> bytes).

    Example:
        >>> log = WearLog()
        >>> log.add("/ckpt", 10**9, when_s=7200.0); log.add("/ckpt", 10**9, when_s=7300.0)
        >>> log.total_bytes(), log.targets["/ckpt"]
        (2000000000, {7200: 2000000000})
    """

    targets: dict[str, dict[int, int]] = field(default_factory=dict)

    def add(self, target: str, nbytes: int, *, when_s: float) -> None:
        """Counts `nbytes` written to `target` at unix time `when_s`; drops buckets older than KEEP_DAYS."""
        hour = int(when_s // HOUR_S) * HOUR_S
        buckets = self.targets.setdefault(target, {})
        buckets[hour] = buckets.get(hour, 0) + int(nbytes)
        oldest = hour - KEEP_DAYS * 24 * HOUR_S
        for old in [h for h in buckets if h < oldest]:
            del buckets[old]

    def total_bytes(self, target: str | None = None) -> int:
        """Bytes counted for `target` (all targets when None)."""
        chosen = [self.targets.get(target, {})] if target is not None else list(self.targets.values())
        return sum(sum(b.values()) for b in chosen)

    def span_s(self) -> float:
        """Seconds from the start of the oldest bucket to the end of the newest."""
        hours = [h for b in self.targets.values() for h in b]
        return float(max(hours) - min(hours) + HOUR_S) if hours else 0.0

    def bytes_per_day(self, target: str | None = None) -> float:
        """The observed write rate: bytes over the whole logged span (whole hours), per day."""
        span = self.span_s()
        return self.total_bytes(target) * DAY_S / span if span else 0.0

    def daily(self, target: str | None = None) -> dict[str, int]:
        """Bytes per UTC day (``YYYY-MM-DD`` -> bytes)."""
        out: dict[str, int] = {}
        chosen = [self.targets.get(target, {})] if target is not None else list(self.targets.values())
        for buckets in chosen:
            for hour, nbytes in buckets.items():
                day = datetime.datetime.fromtimestamp(hour, datetime.UTC).date().isoformat()
                out[day] = out.get(day, 0) + nbytes
        return dict(sorted(out.items()))

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: ``{"hourly": {target: {hour: bytes}}}`` (hours as strings)."""
        return {"hourly": {t: {str(h): n for h, n in sorted(b.items())} for t, b in self.targets.items()}}

    @classmethod
    def from_json(cls, doc: object) -> WearLog:
        """Reads :meth:`to_json`'s output; raises ValueError on anything else."""
        hourly = doc.get("hourly") if isinstance(doc, Mapping) else None
        if not isinstance(hourly, Mapping):
            raise ValueError("wear log: expected {'hourly': {target: {hour: bytes}}}")
        targets: dict[str, dict[int, int]] = {}
        for target, buckets in hourly.items():
            if not isinstance(target, str) or not isinstance(buckets, Mapping):
                raise ValueError(f"wear log: bad entry for {target!r}")
            targets[target] = {int(h): int(n) for h, n in buckets.items()}
        return cls(targets)
