"""The target of a save: the names a save creates beside it, how it takes the target's place,
the manifest write, and the removal of a checkpoint tree (through :mod:`fastpersist.format.confine`).

A save writes into a hidden temporary directory next to the target and, with stripes, into one
directory per stripe root (their names: :mod:`fastpersist.format.layout`); at commit the
temporary directory is renamed onto the target, replacing the checkpoint there.

Example:
    >>> check_name_fits("/ckpt/step-7", striped=True, tag=".r3")   # fits: returns None
    >>> check_target("/ckpt/no-such-step")                        # nothing there to refuse
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Sequence

import fastpersist._core as _core

from ..format.confine import remove_checkpoint_tree as _remove_confined
from ..format.layout import MANIFEST_NAME, stripe_dir_id, stripe_dir_name, tmp_dir_for, write_new_file

__all__ = [
    "COMMIT_ATTEMPTS",
    "NAME_MAX_BYTES",
    "check_name_fits",
    "check_stripe_roots",
    "check_target",
    "make_parents",
    "remove_checkpoint_tree",
    "replace_as_last_writer",
    "write_manifest",
]

#: The longest file name Linux filesystems accept (NAME_MAX), in bytes of the encoded name.
NAME_MAX_BYTES = 255

#: Renames a commit tries while other saves keep creating or removing the same target path.
COMMIT_ATTEMPTS = 8


def check_name_fits(path: str, *, striped: bool, tag: str = "") -> None:
    """Raises ValueError, before anything is written, if a name a save of `path` creates
    would exceed NAME_MAX (the kernel's ENAMETOOLONG would name only the hidden directory), or
    if the loader would refuse the name of its stripe directories.

    `tag` is the longest stripe-directory tag any rank of the save uses (``".r12"``).
    """
    name = os.path.basename(path)
    some_id = "0" * 32
    made = [os.path.basename(tmp_dir_for(path, some_id))]
    if striped:
        made.append(stripe_dir_name(name, some_id, tag))
    name_bytes = len(os.fsencode(name))
    extra_bytes = max(len(os.fsencode(m)) for m in made) - name_bytes
    if name_bytes + extra_bytes > NAME_MAX_BYTES:
        raise ValueError(
            f"cannot save {path}: its name is {name_bytes} bytes, and the directories a save makes beside it "
            f"({', '.join(made)}) add {extra_bytes} bytes to it, past the {NAME_MAX_BYTES}-byte limit on a "
            f"file name (NAME_MAX). Use a checkpoint name of at most {NAME_MAX_BYTES - extra_bytes} bytes"
        )
    if striped and stripe_dir_id(made[-1]) is None:
        raise ValueError(
            f"cannot save {path} with stripes: the loader would refuse its stripe directory name {made[-1]!r} "
            "(fastpersist/format/layout.py accepts only ASCII letters, digits, '.', '_' and '-' in a striped "
            "checkpoint's name). Rename the checkpoint"
        )


def make_parents(path: str, *, durable: bool) -> None:
    """Creates the missing directories above the checkpoint `path` (as ``mkdir -p``; a
    checkpoint's name is the caller's promise of where it goes, as for DCP's writer or
    ``save_pretrained``), each made durable in its parent when `durable`.

    Raises:
        ValueError: `path` is a URL (``s3://...``): a save writes a local or mounted path; the
            remote level of a Checkpointer drains to an object store.
        OSError: a parent cannot be made (a file in the way, no permission), naming it.
    """
    scheme, sep, _ = path.partition("://")
    if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        raise ValueError(
            f"cannot save to {path}: a save writes a local or mounted directory; for an object store use "
            "Checkpointer(root, levels=[fastpersist.Remote('s3://bucket/prefix')]), which drains committed steps there"
        )
    parent = os.path.dirname(os.path.abspath(path))
    missing = []
    while not os.path.isdir(parent) and os.path.dirname(parent) != parent:
        missing.append(parent)
        parent = os.path.dirname(parent)
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise
            continue  # made by another rank or process meanwhile
        if durable:
            _core.fsync_dir(os.path.dirname(directory))


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


def replace_as_last_writer(tmp_dir: str, path: str) -> bool:
    """Atomically puts `tmp_dir` at `path`, replacing whatever checkpoint is there by then.

    Two saves of one new path may both find it absent and rename with "no replace": the
    later one then replaces the checkpoint the other just committed, as if the saves had run
    one after the other. Returns whether a checkpoint was exchanged out (it is now at `tmp_dir`).
    """
    for _ in range(COMMIT_ATTEMPTS):
        try:
            return _core.replace_atomically(tmp_dir, path)
        except FileExistsError:
            check_target(path)  # another save committed it first: still a checkpoint to replace
        except FileNotFoundError:
            if not os.path.isdir(tmp_dir) or os.path.lexists(path):
                raise
            # The checkpoint this save was exchanging with was removed meanwhile: try again.
    raise FileExistsError(
        errno.EEXIST,
        f"other processes kept committing or removing this checkpoint during {COMMIT_ATTEMPTS} attempts to "
        "put this save in its place; nothing was committed by this save. Give concurrent saves distinct paths",
        path,
    )


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


def write_manifest(directory: str, manifest: bytes, *, durable: bool) -> None:
    """Writes `manifest` as ``directory/manifest.json`` (new file), fsyncing it and the directory."""
    write_new_file(os.path.join(directory, MANIFEST_NAME), manifest, durable=durable)
    if durable:
        _core.fsync_dir(directory)


def remove_checkpoint_tree(
    root: str, stripe_roots: Sequence[str | os.PathLike[str]] | None = None, *, owner_path: str | None = None
) -> None:
    """Deletes a checkpoint directory and those of its stripe directories inside `stripe_roots`
    that it owns (see :func:`fastpersist.format.confine.remove_checkpoint_tree`: a manifest cannot widen that)."""
    _remove_confined(root, stripe_roots, owner_path=owner_path)
