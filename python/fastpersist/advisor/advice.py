"""`Advice`, what ``fastpersist.advise`` returns, and the text table it prints as (``str(advice)``)."""

from __future__ import annotations

import dataclasses
import datetime
import math
from dataclasses import dataclass, field
from typing import Any

from .devinfo import DeviceInfo
from .model import Costs, Outcome
from .wear import Endurance, days_of_endurance

__all__ = ["Advice", "format_advice"]


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 3 * 86_400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86_400:.1f} days"


def _bytes(nbytes: float) -> str:
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _inputs(a: Advice) -> list[str]:
    c = a.costs
    rows = [
        ("stall per save", f"{c.stall_s:.3f} s", a.where.get("stall_s", "")),
        ("write until durable", f"{c.write_s:.3f} s", a.where.get("write_s", "")),
        ("training step", f"{c.step_s:.3f} s", a.where.get("step_s", "")),
        ("restart", _duration(c.restart_s), a.where.get("restart_s", "")),
        ("checkpoint size", _bytes(c.nbytes), a.where.get("nbytes", "")),
        ("job MTBF", _duration(a.mtbf_s), a.where.get("mtbf_s", "")),
        ("drives per checkpoint", str(a.drives), a.where.get("drives", "")),
    ]
    if a.endurance is not None:
        used = f", {a.endurance.used_fraction:.0%} used" if a.endurance.used_fraction else ""
        rows.append(("drive endurance", _bytes(a.endurance.tbw_bytes) + used, a.endurance.source))
    return [f"  {name:<22}{value:>12}  {src}" for name, value, src in rows]


def _pct(fraction: float) -> str:
    if fraction == 0:
        return "0%"
    return f"{fraction * 100:.2g}%" if fraction < 0.001 else f"{fraction:.2%}"


def _row(a: Advice, label: str, o: Outcome) -> str:
    days = a.endurance_days(o)
    if days is None:
        wear = "-"
    elif math.isinf(days):
        wear = "never"
    else:
        wear = f"{days:,.0f} d"
    return (
        f"  {label:<20}{o.every:>7}{_duration(o.period_s):>11}{o.stall_s:>9.3f}{_pct(o.stall_fraction):>10}"
        f"{_pct(o.failure_fraction):>10}{_pct(o.lost_fraction):>10}{_bytes(a.bytes_per_drive_day(o)):>12}{wear:>10}"
    )


def format_advice(a: Advice) -> str:
    """The human-readable report of an :class:`Advice`."""
    lines = ["fastpersist advise: how often to checkpoint", "", "inputs (see docs/advisor.md)"]
    lines += _inputs(a)
    lines += [
        "",
        f"optimal training time between saves: Young {_duration(a.young_s)}, Daly {_duration(a.daly_s)}"
        f" = {a.daly_s / a.costs.step_s:,.1f} steps",
        "",
        f"  {'interval':<20}{'every':>7}{'period':>11}{'stall s':>9}{'stall':>10}{'failures':>10}{'lost':>10}"
        f"{'per drive/d':>12}{'endurance':>10}",
    ]
    lines.append(_row(a, "every step", a.every_step))
    lines.append(_row(a, "recommended", a.best))
    if a.current is not None:
        lines.append(_row(a, "current setting", a.current))
    if a.wear_fit is not None and a.until is not None:
        lines.append(_row(a, f"lasts to {a.until.isoformat()}", a.wear_fit))
    lines += [
        "  (stall: share of wall time the loop waits for saves; failures: share lost to restarts and",
        "   redone work; lost: both; per drive/d: bytes each drive takes per day; lasts to: the",
        "   shortest interval whose writes leave the drives' endurance until that date)",
    ]
    if a.observed_bytes_per_day is not None:
        lines.append(f"  observed in the wear log: {_bytes(a.observed_bytes_per_day)} per day, all drives together")
        recent = list(a.observed_daily.items())[-7:]
        lines.append("  written per UTC day: " + ", ".join(f"{day} {_bytes(n)}" for day, n in recent))
    if a.devices:
        lines += ["", "what 'durable' means here (from sysfs and the mount table)"]
        for d in a.devices:
            cache = d.write_cache or "unknown"
            fua = {True: "FUA", False: "no FUA", None: "FUA unknown"}[d.fua]
            lines.append(f"  {d.path}: {d.fs_type} on {d.device or '-'} ({cache}, {fua})")
            lines.append(f"    {d.durability}")
    if a.warnings:
        lines += ["", "warnings"]
        lines += [f"  ! {w}" for w in a.warnings]
    return "\n".join(lines)


@dataclass(frozen=True)
class Advice:
    """What :func:`advise` concludes, with every input it used.

    Attributes:
        costs: the per-save costs used (see :class:`~fastpersist.advisor.model.Costs`).
        mtbf_s: the job's mean time between failures used.
        where: for each input, what was measured or that it was given or assumed.
        young_s, daly_s: the optimal compute time between saves (Young; Daly's higher order).
        every_step: the outcome of checkpointing every step.
        best: the outcome at the recommended interval.
        current: the outcome at the caller's current ``every``, if known.
        drives: drives one checkpoint is spread over (wear is per drive).
        endurance: one drive's rated endurance, if known.
        until: the date the drives must last to, if given.
        wear_fit: the shortest interval whose wear lets the drives last until `until` (with `endurance`).
        observed_bytes_per_day: the write rate in the source's wear log, all drives together.
        observed_daily: bytes written per UTC day (``YYYY-MM-DD``) in that log, all targets together.
        devices: what "durable" means on each target directory.
        warnings: what the caller should know, in words.
    """

    costs: Costs
    mtbf_s: float
    where: dict[str, str]
    young_s: float
    daly_s: float
    every_step: Outcome
    best: Outcome
    current: Outcome | None
    drives: int
    endurance: Endurance | None
    until: datetime.date | None
    wear_fit: Outcome | None
    observed_bytes_per_day: float | None
    observed_daily: dict[str, int] = field(default_factory=dict)
    devices: list[DeviceInfo] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def bytes_per_drive_day(self, o: Outcome) -> float:
        """Bytes each drive takes per day at `o`'s interval."""
        return o.bytes_per_day / self.drives

    def endurance_days(self, o: Outcome) -> float | None:
        """Days until a drive's remaining endurance is used up at `o`'s interval (None: unknown)."""
        return None if self.endurance is None else days_of_endurance(self.endurance, self.bytes_per_drive_day(o))

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``fastpersist advise --json``)."""

        def row(o: Outcome | None) -> dict[str, Any] | None:
            if o is None:
                return None
            days = self.endurance_days(o)
            return {
                **dataclasses.asdict(o),
                "bytes_per_drive_day": self.bytes_per_drive_day(o),
                "endurance_days": None if days is None or math.isinf(days) else days,
            }

        return {
            "costs": dataclasses.asdict(self.costs),
            "mtbf_s": self.mtbf_s,
            "where": self.where,
            "young_s": self.young_s,
            "daly_s": self.daly_s,
            "every_step": row(self.every_step),
            "best": row(self.best),
            "current": row(self.current),
            "wear_fit": row(self.wear_fit),
            "drives": self.drives,
            "endurance": None if self.endurance is None else dataclasses.asdict(self.endurance),
            "until": None if self.until is None else self.until.isoformat(),
            "observed_bytes_per_day": self.observed_bytes_per_day,
            "observed_daily": self.observed_daily,
            "devices": [d.to_json() for d in self.devices],
            "warnings": self.warnings,
        }

    def __str__(self) -> str:
        return format_advice(self)
