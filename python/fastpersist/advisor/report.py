"""The text table ``fastpersist advise`` prints (``str(advice)``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .model import Outcome

if TYPE_CHECKING:
    from .advise import Advice

__all__ = ["format_advice"]


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
    """The human-readable report of an :class:`~fastpersist.advisor.advise.Advice`."""
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
