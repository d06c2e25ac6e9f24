"""Which I/O backends this machine offers: the one probe the tests share."""

from __future__ import annotations

import functools

import fastpersist as fp
from fastpersist import _core


@functools.cache
def uring_available() -> bool:
    """Whether io_uring works here (blocked by seccomp, kernel.io_uring_disabled, or old kernels)."""
    try:
        _core.select_backend("io_uring")
    except fp.BackendUnavailableError:
        return False
    return True


def available_backends() -> list[str]:
    """Every backend the API tests should run on, io_uring first when it works."""
    return ["io_uring", "threads"] if uring_available() else ["threads"]
