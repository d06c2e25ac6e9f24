"""Multi-level interval advice: ``every``, ``replicas`` and ``remote_every`` chosen together.

The multi-level extension of Young/Daly (as in Moody et al., SC'10, for SCR, and Di et al.,
2014): each class of failure is survived by the cheapest level that holds a copy, and each
level's interval is set against the failures only it covers. Three classes, as Poisson
processes with their mean times between failures:

* a **process crash** (``process_mtbf_s``): the local level survives it (``/dev/shm`` or NVMe);
* a **node loss** (``node_mtbf_s`` per node, times ``nodes``): survived by the partner level when
  ``replicas >= 1``, else only by the remote level;
* the loss of several nodes or of the cluster (``cluster_mtbf_s``): only the remote level.

Costs, per save (measured by a Checkpointer or given): ``δ`` (``stall_s``, the loop's wait),
``W`` (``write_s``, until committed), ``Wr`` (``replicate_s``, the partner copies' extra time
before a step counts), ``D`` (``drain_s``, one drain to the remote, in the background), ``Cd``
(``drain_overhead_s``, training time one drain costs through contention), the restarts ``R``
(from local or partner) and ``Rr`` (from the remote). Every save is a partner save when
``replicas >= 1``, so the local and partner levels share the interval ``P`` (seconds between
save starts); the remote level drains every ``n``-th saved step, a period ``Pr = n·P`` that is
never shorter than ``D``. ``remote_every`` is given in steps, as ``Checkpointer`` takes it:
``n·every``. The expected fraction of wall time lost::

    lost = δ/P + Cd/Pr + λ_local·(R + P/2 + W') + λ_remote·(Rr + Pr/2 + D)

with ``W' = W + replicas·Wr``, ``λ_local`` the rate of the failures the last save
survives and ``λ_remote`` that of the rest. ``P`` takes Daly's optimum for ``δ`` against
``λ_local``; ``Pr`` Young's ``sqrt(2·Cd/λ_remote)`` raised to ``D``; each is rounded to whole
steps around the optimum, keeping the better. Every candidate ``replicas`` (0, 1, ... up to
``nodes - 1``, at most 2) is evaluated and the least lost time wins.

Example:
    >>> f = Failures(process_mtbf_s=7 * 86400, node_mtbf_s=30 * 86400, nodes=16, cluster_mtbf_s=90 * 86400)
    >>> c = LevelCosts(step_s=1.0, stall_s=0.05, write_s=0.6, replicate_s=0.4, drain_s=30.0, drain_overhead_s=1.0,
    ...                restart_s=60.0, remote_restart_s=300.0)
    >>> a = advise_levels(c, f)
    >>> a.best.replicas, a.best.every, a.best.remote_every
    (1, 113, 3955)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .model import daly_interval_s, job_mtbf_s

__all__ = [
    "Failures",
    "LevelAdvice",
    "LevelCosts",
    "LevelPlan",
    "advise_levels",
    "best_remote_every",
    "local_mtbf_s",
    "plan_lost",
]


def _positive(name: str, value: float, *, zero: bool = True) -> None:
    ok = isinstance(value, (int, float)) and math.isfinite(value) and (value >= 0 if zero else value > 0)
    if not ok:
        raise ValueError(f"{name}={value!r}: expected a finite number {'>= 0' if zero else '> 0'}")


@dataclass(frozen=True)
class Failures:
    """The failure model: mean times between failures of each class, in seconds (None: never)."""

    process_mtbf_s: float | None = None
    node_mtbf_s: float | None = None
    nodes: int = 1
    cluster_mtbf_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("process_mtbf_s", "node_mtbf_s", "cluster_mtbf_s"):
            value = getattr(self, name)
            if value is not None:
                _positive(f"Failures.{name}", value, zero=False)
        if type(self.nodes) is not int or self.nodes < 1:
            raise ValueError(f"Failures.nodes={self.nodes!r}: expected an integer >= 1")

    def rates(self) -> tuple[float, float, float]:
        """Failures per second: (process crashes, node losses of the job, cluster losses)."""

        def rate(mtbf: float | None, count: int = 1) -> float:
            return count / mtbf if mtbf else 0.0

        return rate(self.process_mtbf_s), rate(self.node_mtbf_s, self.nodes), rate(self.cluster_mtbf_s)

    def job_mtbf_s(self) -> float | None:
        """The mean time between failures of any class (None: no class given), as
        :func:`~fastpersist.advise` takes it: every failure stops a job with one level. With one
        class given, its MTBF (node losses: ``node_mtbf_s / nodes``); with several, one over the
        sum of their rates."""
        classes = ((self.process_mtbf_s, 1), (self.node_mtbf_s, self.nodes), (self.cluster_mtbf_s, 1))
        given = [(mtbf, count) for mtbf, count in classes if mtbf is not None]
        if len(given) == 1:
            return job_mtbf_s(*given[0])
        return 1.0 / sum(self.rates()) if given else None

    def split(self, replicas: int) -> tuple[float, float]:
        """Failures per second that the local (and partner) level survives, and those only the
        remote level does: a node loss is the partner level's with ``replicas >= 1``."""
        crash, node, cluster = self.rates()
        return crash + (node if replicas else 0.0), cluster + (0.0 if replicas else node)

    def local_mtbf_s(self, replicas: int) -> float | None:
        """The mean time between the failures the local level survives (None: there are none);
        ``every="auto"`` sets ``every`` against these."""
        local, _ = self.split(replicas)
        return 1.0 / local if local > 0 else None


def local_mtbf_s(failures: Failures | None, replicas: int, *, auto: bool) -> float | None:
    """The MTBF a Checkpointer's ``every="auto"`` sets `every` against: from `failures`, the failures
    the local (and, with replicas, partner) level survives; None without `failures`."""
    if failures is not None and not isinstance(failures, Failures):
        raise TypeError(f"failures={failures!r}: expected a fastpersist.Failures")
    if failures is None:
        if auto:
            raise ValueError(
                'every="auto" needs failures=, the failure model (e.g. fastpersist.Failures(process_mtbf_s=24 * 3600), '
                "the mean time between the job's failures in seconds)"
            )
        return None
    local = failures.local_mtbf_s(replicas)
    if local is None and auto:
        raise ValueError(
            f'every="auto" with {failures}: no failure the local level survives (process crashes, or node '
            "losses with replicas >= 1), so there is no interval to choose; pass every= an integer"
        )
    return local


@dataclass(frozen=True)
class LevelCosts:
    """Per-save costs in seconds (see the module docstring for the symbols)."""

    step_s: float
    stall_s: float
    write_s: float
    replicate_s: float = 0.0
    drain_s: float = 0.0
    drain_overhead_s: float = 0.0
    restart_s: float = 0.0
    remote_restart_s: float = 0.0

    def __post_init__(self) -> None:
        _positive("step_s", self.step_s, zero=False)
        for name in (
            "stall_s",
            "write_s",
            "replicate_s",
            "drain_s",
            "drain_overhead_s",
            "restart_s",
            "remote_restart_s",
        ):
            _positive(name, getattr(self, name))


@dataclass(frozen=True)
class LevelPlan:
    """One setting and its expected cost: fractions of wall time."""

    replicas: int
    every: int
    remote_every: int | None
    period_s: float
    remote_period_s: float | None
    stall_fraction: float
    drain_fraction: float
    failure_fraction: float
    lost_fraction: float


def plan_lost(replicas: int, every: int, remote_every: int | None, c: LevelCosts, f: Failures) -> LevelPlan:
    """The expected lost time of one setting (``remote_every``: steps between drains, a drain at
    the first save that crosses a multiple of it; None: no remote level)."""
    local_rate, remote_rate = f.split(replicas)
    write = c.write_s + c.replicate_s * replicas
    period = max(every * c.step_s + c.stall_s, write)
    stall = (period - every * c.step_s) / period
    failure = local_rate * (c.restart_s + period / 2 + write)
    drain = 0.0
    remote_period = None
    if remote_every is not None:
        remote_period = max(max(1, math.ceil(remote_every / every)) * period, c.drain_s)
        drain = c.drain_overhead_s / remote_period
        failure += remote_rate * (c.remote_restart_s + remote_period / 2 + c.drain_s)
    elif remote_rate:
        failure = 1.0  # a failure no level survives restarts the job from nothing
    lost = min(1.0, stall + drain + failure)
    return LevelPlan(replicas, every, remote_every, period, remote_period, stall, drain, failure, lost)


def _around(optimum_steps: float, at_least: int = 1) -> list[int]:
    low = max(at_least, math.floor(optimum_steps))
    return sorted({low, max(at_least, math.ceil(optimum_steps))})


def _remote_candidates(period: float, c: LevelCosts, remote_rate: float) -> list[int]:
    """Whole numbers of saves between drains around Young's optimum, never a period below ``D``."""
    young = math.sqrt(2 * c.drain_overhead_s / remote_rate) if remote_rate else 1e9 * period
    target = max(young, c.drain_s)
    return _around(target / period, at_least=max(1, math.ceil(c.drain_s / period)))


def best_remote_every(replicas: int, every: int, c: LevelCosts, f: Failures, *, max_remote_every: int = 100_000) -> int:
    """The ``remote_every`` (steps, a multiple of `every`) with the least expected lost time for a
    fixed `replicas` and `every` (what a Checkpointer with ``remote_every=None`` and
    ``failures=`` applies as it measures).

    Example:
        >>> c = LevelCosts(step_s=1.0, stall_s=0.05, write_s=0.6, drain_s=30.0, drain_overhead_s=1.0)
        >>> best_remote_every(0, 10, c, Failures(process_mtbf_s=86400, cluster_mtbf_s=7 * 86400))
        1090
    """
    _, remote_rate = f.split(replicas)
    period = max(every * c.step_s + c.stall_s, c.write_s + c.replicate_s * replicas)
    candidates = [min(n * every, max_remote_every) for n in _remote_candidates(period, c, remote_rate)]
    return min(candidates, key=lambda n: (plan_lost(replicas, every, n, c, f).lost_fraction, n))


def _best_for(replicas: int, c: LevelCosts, f: Failures, remote: bool) -> LevelPlan:
    local_rate, remote_rate = f.split(replicas)
    if local_rate > 0:
        compute = max(daly_interval_s(c.stall_s, 1.0 / local_rate), c.write_s - c.stall_s)
    else:
        compute = 1e9 * c.step_s  # nothing the local level survives: save rarely
    plans = []
    for every in _around(compute / c.step_s):
        period = max(every * c.step_s + c.stall_s, c.write_s + c.replicate_s * replicas)
        if not remote:
            plans.append(plan_lost(replicas, every, None, c, f))
            continue
        for n in _remote_candidates(period, c, remote_rate):
            plans.append(plan_lost(replicas, every, n * every, c, f))
    return min(plans, key=lambda p: (p.lost_fraction, p.every))


@dataclass
class LevelAdvice:
    """The recommended setting (`best`) and the best setting for each choice of replicas."""

    costs: LevelCosts
    failures: Failures
    best: LevelPlan
    options: list[LevelPlan] = field(default_factory=list)

    def __str__(self) -> str:
        lines = ["replicas  every  remote_every  stall   drain   failures  lost"]
        for p in self.options:
            remote = "-" if p.remote_every is None else str(p.remote_every)
            mark = "  <- recommended" if p == self.best else ""
            lines.append(
                f"{p.replicas:>8}  {p.every:>5}  {remote:>12}  {p.stall_fraction:6.2%}  {p.drain_fraction:6.2%}  "
                f"{p.failure_fraction:8.2%}  {p.lost_fraction:6.2%}{mark}"
            )
        return "\n".join(lines)


def advise_levels(c: LevelCosts, f: Failures, *, remote: bool = True, max_replicas: int = 2) -> LevelAdvice:
    """Recommends ``every``, ``replicas`` and ``remote_every`` together (see the module docstring)."""
    options = [_best_for(k, c, f, remote) for k in range(0, min(max_replicas, f.nodes - 1) + 1)]
    best = min(options, key=lambda p: (p.lost_fraction, p.replicas))
    return LevelAdvice(c, f, best, options)
