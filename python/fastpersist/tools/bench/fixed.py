"""The fixed costs of a small save: the phases of saves that replace the same checkpoint.

A save of a few hundred MiB is where the costs that do not grow with the bytes show: the first
save of a process (a new staging pool, the first use of its ring), the manifest's fsyncs, and
the commit of a replacing save, whose old tree is deleted after the commit returns
(:mod:`fastpersist.saving.remover`). :func:`replacing_save_phases` saves one state to one path
`runs` + 1 times in this process and reports each phase's median over the replacing saves.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

import fastpersist as fp

from .state import build_state

#: The commit of a replacing save (manifest, fsyncs, the exchange) should cost at most this.
TARGET_REPLACING_COMMIT_S = 0.005


def replacing_save_phases(directory: str, nbytes: int = 256 << 20, runs: int = 5, **config: Any) -> dict[str, Any]:
    """Phases (seconds) of `runs` saves of an `nbytes` state replacing one checkpoint in `directory`.

    ``first`` holds the phases of the first save to the path (nothing to replace), ``median``
    those of the replacing ones.

    Example:
        >>> replacing_save_phases("/tmp", 4 << 20, runs=2)["median"]["commit"] < 1  # doctest: +SKIP
        True
    """

    state = build_state(nbytes)
    path = os.path.join(directory, "fixed-costs")
    cfg = fp.Config(**config)
    first = fp.save(state, path, config=cfg).phases
    samples = [fp.save(state, path, config=cfg).phases for _ in range(runs)]
    fp.wait_removed()
    fp.save({}, path, config=cfg)  # a tiny tree left behind for the caller to remove
    fp.wait_removed()
    return {
        "bytes": nbytes,
        "runs": runs,
        "first": first,
        "median": {k: statistics.median(p[k] for p in samples) for k in first},
        "max": {k: max(p[k] for p in samples) for k in first},
        "path": path,
    }
