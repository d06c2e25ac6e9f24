"""``fastpersist.advise``: the checkpoint interval from measured costs, a failure rate and drive wear."""

from __future__ import annotations

import datetime
import math
import os
from typing import Any

from .advice import Advice
from .devinfo import DeviceInfo, device_info
from .model import CostOverrides, Costs, Outcome, best_every, daly_interval_s, outcome, young_interval_s
from .multilevel import Failures
from .sources import Measured, from_bench, from_history, from_root
from .wear import Wear, bytes_per_day_allowed

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


#: The keywords advise took before its nouns: keyword -> (parameter, noun, field).
_MOVED = {
    "mtbf_s": ("failures", "Failures", "process_mtbf_s"),
    "node_mtbf_s": ("failures", "Failures", "node_mtbf_s"),
    "nodes": ("failures", "Failures", "nodes"),
    **{k: ("costs", "CostOverrides", k) for k in ("step_s", "stall_s", "write_s", "restart_s", "restart_overhead_s")},
    "nbytes": ("costs", "CostOverrides", "nbytes"),
    **{k: ("wear", "Wear", k) for k in ("drives", "endurance", "until", "today")},
}
_FLAGS = {
    "step_s": "--step-seconds",
    "stall_s": "--stall-seconds",
    "write_s": "--write-seconds",
    "nbytes": "--bytes",
}


def _moved_keywords_error(old: dict[str, Any]) -> TypeError:
    """The error for advise keywords that moved into nouns, showing the call's new form; any other
    unknown keyword is named as Python names it."""
    unknown = [k for k in old if k not in _MOVED]
    if unknown:
        return TypeError(f"advise() got an unexpected keyword argument {unknown[0]!r}")
    nouns: dict[str, tuple[str, list[str]]] = {}
    for param in ("failures", "costs", "wear"):
        for k, v in old.items():
            if _MOVED[k][0] == param:
                nouns.setdefault(param, (_MOVED[k][1], []))[1].append(f"{_MOVED[k][2]}={v!r}")
    new = ", ".join(f"{param}=fastpersist.{noun}({', '.join(args)})" for param, (noun, args) in nouns.items())
    given = ", ".join(f"{k}={v!r}" for k, v in old.items())
    return TypeError(f"advise({given}): these keywords became objects; write fastpersist.advise(..., {new})")


def _check_nouns(**nouns: tuple[object, type]) -> None:
    for name, (value, noun) in nouns.items():
        if value is not None and not isinstance(value, noun):
            raise TypeError(f"advise({name}={value!r}): expected a fastpersist.{noun.__name__} or None")


def _pick(name: str, given: float | None, measured: Measured, where: dict[str, str]) -> float:
    if given is not None:
        where[name] = "given"
        return float(given)
    value = getattr(measured, name)
    if value is None:
        raise ValueError(
            f"advise: no {name} measured in the source; pass costs=fastpersist.CostOverrides({name}=...) "
            f"({_FLAGS[name]})"
        )
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


def _costs(given: CostOverrides, measured: Measured, where: dict[str, str]) -> Costs:
    step = _pick("step_s", given.step_s, measured, where)
    stall = _pick("stall_s", given.stall_s, measured, where)
    write = _pick("write_s", given.write_s, measured, where)
    size = int(_pick("nbytes", given.nbytes, measured, where))
    return Costs(stall, write, step, _restart(given.restart_s, given.restart_overhead_s, measured, where), size)


def _failure_model(failures: Failures | None, measured: Measured, where: dict[str, str]) -> float:
    """The job's MTBF: from `failures` (every class of failure stops the job), else the Checkpointer's."""
    if failures is None and measured.mtbf_s is not None:
        where["mtbf_s"] = "the Checkpointer's mtbf_s"
        return measured.mtbf_s
    job_mtbf = failures.job_mtbf_s() if failures is not None else None
    if failures is None or job_mtbf is None:
        raise ValueError(
            f"advise{f'(failures={failures})' if failures is not None else ''}: needs a failure model: failures="
            "fastpersist.Failures(process_mtbf_s=...) (the job's MTBF) or Failures(node_mtbf_s=..., nodes=...)"
        )
    process, node, cluster = failures.process_mtbf_s, failures.node_mtbf_s, failures.cluster_mtbf_s
    parts = [f"process MTBF {process / 3600:g} h"] if process is not None else []
    parts += [f"node MTBF {node / 3600:g} h / {failures.nodes} node(s)"] if node is not None else []
    parts += [f"cluster MTBF {cluster / 3600:g} h"] if cluster is not None else []
    if node is None and cluster is None:  # process_mtbf_s alone: what was advise(mtbf_s=)
        where["mtbf_s"] = "given: the job's MTBF"
    elif process is None and cluster is None:
        where["mtbf_s"] = f"given: {parts[0]}, failing independently"
    else:
        where["mtbf_s"] = f"given: {', '.join(parts)}{', any of them stops the job' if len(parts) > 1 else ''}"
    return job_mtbf


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
    failures: Failures | None = None,
    costs: CostOverrides | None = None,
    wear: Wear | None = None,
    every: int | None = None,
    probe_devices: bool = True,
    **moved: Any,
) -> Advice:
    """Recommends how many steps to leave between checkpoints, and says what it costs.

    Numbers come from `source` (a :class:`~fastpersist.Checkpointer`, a checkpoint root holding
    ``history.json``, or a ``fastpersist bench`` JSON file); a field given in `costs` overrides
    the measured value. The failure model is `failures`, else the one the Checkpointer was given;
    every class of failure it names stops the job (``process_mtbf_s`` alone: the job's MTBF;
    ``node_mtbf_s`` with ``nodes``: node MTBF / nodes). `wear` says how many drives one
    checkpoint is spread over (default: the source's directories), their endurance and the day
    they must last to. `every` is the current interval, shown for comparison (default: the
    source's). See docs/advisor.md for the model and its assumptions.

    Example:
        >>> a = fp.advise("bench.json", failures=fp.Failures(node_mtbf_s=6000 * 3600, nodes=16),  # doctest: +SKIP
        ...               costs=fp.CostOverrides(step_s=6.0))
        >>> a.best.every, f"{a.best.lost_fraction:.2%}", f"{a.every_step.lost_fraction:.2%}"   # doctest: +SKIP
        >>> print(a)                                                                       # doctest: +SKIP
    """
    if moved:
        raise _moved_keywords_error(moved)
    _check_nouns(failures=(failures, Failures), costs=(costs, CostOverrides), wear=(wear, Wear))
    wear = wear if wear is not None else Wear()
    measured = _measured(source)
    where: dict[str, str] = {}
    job_mtbf = _failure_model(failures, measured, where)
    resolved = _costs(costs if costs is not None else CostOverrides(), measured, where)
    current_every = every if every is not None else measured.every
    drive_count = wear.drives if wear.drives is not None else max(1, len(measured.dirs))
    where["drives"] = "given" if wear.drives is not None else f"the source's directories ({drive_count})"
    best = outcome(best_every(resolved, job_mtbf), resolved, job_mtbf)
    wear_fit = None
    if wear.endurance is not None and wear.until is not None:
        allowed = bytes_per_day_allowed(wear.endurance, wear.until, wear.today or datetime.date.today())
        wear_fit = _wear_fit(resolved, job_mtbf, drive_count, allowed)
    devices: list[DeviceInfo] = []
    if probe_devices:
        for d in measured.dirs:
            if os.path.exists(d):
                devices.append(device_info(d))
    observed = measured.wear.bytes_per_day() if measured.wear and measured.wear.total_bytes() else None
    advice = Advice(
        costs=resolved,
        mtbf_s=job_mtbf,
        where=where,
        young_s=young_interval_s(resolved.stall_s, job_mtbf),
        daly_s=daly_interval_s(resolved.stall_s, job_mtbf),
        every_step=outcome(1, resolved, job_mtbf),
        best=best,
        current=outcome(current_every, resolved, job_mtbf) if current_every else None,
        drives=drive_count,
        endurance=wear.endurance,
        until=wear.until,
        wear_fit=wear_fit,
        observed_bytes_per_day=observed,
        observed_daily=measured.wear.daily() if measured.wear else {},
        devices=devices,
    )
    advice.warnings.extend(_warnings(advice))
    return advice
