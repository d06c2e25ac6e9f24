"""Helpers that wire fastpersist into training loops so the overlap stays safe."""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["guard_optimizer"]


class _Stager(Protocol):
    def wait_staged(self, timeout: float | None = None) -> None: ...


def guard_optimizer(optimizer: Any, saver: _Stager) -> Any:
    """Calls ``saver.wait_staged()`` before every ``optimizer.step()``.

    `saver` is a :class:`~fastpersist.Checkpointer` or a :class:`~fastpersist.SaveFuture`. The
    step then never modifies parameters that an in-flight save is still copying. Returns the
    hook handle; ``handle.remove()`` undoes it.

    Example:
        >>> ck = fp.Checkpointer("runs/exp1")                       # doctest: +SKIP
        >>> fastpersist.integrations.guard_optimizer(optimizer, ck)   # doctest: +SKIP
    """

    def before_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        saver.wait_staged()

    return optimizer.register_step_pre_hook(before_step)
