"""Is the pipeline the limit? A whole save into the null sink, against a warm memcpy of the same bytes.

The engine's null sink (``backend="null"``, never a user setting) completes every write at once
and moves no byte, so a save into it costs what the save does besides the disk: flatten and plan,
the staging copies with their crc32c, the driver loop, the empty files' fsyncs and the manifest's
serialisation. The save is a real :class:`~fastpersist.saving.job.SaveJob` run up to its manifest,
then discarded: it is never committed, as its files hold nothing. It is ``fp.save``'s job unless
asked otherwise (``blocking=False``: ``save_async``'s, which first copies the small tensors into
fresh memory so that it can return before they are staged; docs/overlap.md).

The baseline is one memcpy of the same bytes into a buffer already faulted in: what any pipeline
that copies each byte once needs at least. A node that writes 25 GB/s needs the save's pipeline
to run faster than that; on this machine it should reach :data:`TARGET_NULL_SINK_VS_MEMCPY` of it.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from typing import Any

import numpy as np

import fastpersist as fp

#: A save into the null sink should run at least this fraction of a warm memcpy's speed.
TARGET_NULL_SINK_VS_MEMCPY = 0.6


def memcpy_seconds(sources: list[np.ndarray], dest: np.ndarray) -> float:
    """Seconds to copy every source (1-D uint8 views) back to back into `dest` (already faulted in)."""
    start = time.perf_counter()
    offset = 0
    for data in sources:
        end = offset + data.nbytes
        np.copyto(dest[offset:end], data)
        offset = end
    return time.perf_counter() - start


def null_sink_save(state: object, directory: str, *, blocking: bool = True, **config: Any) -> dict[str, float]:
    """One save of `state` into the null sink (in `directory`, removed after): seconds and phases.

    `blocking`: ``fp.save``'s job (no early copy of the small tensors), else ``save_async``'s.

    Example:
        >>> null_sink_save({"w": torch.ones(1000)}, "/tmp")["seconds"] < 10  # doctest: +SKIP
        True
    """
    from fastpersist.saving.job import SaveJob

    path = os.path.join(directory, f"null-sink-{uuid.uuid4().hex[:8]}")
    start = time.perf_counter()
    job = SaveJob(path, fp.Config(**config), engine_backend="null", early_copy=not blocking)  # as start_save makes it
    try:
        job.start(state)
        written = job.wait_written()
        job.manifest(written.entries, written.stripe_dirs)
        seconds = time.perf_counter() - start
    finally:
        job.discard()
    phases = job.result(written).phases
    return {"seconds": seconds, "flatten_plan": phases["flatten_plan"], "staging": phases["staging"]}


def null_sink_vs_memcpy(directory: str, state: object, runs: int = 5, **config: Any) -> dict[str, Any]:
    """``fp.save``'s saves of `state` into the null sink and memcpys of its bytes, interleaved,
    `runs` each after one warm-up of both; medians and the ratio of the null-sink save's speed to
    memcpy's.

    Example:
        >>> null_sink_vs_memcpy("/tmp", {"w": torch.ones(1 << 20)}, runs=1)["ratio"] > 0  # doctest: +SKIP
        True
    """
    from fastpersist.format.flatten import flatten

    sources = [b.data for b in flatten(state).blobs]
    total = sum(s.nbytes for s in sources)
    dest = np.ones(total, dtype=np.uint8)  # faulted in: the memcpy measures copying alone
    saves: list[dict[str, float]] = []
    copies: list[float] = []
    for i in range(runs + 1):
        save = null_sink_save(state, directory, **config)
        copy = memcpy_seconds(sources, dest)
        if i:
            saves.append(save)
            copies.append(copy)
    save_s = statistics.median(s["seconds"] for s in saves)
    copy_s = statistics.median(copies)
    return {
        "bytes": total,
        "runs": runs,
        "null_sink_s": save_s,
        "null_sink_min_max_s": [min(s["seconds"] for s in saves), max(s["seconds"] for s in saves)],
        "memcpy_s": copy_s,
        "memcpy_min_max_s": [min(copies), max(copies)],
        "null_sink_gb_per_s": total / save_s / 1e9,
        "memcpy_gb_per_s": total / copy_s / 1e9,
        "ratio": copy_s / save_s,
        "phases": {k: statistics.median(s[k] for s in saves) for k in ("flatten_plan", "staging")},
        "target": TARGET_NULL_SINK_VS_MEMCPY,
    }
