"""The checks of arguments that several public calls take: a path, a list of paths, a timeout.

Each raises at the call, naming the call, the argument and what was expected, so that a bad
value never reaches the code below as a silent surprise: an empty path that would name the
working directory, a single path iterated as its characters, a timeout that fails deep inside
``threading`` with an operator error.

Example:
    >>> given_timeout(2, "SaveFuture.wait"), given_timeout(None, "SaveFuture.wait")
    (2.0, None)
    >>> given_paths("/d", "stripes", "clean")
    Traceback (most recent call last):
    ...
    ValueError: clean(stripes='/d'): expected None or a list of directories, not a single path: write stripes=['/d']
"""

from __future__ import annotations

import math
import numbers
import os
import threading

__all__ = ["given_path", "given_paths", "given_timeout"]


def given_path(value: object, name: str, call: str, expected: str = "a directory") -> str:
    """`value` (the argument `name` of `call`) as a path string; refuses what is not a path and
    an empty path."""
    if not isinstance(value, (str, os.PathLike)) or not isinstance(os.fspath(value), str):
        raise TypeError(f"{call}({name}={value!r}): expected {expected}, not {type(value).__name__}")
    path = os.fspath(value)
    if not path.strip():
        raise ValueError(
            f"{call}({name}={value!r}): expected {expected}; an empty (or blank) path names no place (it "
            "would be the working directory)"
        )
    return path


def given_paths(value: object, name: str, call: str) -> list[str]:
    """`value` (the argument `name` of `call`: None or a list of directories) as a list of path
    strings; refuses a single path, which would be taken as one path per character (a
    ValueError, as ``Config(stripes=...)`` raises for it)."""
    if value is None:
        return []
    if isinstance(value, (str, bytes, os.PathLike)):
        raise ValueError(
            f"{call}({name}={value!r}): expected None or a list of directories, not a single path: "
            f"write {name}=[{value!r}]"
        )
    try:
        items = list(value)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{call}({name}={value!r}): expected None or a list of directories") from None
    return [given_path(item, f"{name}[{i}]", call) for i, item in enumerate(items)]


def given_timeout(value: object, call: str, name: str = "timeout") -> float | None:
    """`value` (the argument `name` of `call`) as seconds to wait: None, infinity or more than
    ``threading.TIMEOUT_MAX`` (no limit) is None; a number (0 or less: do not wait) is a float;
    anything else is refused."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        found = "NaN" if isinstance(value, numbers.Real) and math.isnan(value) else type(value).__name__
        expected = "None (wait without a limit) or a number of seconds"
        raise TypeError(f"{call}({name}={value!r}): expected {expected}, not {found}")
    seconds = float(value)
    return None if seconds > threading.TIMEOUT_MAX else seconds
