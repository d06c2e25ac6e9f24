"""Sizes on the command line: ``512MiB``, ``1GiB``, ``4GB``, ``1000000``.

Example:
    >>> parse_size("1GiB"), parse_size("4GB"), parse_size("4096")
    (1073741824, 4000000000, 4096)
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Literal, TypeVar

T = TypeVar("T")

__all__ = ["auto_or", "parse_size"]


def parse_size(text: str) -> int:
    """Parses ``"512MiB"``, ``"1GiB"``, ``"4GB"``, ``"1000000"`` into bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 2GiB)")
    number, unit, binary = float(match.group(1)), match.group(2).upper(), match.group(3)
    base = 1024 if binary or not unit else 1000
    return int(number * base ** " KMGT".index(unit or " "))


def auto_or(parse: Callable[[str], T]) -> Callable[[str], T | Literal["auto"]]:
    """An argparse type accepting ``"auto"`` or what `parse` accepts: ``auto_or(int)("auto")``."""

    def parse_or_auto(text: str) -> T | Literal["auto"]:
        if text.strip().lower() == "auto":
            return "auto"
        try:
            return parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not auto or a valid value: {text!r}") from None

    return parse_or_auto
