"""Where a save goes on disk: the target check, the temporary directory's name, the manifest write,
and the removal of a checkpoint tree (through :mod:`fastpersist.format.confine`).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

from .. import _core
from ..format.confine import remove_checkpoint_tree as _remove_confined
from ..format.manifest import MANIFEST_NAME

__all__ = [
    "TMP_MARKER",
    "check_stripe_roots",
    "check_target",
    "remove_checkpoint_tree",
    "tmp_dir_for",
    "write_manifest",
]

TMP_MARKER = ".fptmp-"


def check_target(path: str) -> None:
    """Refuses to replace anything but a fastpersist checkpoint (or an empty directory)."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        if os.path.exists(os.path.join(path, MANIFEST_NAME)) or not os.listdir(path):
            return
    raise FileExistsError(errno.EEXIST, "exists and is not a fastpersist checkpoint; refusing to replace it", path)


def check_stripe_roots(stripes: Sequence[str | os.PathLike[str]] | None) -> None:
    """Refuses stripe roots that are not existing directories, before anything is written.

    Raises:
        FileNotFoundError / NotADirectoryError: naming the stripe root and the fix.
    """
    for root in stripes or []:
        path = os.fspath(root)
        if not os.path.isdir(path):
            code = errno.ENOTDIR if os.path.exists(path) else errno.ENOENT
            raise OSError(
                code,
                "stripe root (Config.stripes) is not an existing directory: create it or mount its drive "
                "before saving; nothing was written",
                path,
            )


def tmp_dir_for(path: str, checkpoint_id: str) -> str:
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}{TMP_MARKER}{checkpoint_id[:12]}")


def write_manifest(directory: str, manifest: bytes, *, durable: bool) -> None:
    """Writes `manifest` as ``directory/manifest.json`` (new file), fsyncing it and the directory."""
    fd = os.open(os.path.join(directory, MANIFEST_NAME), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(manifest)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    if durable:
        _core.fsync_dir(directory)


def remove_checkpoint_tree(
    root: str, stripe_roots: Sequence[str | os.PathLike[str]] | None = None, *, owner_path: str | None = None
) -> None:
    """Deletes a checkpoint directory and those of its stripe directories inside `stripe_roots`
    that it owns (see :func:`fastpersist.format.confine.remove_checkpoint_tree`: a manifest cannot widen that)."""
    _remove_confined(root, stripe_roots, owner_path=owner_path)
