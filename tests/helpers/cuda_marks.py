"""The mark of a test that needs a CUDA device: skipped without one, and selected by
``pytest -m cuda`` where there is one (the GPU check runs them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

__all__ = ["cuda_test"]

F = TypeVar("F", bound=Callable[..., object])


def cuda_test(test: F) -> F:
    """Marks `test` ``cuda`` and skips it on a machine without a CUDA device."""
    skipped: F = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test)
    marked: F = pytest.mark.cuda(skipped)
    return marked
