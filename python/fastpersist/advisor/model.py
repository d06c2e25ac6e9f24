"""The checkpoint-interval model: pure arithmetic on measured costs and an assumed failure rate.

No I/O and no clocks here; docs/advisor.md derives every formula. In short, with

* ``δ`` (``stall_s``): seconds the training loop waits per save, not counting any wait for the
  previous save's commit (that part is computed, see below);
* ``W`` (``write_s``): seconds from the start of a save until it is durable and committed;
* ``R`` (``restart_s``): seconds from a failure until training runs again (load + relaunch);
* ``T`` (``step_s``): seconds of one training step without checkpointing;
* ``M`` (``mtbf_s``): the job's mean time between failures (failures are a Poisson process);

a checkpoint every ``k`` steps means ``τ = k·T`` seconds of training between saves and a period
``P = max(τ + δ, W)`` between save starts (``ck.save`` waits for the previous save to commit, so
a write longer than ``τ + δ`` blocks the loop for the difference). A failure strikes at a uniform
moment of a period and loses the restart plus the work since the newest *committed* checkpoint,
on average ``R + P/2 + W``. The expected fraction of wall time lost is then, to first order in
``P/M``::

    lost(k) = (P - τ)/P  +  (R + P/2 + W)/M

whose minimum over ``P`` is Young's ``P = sqrt(2·δ·M)``; we use Daly's higher-order optimum for
``τ`` (and ``τ = M`` once ``δ >= 2M``), raise it to ``W - δ`` so the loop never waits for a
commit, and pick the whole number of steps around it with the smaller ``lost(k)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

__all__ = [
    "CostOverrides",
    "Costs",
    "Outcome",
    "best_every",
    "daly_interval_s",
    "job_mtbf_s",
    "outcome",
    "young_interval_s",
]

SECONDS_PER_DAY = 86_400.0


@dataclass(frozen=True)
class Costs:
    """What one checkpoint costs the job, as measured (see the module docstring for the symbols).

    Attributes:
        stall_s: ``δ``, seconds the loop waits per save, excluding the wait for the previous commit.
        write_s: ``W``, seconds from a save's start until it is committed (durable).
        step_s: ``T``, seconds of one training step without checkpoint waits.
        restart_s: ``R``, seconds from a failure until training runs again.
        nbytes: bytes one checkpoint writes, all drives together.

    Example:
        >>> Costs(stall_s=0.05, write_s=0.6, step_s=1.0, restart_s=30.0, nbytes=1 << 30).stall_s
        0.05
    """

    stall_s: float
    write_s: float
    step_s: float
    restart_s: float = 0.0
    nbytes: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_cost("Costs", f.name, getattr(self, f.name))


@dataclass(frozen=True)
class CostOverrides:
    """Costs you know, given to :func:`~fastpersist.advise` over what its source measured.

    Each field left None takes the source's measured value (a bench report measures no training
    step: give ``step_s``); the values follow the rules of :class:`Costs`, checked here.

    Attributes:
        step_s: ``T``, seconds of one training step without checkpoint waits.
        stall_s: ``δ``, seconds the loop waits per save, excluding the wait for the previous commit.
        write_s: ``W``, seconds from a save's start until it is committed (durable).
        restart_s: ``R``, the whole restart, from a failure until training runs again; when None,
            the measured load plus `restart_overhead_s`.
        restart_overhead_s: seconds of relaunch added to the measured load (None: the source's,
            else 0); not used when `restart_s` is given.
        nbytes: bytes one checkpoint writes, all drives together.

    Example:
        >>> CostOverrides(step_s=6.0, restart_overhead_s=120.0).step_s
        6.0
        >>> CostOverrides(step_s=0.0)
        Traceback (most recent call last):
        ValueError: CostOverrides.step_s=0.0: expected a positive number of seconds (one training step)
    """

    step_s: float | None = None
    stall_s: float | None = None
    write_s: float | None = None
    restart_s: float | None = None
    restart_overhead_s: float | None = None
    nbytes: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            if (value := getattr(self, f.name)) is not None:
                _check_cost("CostOverrides", f.name, value)


def _check_cost(owner: str, name: str, value: object) -> None:
    """Raises ValueError, naming ``owner.name``, unless `value` is a valid `name` (a field of
    :class:`Costs` or :class:`CostOverrides`): seconds finite and >= 0, a step > 0, bytes a whole number >= 0."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    seconds = float(value) if isinstance(value, (int, float)) and number else math.nan
    if name == "nbytes":
        ok, expected = type(value) is int and value >= 0, "a non-negative integer"
    elif name == "step_s":
        ok, expected = math.isfinite(seconds) and seconds > 0, "a positive number of seconds (one training step)"
    else:
        ok, expected = math.isfinite(seconds) and seconds >= 0, "a finite number of seconds >= 0"
    if not ok:
        raise ValueError(f"{owner}.{name}={value!r}: expected {expected}")


@dataclass(frozen=True)
class Outcome:
    """The expected cost of checkpointing every `every` steps.

    Attributes:
        every: steps between checkpoints.
        compute_s: ``τ``, seconds of training between two saves.
        period_s: ``P``, wall seconds between two save starts.
        stall_s: seconds the loop waits per save at this interval (``δ`` plus any commit wait).
        stall_fraction: ``stall_s / P``, the share of wall time spent waiting for saves.
        failure_fraction: ``(R + P/2 + W) / M``, the share of wall time lost to failures.
        lost_fraction: their sum, capped at 1 (at 1 the job is not expected to make progress).
        saves_per_day: ``86400 / P``.
        bytes_per_day: ``saves_per_day · nbytes``, all drives together.
    """

    every: int
    compute_s: float
    period_s: float
    stall_s: float
    stall_fraction: float
    failure_fraction: float
    lost_fraction: float
    saves_per_day: float
    bytes_per_day: float


def _check_mtbf(mtbf_s: float) -> None:
    if not (isinstance(mtbf_s, (int, float)) and math.isfinite(mtbf_s) and mtbf_s > 0):
        raise ValueError(f"mtbf_s={mtbf_s!r}: expected a positive, finite number of seconds")


def job_mtbf_s(node_mtbf_s: float, nodes: int = 1) -> float:
    """The job's MTBF when any of `nodes` independent nodes (each with MTBF `node_mtbf_s`) can stop it.

    Example:
        >>> job_mtbf_s(1000.0 * 3600, nodes=16) / 3600
        62.5
    """
    _check_mtbf(node_mtbf_s)
    if type(nodes) is not int or nodes < 1:
        raise ValueError(f"nodes={nodes!r}: expected an integer >= 1")
    return node_mtbf_s / nodes


def young_interval_s(stall_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum ``sqrt(2·δ·M)`` (Young 1974); valid while ``δ ≪ M``.

    Example:
        >>> young_interval_s(2.0, 3600.0)
        120.0
    """
    _check_mtbf(mtbf_s)
    return math.sqrt(2.0 * max(stall_s, 0.0) * mtbf_s)


def daly_interval_s(stall_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum of the compute time between checkpoints (Daly 2006).

    ``sqrt(2δM)·(1 + x/3 + x²/9) - δ`` with ``x = sqrt(δ/(2M))`` while ``δ < 2M``, else ``M``.
    Zero stall gives 0 (checkpoint as often as the loop allows).

    Example:
        >>> round(daly_interval_s(2.0, 3600.0), 3)
        118.67
    """
    _check_mtbf(mtbf_s)
    delta = max(stall_s, 0.0)
    if delta >= 2.0 * mtbf_s:
        return mtbf_s
    x = math.sqrt(delta / (2.0 * mtbf_s))
    return max(0.0, math.sqrt(2.0 * delta * mtbf_s) * (1.0 + x / 3.0 + x * x / 9.0) - delta)


def outcome(every: int, costs: Costs, mtbf_s: float) -> Outcome:
    """The expected stall, failure loss and write volume of checkpointing every `every` steps.

    Example:
        >>> c = Costs(stall_s=1.0, write_s=1.0, step_s=1.0, restart_s=0.0)
        >>> o = outcome(9, c, mtbf_s=100.0)   # P = 10 s: 1/10 stalled + (10/2 + 1)/100 lost
        >>> round(o.stall_fraction, 3), round(o.failure_fraction, 3)
        (0.1, 0.06)
    """
    _check_mtbf(mtbf_s)
    if type(every) is not int or every < 1:
        raise ValueError(f"every={every!r}: expected an integer >= 1")
    compute = every * costs.step_s
    period = max(compute + costs.stall_s, costs.write_s)
    stall = period - compute
    stall_fraction = stall / period if period > 0 else 0.0
    failure_fraction = (costs.restart_s + period / 2.0 + costs.write_s) / mtbf_s
    saves_per_day = SECONDS_PER_DAY / period
    return Outcome(
        every=every,
        compute_s=compute,
        period_s=period,
        stall_s=stall,
        stall_fraction=stall_fraction,
        failure_fraction=failure_fraction,
        lost_fraction=min(1.0, stall_fraction + failure_fraction),
        saves_per_day=saves_per_day,
        bytes_per_day=saves_per_day * costs.nbytes,
    )


def optimum_compute_s(costs: Costs, mtbf_s: float) -> float:
    """Daly's optimum raised to ``W - δ`` (below it the loop would wait for every commit)."""
    return max(daly_interval_s(costs.stall_s, mtbf_s), costs.write_s - costs.stall_s, 0.0)


def best_every(costs: Costs, mtbf_s: float, *, max_every: int | None = None) -> int:
    """The whole number of steps between checkpoints with the least expected lost time.

    Takes the two whole numbers around :func:`optimum_compute_s` / ``step_s`` (at least 1, at
    most `max_every`) and returns the one whose :func:`outcome` loses less (the smaller on a tie).

    Example:
        >>> best_every(Costs(stall_s=2.0, write_s=2.0, step_s=10.0), mtbf_s=3600.0)
        12
        >>> best_every(Costs(stall_s=0.0, write_s=0.5, step_s=1.0), mtbf_s=3600.0)   # free saves
        1
    """
    if max_every is not None and (type(max_every) is not int or max_every < 1):
        raise ValueError(f"max_every={max_every!r}: expected an integer >= 1")
    steps = optimum_compute_s(costs, mtbf_s) / costs.step_s
    low = max(1, math.floor(steps))
    high = max(1, math.ceil(steps))
    if max_every is not None:
        low, high = min(low, max_every), min(high, max_every)
    if low == high:
        return low
    return min((low, high), key=lambda k: (outcome(k, costs, mtbf_s).lost_fraction, k))
