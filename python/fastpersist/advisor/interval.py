"""``fastpersist.advise``: the checkpoint interval from measured costs, a failure rate and drive wear."""

from __future__ import annotations

import datetime
import math
import os

from .advice import Advice
from .devinfo import DeviceInfo, device_info
from .model import Costs, Outcome, best_every, daly_interval_s, job_mtbf_s, outcome, young_interval_s
from .sources import Measured, from_bench, from_history, from_root
from .wear import Endurance, bytes_per_day_allowed

__all__ = ["advise"]


def _measured(source: object) -> Measured:
    if source is None:
        return Measured()
    if isinstance(source, Measured):
        return source
    history = getattr(source, "history", None)
    if history is not None and hasattr(history, "costs"):  # a Checkpointer
        measured = from_history(history, f"Checkpointer({getattr(source, 'root', '?')!r})")
        measured.dirs = measured.dirs or [str(getattr(source, "root", ""))]
        return measured
    if isinstance(source, (str, os.PathLike)):
        return from_root(source) if os.path.isdir(source) else from_bench(source)
    raise TypeError(f"advise(source={source!r}): expected a Checkpointer, a checkpoint root or a bench JSON path")


def _pick(name: str, given: float | None, measured: Measured, where: dict[str, str], hint: str) -> float:
    if given is not None:
        where[name] = "given"
        return float(given)
    value = getattr(measured, name)
    if value is None:
        raise ValueError(f"advise: no {name} measured in the source; pass {hint}")
    where[name] = measured.where.get(name, "measured")
    return float(value)


def _restart(restart_s: float | None, overhead_s: float | None, measured: Measured, where: dict[str, str]) -> float:
    """The whole restart if given, else the measured load plus the relaunch overhead."""
    if restart_s is not None:
        where["restart_s"] = "given"
        return float(restart_s)
    overhead = overhead_s if overhead_s is not None else measured.restart_overhead_s or 0.0
    load_where = measured.where.get("load_s", "load not measured: 0")
    where["restart_s"] = f"{load_where} + {overhead:g} s relaunch overhead (given)"
    return (measured.load_s or 0.0) + overhead


def _failure_model(
    mtbf_s: float | None, node_mtbf_s: float | None, nodes: int, measured: Measured, where: dict[str, str]
) -> float:
    if mtbf_s is not None and node_mtbf_s is not None:
        raise ValueError("advise: pass mtbf_s= (the job's) or node_mtbf_s= with nodes=, not both")
    if node_mtbf_s is not None:
        where["mtbf_s"] = f"given: node MTBF {node_mtbf_s / 3600:g} h / {nodes} node(s), failing independently"
        return job_mtbf_s(node_mtbf_s, nodes)
    if mtbf_s is None and measured.mtbf_s is not None:
        where["mtbf_s"] = "the Checkpointer's mtbf_s"
        return measured.mtbf_s
    if mtbf_s is None:
        raise ValueError("advise: needs a failure model: mtbf_s= (the job's MTBF) or node_mtbf_s= and nodes=")
    where["mtbf_s"] = "given: the job's MTBF"
    return job_mtbf_s(mtbf_s, 1)


def _wear_fit(costs: Costs, mtbf_s: float, drives: int, allowed_per_drive_day: float) -> Outcome:
    """The shortest interval whose writes per drive per day stay within `allowed_per_drive_day`."""
    per_drive_save = costs.nbytes / drives
    min_period = 86_400.0 * per_drive_save / allowed_per_drive_day
    every = max(1, math.ceil((min_period - costs.stall_s) / costs.step_s))
    while outcome(every, costs, mtbf_s).bytes_per_day / drives > allowed_per_drive_day:
        every += 1
    return outcome(every, costs, mtbf_s)


def _warnings(advice: Advice) -> list[str]:
    out: list[str] = []
    c, m = advice.costs, advice.mtbf_s
    if c.stall_s >= m:
        out.append(
            f"a save stalls the loop {c.stall_s:g} s, not less than the MTBF ({m:g} s): the job would spend "
            "its time saving and redoing work. Shorten the stall (snapshot mode, more drives) or the job."
        )
    elif advice.best.period_s + c.restart_s + c.write_s > 0.1 * m:
        out.append(
            "the interval, restart and write are not small against the MTBF: the first-order model "
            "underestimates the loss; treat the numbers as a lower bound"
        )
    if advice.best.lost_fraction >= 1.0:
        out.append("no interval lets the job make progress at this failure rate (expected loss >= 100%)")
    cur = advice.current
    if cur is not None and cur.stall_s > c.stall_s + 1e-9:
        out.append(
            f"at the current every={cur.every} the loop also waits {cur.stall_s - c.stall_s:.3f} s per save for the "
            f"previous save to commit (write {c.write_s:.3f} s > {cur.compute_s + c.stall_s:.3f} s between saves)"
        )
    fit = advice.wear_fit
    for name, o in (("recommended", advice.best), ("current", cur)):
        if fit is not None and advice.until is not None and o is not None and o.every < fit.every:
            out.append(
                f"at the {name} every={o.every} the drives' endurance runs out in {advice.endurance_days(o):.0f} "
                f"days, before {advice.until.isoformat()}; every={fit.every} ({fit.period_s:.0f} s) or more fits"
            )
    for dev in advice.devices:
        if "NOT" in dev.durability or "memory" in dev.durability:
            out.append(f"{dev.path}: {dev.durability}")
    return out


def advise(
    source: object = None,
    *,
    mtbf_s: float | None = None,
    node_mtbf_s: float | None = None,
    nodes: int = 1,
    step_s: float | None = None,
    stall_s: float | None = None,
    write_s: float | None = None,
    restart_s: float | None = None,
    restart_overhead_s: float | None = None,
    nbytes: int | None = None,
    every: int | None = None,
    drives: int | None = None,
    endurance: Endurance | None = None,
    until: datetime.date | None = None,
    today: datetime.date | None = None,
    probe_devices: bool = True,
) -> Advice:
    """Recommends how many steps to leave between checkpoints, and says what it costs.

    Numbers come from `source` (a :class:`~fastpersist.Checkpointer`, a checkpoint root holding
    ``history.json``, or a ``fastpersist bench`` JSON file); a keyword given here overrides the
    measured value. The failure model is ``mtbf_s`` (the job's) or ``node_mtbf_s`` and ``nodes``.
    ``restart_s`` is the whole restart; otherwise it is the measured load plus ``restart_overhead_s``.
    Wear is per drive: one checkpoint's bytes are spread over ``drives`` drives (default: the
    source's directories). See docs/advisor.md for the model and its assumptions.

    Example:
        >>> a = fp.advise("bench.json", node_mtbf_s=6000 * 3600, nodes=16, step_s=6.0)   # doctest: +SKIP
        >>> a.best.every, f"{a.best.lost_fraction:.2%}", f"{a.every_step.lost_fraction:.2%}"   # doctest: +SKIP
        >>> print(a)                                                                       # doctest: +SKIP
    """
    measured = _measured(source)
    where: dict[str, str] = {}
    job_mtbf = _failure_model(mtbf_s, node_mtbf_s, nodes, measured, where)
    hint = {"step_s": "step_s= (--step-seconds)", "stall_s": "stall_s= (--stall-seconds)"}
    step = _pick("step_s", step_s, measured, where, hint["step_s"])
    stall = _pick("stall_s", stall_s, measured, where, hint["stall_s"])
    write = _pick("write_s", write_s, measured, where, "write_s= (--write-seconds)")
    size = int(_pick("nbytes", nbytes, measured, where, "nbytes= (--bytes)"))
    costs = Costs(stall, write, step, _restart(restart_s, restart_overhead_s, measured, where), size)
    current_every = every if every is not None else measured.every
    drive_count = drives if drives is not None else max(1, len(measured.dirs))
    where["drives"] = "given" if drives is not None else f"the source's directories ({drive_count})"
    best = outcome(best_every(costs, job_mtbf), costs, job_mtbf)
    wear_fit = None
    if endurance is not None and until is not None:
        allowed = bytes_per_day_allowed(endurance, until, today or datetime.date.today())
        wear_fit = _wear_fit(costs, job_mtbf, drive_count, allowed)
    devices: list[DeviceInfo] = []
    if probe_devices:
        for d in measured.dirs:
            if os.path.exists(d):
                devices.append(device_info(d))
    observed = measured.wear.bytes_per_day() if measured.wear and measured.wear.total_bytes() else None
    advice = Advice(
        costs=costs,
        mtbf_s=job_mtbf,
        where=where,
        young_s=young_interval_s(stall, job_mtbf),
        daly_s=daly_interval_s(stall, job_mtbf),
        every_step=outcome(1, costs, job_mtbf),
        best=best,
        current=outcome(current_every, costs, job_mtbf) if current_every else None,
        drives=drive_count,
        endurance=endurance,
        until=until,
        wear_fit=wear_fit,
        observed_bytes_per_day=observed,
        observed_daily=measured.wear.daily() if measured.wear else {},
        devices=devices,
    )
    advice.warnings.extend(_warnings(advice))
    return advice
