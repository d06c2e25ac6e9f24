"""Where ``advise`` gets its measured numbers: a live ``Checkpointer``, a checkpoint root's
``history.json``, or the JSON a ``fastpersist bench`` run writes.

Each reader returns a :class:`Measured` whose fields are None where the source does not hold
that number, and whose ``where`` says, for each field it filled, what exactly was measured.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass, field
from typing import Any

from ..format.layout import HISTORY_NAME
from .history import SaveHistory, read_history
from .wear import WearLog

__all__ = ["Measured", "from_bench", "from_history", "from_root"]


@dataclass
class Measured:
    """Numbers read from a source (None: not there) and, per number, where it came from."""

    stall_s: float | None = None
    write_s: float | None = None
    step_s: float | None = None
    load_s: float | None = None
    restart_overhead_s: float | None = None
    nbytes: int | None = None
    every: int | None = None
    mtbf_s: float | None = None
    dirs: list[str] = field(default_factory=list)
    wear: WearLog | None = None
    where: dict[str, str] = field(default_factory=dict)


def _median_of(results: dict[str, Any], key: str) -> float | None:
    value = results.get(key, {}).get("median_s")
    return float(value) if isinstance(value, (int, float)) else None


def from_bench(path: str | os.PathLike[str]) -> Measured:
    """Reads a ``fastpersist bench --json`` report.

    The stall is ``save_async``'s time to staged (its pool size decides snapshot or bounded
    mode, as in the run), the write its time to durable, the restart its cold ``fastpersist.load``.
    A bench has no training step: the step time must come from the caller.
    """
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), dict) or "state" not in doc:
        raise ValueError(f"{os.fspath(path)}: not a fastpersist bench report (no 'results' and 'state')")
    results: dict[str, Any] = doc["results"]
    config: dict[str, Any] = doc.get("config", {})
    nbytes = int(doc["state"]["bytes"])
    pool = int(config.get("pool_bytes", 0))
    mode = "snapshot" if pool >= nbytes else "bounded"
    out = Measured(nbytes=nbytes, dirs=[str(d) for d in config.get("dirs", [])])
    reps = config.get("reps", "?")
    src = f"bench {os.path.basename(os.fspath(path))} ({doc.get('created', '?')}, median of {reps})"
    out.where["nbytes"] = f"{src}: state size"
    out.stall_s = _median_of(results, "fastpersist_save_async_staged")
    if out.stall_s is not None:
        out.where["stall_s"] = f"{src}: save_async until staged, pool {pool / 2**20:.0f} MiB ({mode} mode)"
    out.write_s = _median_of(results, "fastpersist_save_async_durable")
    if out.write_s is not None:
        out.where["write_s"] = f"{src}: save_async until durable and committed"
    else:
        for key in ("fastpersist_save_io_uring", "fastpersist_save_threads"):
            if (value := _median_of(results, key)) is not None:
                out.write_s = value
                out.where["write_s"] = f"{src}: {results[key].get('label', key)} (durable)"
                break
    out.load_s = _median_of(results, "fastpersist_load")
    if out.load_s is not None:
        out.where["load_s"] = f"{src}: cold fastpersist.load"
    return out


def from_history(history: SaveHistory, what: str) -> Measured:
    """The running medians of a live ``Checkpointer``'s :class:`SaveHistory`."""
    return _from_doc(history.to_json(), what)


def from_root(root: str | os.PathLike[str]) -> Measured:
    """Reads ``ROOT/history.json``, written by a ``Checkpointer`` after each commit."""
    root = os.fspath(root)
    doc = read_history(root)
    if doc is None:
        raise FileNotFoundError(
            errno.ENOENT, f"no readable {HISTORY_NAME}: has a Checkpointer committed a save here?", root
        )
    return _from_doc(doc, os.path.join(root, HISTORY_NAME))


def _from_doc(doc: dict[str, Any], what: str) -> Measured:
    def median(name: str) -> tuple[float | None, int]:
        entry = doc.get(name) or {}
        value = entry.get("median")
        return (float(value) if isinstance(value, (int, float)) else None), len(entry.get("samples") or [])

    out = Measured()
    labels = {
        "stall_s": "loop wait per save in ck.save (start) + ck.wait_staged",
        "write_s": "save start until committed (SaveResult.seconds)",
        "step_s": "time between ck.save calls less the waits, per step",
        "load_s": "ck.load",
        "nbytes": "bytes per checkpoint",
    }
    for name, label in labels.items():
        value, samples = median(name)
        if value is not None:
            setattr(out, name, int(value) if name == "nbytes" else value)
            out.where[name] = f"{what}: {label}, median of {samples}"
    if isinstance(doc.get("every"), int):
        out.every = doc["every"]
    if isinstance(doc.get("mtbf_s"), (int, float)):
        out.mtbf_s = float(doc["mtbf_s"])
    if isinstance(doc.get("restart_overhead_s"), (int, float)):
        out.restart_overhead_s = float(doc["restart_overhead_s"])
    try:
        out.wear = WearLog.from_json(doc.get("wear"))
    except ValueError:
        out.wear = None
    out.dirs = [t for t, b in (out.wear.targets.items() if out.wear else []) if sum(b.values())]
    return out
