"""Is the save's pipeline the limit? Saves of a real training state into the engine's null sink
(every write completes at once, no byte moves) against a warm memcpy of the same bytes: fp.save's
job with and without checksums, and save_async's (which first copies the small tensors), interleaved
in one process (see docs/performance.md, "The pipeline against memcpy").

Run: ``python benches/null_sink.py --size 1GiB --reps 7``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import numpy as np

from fastpersist.format.flatten import flatten
from fastpersist.tools.bench.nullsink import TARGET_NULL_SINK_VS_MEMCPY, memcpy_seconds, null_sink_save
from fastpersist.tools.bench.state import build_state
from fastpersist.tools.units import parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=1 << 30)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the (empty) files are created")
    args = parser.parse_args()
    state = build_state(args.size)
    sources = [b.data for b in flatten(state).blobs]
    total = sum(s.nbytes for s in sources)
    dest = np.ones(total, dtype=np.uint8)
    variants = {  # name: (checksum, blocking)
        "fp.save, crc32c": ("crc32c", True),
        "fp.save, no checksum": ("off", True),
        "save_async, crc32c": ("crc32c", False),
    }
    saves: dict[str, list[float]] = {name: [] for name in variants}
    staging: dict[str, list[float]] = {name: [] for name in variants}
    copies: list[float] = []
    for rep in range(args.reps + 1):  # the first round warms the pool, the pages and the caches
        for name, (checksum, blocking) in variants.items():
            result = null_sink_save(state, args.dir, blocking=blocking, checksum=checksum)
            if rep:
                saves[name].append(result["seconds"])
                staging[name].append(result["staging"])
        seconds = memcpy_seconds(sources, dest)
        if rep:
            copies.append(seconds)
    memcpy_s = statistics.median(copies)
    print(f"state {total / 2**30:.2f} GiB, {len(sources)} blobs, {args.reps} reps interleaved (medians, min-max)")
    spread = f"({min(copies):.3f}-{max(copies):.3f})"
    print(f"  warm memcpy                     {memcpy_s:.3f} s  {total / memcpy_s / 1e9:5.2f} GB/s  {spread}")
    for name, samples in saves.items():
        median = statistics.median(samples)
        print(
            f"  null sink, {name:<20} {median:.3f} s  {total / median / 1e9:5.2f} GB/s  "
            f"({min(samples):.3f}-{max(samples):.3f}); staging {statistics.median(staging[name]):.3f} s; "
            f"{memcpy_s / median:.2f}x memcpy (target {TARGET_NULL_SINK_VS_MEMCPY}x)"
        )


if __name__ == "__main__":
    main()
