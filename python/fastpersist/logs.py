"""What the library tells the ``fastpersist`` logger: one INFO line per save and per load, and
one more for a save call that took long to return (at DEBUG when it did not).

Fallbacks (io_uring blocked, O_DIRECT refused, torch_save's plain-torch.save path) are logged
at WARNING where they happen. The library never prints; configure the logger to see these:

    >>> import logging
    >>> logging.basicConfig()
    >>> logging.getLogger("fastpersist").setLevel(logging.INFO)
"""

from __future__ import annotations

import logging
import time

__all__ = ["SLOW_CALL_S", "log", "log_load", "log_save", "log_save_call"]

log = logging.getLogger("fastpersist")

#: A save call that takes this long before it returns says why at INFO (else at DEBUG).
SLOW_CALL_S = 0.25


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def log_save(path: str, nbytes: int, seconds: float, backend: str) -> None:
    """``saved PATH: N bytes in S s (R GB/s, backend B)`` at INFO."""
    if log.isEnabledFor(logging.INFO):
        log.info(
            "saved %s: %d bytes in %.3f s (%.2f GB/s, backend %s)",
            path,
            nbytes,
            seconds,
            _rate(nbytes, seconds),
            backend,
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


def log_save_call(path: str, tensor_count: int, started: float, laid_out: float, engine_started: float) -> None:
    """Where the time went before a save call returned (``time.perf_counter()`` marks): at INFO
    from SLOW_CALL_S on, else at DEBUG.

    The walk of the state and the early copy of small tensors happen at the call by design (the
    overlap contract, docs/overlap.md); this line says how much each cost.
    """
    now = time.perf_counter()
    level = logging.INFO if now - started >= SLOW_CALL_S else logging.DEBUG
    if not log.isEnabledFor(level):
        return
    waited = now - engine_started
    log.log(
        level,
        "the save of %s took %.3f s before returning: %.3f s walking the state (%d tensors) and laying it "
        "out, which must happen at the call to capture its structure; %.3f s starting the engine, which "
        "makes the early copy of the small tensors before returning so that the next forward pass cannot race them "
        "(docs/overlap.md)%s",
        path,
        now - started,
        laid_out - started,
        tensor_count,
        engine_started - laid_out,
        f'; {waited:.3f} s until every byte was staged (Config(guard="copy"))' if waited >= 0.001 else "",
    )
