"""Helpers that wire fastpersist into training loops and frameworks: :mod:`.dcp`
(torch.distributed.checkpoint), :mod:`.lightning`, :mod:`.deepspeed` (imports DeepSpeed: import
it only where DeepSpeed is installed), and :func:`guard_optimizer` (defined in
:mod:`fastpersist.saving.optimizer_guard`, below the Checkpointer that uses it)."""

from __future__ import annotations

from ..saving.optimizer_guard import guard_optimizer

__all__ = ["guard_optimizer"]
