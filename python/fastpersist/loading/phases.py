"""Where a load's time goes: ``fp.load(path, phases=d)`` fills `d` with seconds per phase.

Phases, in the order a load runs them (a phase that does not run is absent):

* ``manifest``: read and validate the manifest, check every data file (size, no links,
  confinement) before anything is allocated;
* ``read``: the O_DIRECT reads into fresh page-aligned memory, with every chunk's crc32c
  checked as it lands. Fresh memory is faulted in (allocated and zeroed) while it is read, by
  the read job's prefault thread or the reads themselves, so the first touch of the destination
  is part of ``read``: ``read_minor_faults`` and ``read_sys_cpu_s`` say how much of it there
  was (process-wide counters, from ``getrusage``). On a device, the host-to-device copies are
  inside ``read`` too;
* ``crc32c``: the time spent verifying checksums, overlapped with ``read`` (on the driver
  thread, or for a large read on a thread of its own, while later reads are in flight);
* ``build``: tensors over the read bytes (views of their own pages for large blobs, copies of
  small ones);
* ``place``: ``map_location`` (moving tensors to their devices);
* ``unflatten``: rebuild the nested state from the tree spec;
* ``fill``: a load with ``out=``: windows read and copied into the given tensors (``read``
  included).

Example:
    >>> import time
    >>> phases: dict[str, float] = {}
    >>> clock = PhaseClock(phases)
    >>> clock.mark("manifest")
    >>> sorted(phases), phases["manifest"] >= 0
    (['manifest'], True)
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["PhaseClock"]


class PhaseClock:
    """Adds the time since the previous mark to a phase of `sink` (nothing when `sink` is None)."""

    __slots__ = ("last", "sink")

    def __init__(self, sink: dict[str, float] | None) -> None:
        if sink is not None and not isinstance(sink, dict):
            raise TypeError(f"phases={sink!r}: expected a dict to fill with seconds per phase, or None")
        self.sink = sink
        self.last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """Charges the time since the previous mark (or the clock's start) to `phase`."""
        now = time.perf_counter()
        if self.sink is not None:
            self.sink[phase] = self.sink.get(phase, 0.0) + now - self.last
        self.last = now

    def add(self, phase: str, value: float) -> None:
        """Adds a value measured elsewhere (the engine's crc32c time) to `phase`."""
        if self.sink is not None:
            self.sink[phase] = self.sink.get(phase, 0.0) + value

    @contextmanager
    def reading(self) -> Iterator[dict[str, float]]:
        """Around a read: yields the dict the engine fills (``fastpersist.engine.read_ranges(stats=...)``), then
        marks ``read`` and records ``crc32c``, the minor faults and the system CPU time."""
        stats: dict[str, float] = {}
        before = resource.getrusage(resource.RUSAGE_SELF) if self.sink is not None else None
        yield stats
        self.mark("read")
        if before is not None:
            after = resource.getrusage(resource.RUSAGE_SELF)
            self.add("read_minor_faults", after.ru_minflt - before.ru_minflt)
            self.add("read_sys_cpu_s", after.ru_stime - before.ru_stime)
            self.add("crc32c", stats.get("crc32c_s", 0.0))
