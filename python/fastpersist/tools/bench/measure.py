"""The two records of a ``fastpersist bench`` run: a timed action (`Method`) and what it measured (`Row`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Row:
    """One measured quantity: its samples and what it is compared with."""

    key: str
    label: str
    kind: str  # "save" | "load"
    role: str  # "limit" | "fastpersist" | "peer"
    seconds: list[float] = field(default_factory=list)
    note: str = ""
    rate: bool = True  # whether GB/s is meaningful (not for "time to return")
    peak_rss_bytes: int = 0  # the process's peak RSS while this method ran (max over repetitions)

    def median(self) -> float:
        return statistics.median(self.seconds)


@dataclass
class Method:
    """A timed action: `run` returns ``{row key: seconds}``; `outputs` are deleted after each repetition."""

    name: str
    run: Callable[[], dict[str, float]]
    outputs: list[str]
    keep_last: bool = False  # a load reads the last repetition's output
