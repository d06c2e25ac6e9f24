"""`paused_gc`: the cyclic garbage collector off for a block of work that makes no cycles.

Walking a state of many small tensors allocates a few objects per tensor; the collections
those allocations trigger would cost more than the walk itself (on 200,000 tensors, as much as
the rest of the call). Nothing the walk makes is cyclic, so nothing is left for the collector.

Example:
    >>> import gc
    >>> with paused_gc():
    ...     gc.isenabled()
    False
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["paused_gc"]


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Keeps the cyclic garbage collector off for the block; restores its state after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
