"""Names of stripe directories: the pure rules a manifest's stripe paths must follow.

Used by the manifest reader (every path checked before use) and by confinement and cleanup.

Example:
    >>> stripe_dir_id("step-00000012.0123456789ab.w1.fpstripe")
    '0123456789ab'
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from ..errors import CorruptCheckpointError
from .quote import shown

__all__ = ["STRIPE_SUFFIX", "check_stripe_dirs", "parse_stripe_dir", "stripe_dir_id"]

STRIPE_SUFFIX = ".fpstripe"
_STRIPE_DIR = re.compile(r"^([A-Za-z0-9._-]{0,240})\.([0-9a-f]{12})(?:\.[rw]\d{1,6})?" + re.escape(STRIPE_SUFFIX) + "$")


def parse_stripe_dir(name: str) -> tuple[str, str] | None:
    """(checkpoint name, 12-hex checkpoint id) of a stripe directory's name, or None if it is not one.

    Example:
        >>> parse_stripe_dir("step-00000012.0123456789ab.r3.fpstripe")
        ('step-00000012', '0123456789ab')
    """
    match = _STRIPE_DIR.match(name)
    return (match.group(1), match.group(2)) if match else None


def stripe_dir_id(name: str) -> str | None:
    """The 12-hex checkpoint id in a stripe directory's name, or None if it is not one."""
    parsed = parse_stripe_dir(name)
    return parsed[1] if parsed else None


def check_stripe_dirs(stripes: Iterable[str], checkpoint_id: str, where: str) -> None:
    """Refuses stripe paths a save of this checkpoint cannot have written (pure; no I/O).

    Raises:
        CorruptCheckpointError: naming the offending path.
    """
    for s in stripes:
        ok = (
            "\x00" not in s
            and os.path.isabs(s)
            and os.path.normpath(s) == s
            and not s.startswith("//")
            and stripe_dir_id(os.path.basename(s)) == checkpoint_id[:12]
            and len(checkpoint_id) >= 12
        )
        if not ok:
            raise CorruptCheckpointError(
                f"{where}: stripe directory {shown(s, 200)} is not a normalised absolute path ending in "
                f"NAME.{checkpoint_id[:12] or 'ID'}{STRIPE_SUFFIX}; fastpersist will not read or delete it"
            )
