"""What the library tells the ``fastpersist`` logger: one INFO line per save and per load.

Fallbacks (io_uring blocked, O_DIRECT refused, torch_save's plain-torch.save path) are logged
at WARNING where they happen. The library never prints; configure the logger to see these:

    >>> import logging
    >>> logging.basicConfig()
    >>> logging.getLogger("fastpersist").setLevel(logging.INFO)
"""

from __future__ import annotations

import logging

from .config import SaveResult

__all__ = ["log", "log_load", "log_save"]

log = logging.getLogger("fastpersist")


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def log_save(result: SaveResult) -> None:
    """``saved PATH: N bytes in S s (R GB/s, backend B)`` at INFO."""
    if log.isEnabledFor(logging.INFO):
        log.info(
            "saved %s: %d bytes in %.3f s (%.2f GB/s, backend %s)",
            result.path,
            result.nbytes,
            result.seconds,
            result.gb_per_s,
            result.backend,
        )


def log_load(path: str, nbytes: int, seconds: float, backend: str) -> None:
    """``loaded PATH: N bytes in S s (R GB/s, backend B)`` at INFO."""
    if log.isEnabledFor(logging.INFO):
        log.info(
            "loaded %s: %d bytes in %.3f s (%.2f GB/s, backend %s)",
            path,
            nbytes,
            seconds,
            _rate(nbytes, seconds),
            backend,
        )
