"""The optimizer hook that keeps the overlap safe: ``optimizer.step()`` first waits until the
save in flight no longer reads the tensors it is about to modify (docs/overlap.md).

Public as :func:`fastpersist.integrations.guard_optimizer` and ``Checkpointer.guard``.

Example:
    >>> import torch
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    >>> class Saver:
    ...     def wait_staged(self, timeout=None):
    ...         print("staged")
    >>> handle = guard_optimizer(opt, Saver())
    >>> opt.step()
    staged
    >>> handle.remove()
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Stager", "guard_optimizer"]


class Stager(Protocol):
    """What the guard waits on: a :class:`~fastpersist.Checkpointer` or a :class:`~fastpersist.SaveFuture`."""

    def wait_staged(self, timeout: float | None = None) -> None: ...


def guard_optimizer(optimizer: Any, saver: Stager) -> Any:
    """Calls ``saver.wait_staged()`` before every ``optimizer.step()``.

    `saver` is a :class:`~fastpersist.Checkpointer` or a :class:`~fastpersist.SaveFuture`. The
    step then never modifies parameters that an in-flight save is still copying. Returns the
    hook handle; ``handle.remove()`` undoes it.

    Example:
        >>> ck = fp.Checkpointer("runs/exp1")                       # doctest: +SKIP
        >>> fastpersist.integrations.guard_optimizer(optimizer, ck)   # doctest: +SKIP
    """

    if not callable(getattr(optimizer, "register_step_pre_hook", None)):
        raise TypeError(
            f"optimizer={optimizer!r}: expected a torch.optim.Optimizer (anything with register_step_pre_hook), "
            f"not {type(optimizer).__name__}"
        )

    def before_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        saver.wait_staged()

    return optimizer.register_step_pre_hook(before_step)
