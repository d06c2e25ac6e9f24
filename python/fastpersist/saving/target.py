"""What a save may replace at its target path: nothing, an empty directory, or a checkpoint.

A save puts its new checkpoint directory at the path by an atomic exchange (docs/format.md), so
anything else there is refused rather than swapped away, and so is a symbolic link: exchanging
it would replace the link itself, not the checkpoint it points to (loads do read through one).

Example:
    >>> check_target("/tmp/fp-doc-no-such-target")  # nothing there: a save may create it
"""

from __future__ import annotations

import errno
import os

from ..format.manifest import MANIFEST_NAME

__all__ = ["check_target"]


def check_target(path: str) -> None:
    """Refuses to replace anything but a fastpersist checkpoint (or an empty directory), and a
    symbolic link whatever it points to.

    Raises:
        FileExistsError: naming `path`, what is there and what to do.
    """
    if not os.path.lexists(path):
        return
    if os.path.islink(path):
        raise FileExistsError(
            errno.EEXIST,
            f"is a symbolic link to {os.readlink(path)!r}; a save replaces its target directory as a whole (an "
            "atomic exchange), which would replace the link, not the checkpoint it points to. Save to the real "
            f"path ({os.path.realpath(path)}) and re-point the link afterwards, or remove the link",
            path,
        )
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, MANIFEST_NAME)) or not os.listdir(path):
            return
    raise FileExistsError(errno.EEXIST, "exists and is not a fastpersist checkpoint; refusing to replace it", path)
