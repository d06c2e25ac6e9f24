"""Removing the leftovers of interrupted saves: ``fastpersist.clean(root)`` / ``fastpersist clean ROOT``.

A save that dies (``kill -9``, power loss) before it commits leaves, beside its target (the
names are :mod:`fastpersist.format.layout`'s):

* ``.{name}.fptmp-{id}``: the temporary checkpoint directory (partial data, maybe a manifest), or,
  when it died just after an atomic exchange, the replaced old checkpoint;
* ``{name}.{id}[.rN|.wN].fpstripe`` directories under each stripe root;
* ``.{file}.fptmp-{id}``: a file being replaced atomically (a :class:`Checkpointer` index or
  cost history, an ``fp.torch_save`` file, a Hugging Face export's shards, a converted
  safetensors file; :func:`fastpersist.format.layout.atomic_file`), up to the full size of what
  was being written; and ``.latest.json.tmp-*`` / ``.history.json.tmp-*`` of older versions.

On a memory root, the recycle directory ``.fprecycle/`` holds retired steps' data files kept for
a later save to overwrite (:mod:`fastpersist.memory_level.recycle`). It is garbage by construction
(nothing committed names it) and is emptied too; a save racing with that merely allocates fresh
pages.

The deletion rule: nothing is removed that is not provably a leftover of `root`. For temporary
and stripe directories the rule is :mod:`fastpersist.saving.leftovers` (below the group save,
which removes a replaced checkpoint's stripe directories with it; its
:func:`~fastpersist.saving.leftovers.stripe_leftovers` is handed on here too). Beside them:

* A temporary file is removed only when no live writer holds its lock (an older version's
  index temporary file: when the process that wrote it is gone).

``Checkpointer`` runs this for its root and stripes before its first save (never for a read-only
use such as ``latest()`` or ``load()``). Every rank of a group runs it for its own stripe roots.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
from collections.abc import Sequence

from .arguments import given_paths
from .format.layout import INDEX_TMP, dead_tmp_files
from .format.ownership import cleaning
from .memory_level.recycle import free_recycled, recycled_entries
from .saving.leftovers import (
    RootView,
    find_dead_tmp_dirs,
    find_stripe_leftovers,
    has_type,
    remove_stripe_dir,
    stripe_leftovers,
)
from .saving.remover import wait_removed

__all__ = ["clean", "stripe_leftovers"]

log = logging.getLogger("fastpersist")


def _index_tmp_orphans(root: str) -> list[str]:
    found = []
    for name in sorted(os.listdir(root)):
        match = INDEX_TMP.match(name)
        path = os.path.join(root, name)
        if match and has_type(path, stat.S_IFREG) and not _pid_alive(int(match.group(1))):
            found.append(path)
    return found


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean(
    root: str | os.PathLike[str],
    *,
    stripes: Sequence[str | os.PathLike[str]] | None = None,
    dry_run: bool = False,
) -> list[str]:
    """Removes what interrupted saves left in `root` (and under `stripes`); returns the paths.

    Args:
        root: the directory that holds the checkpoints (the parent of each checkpoint path,
            e.g. a :class:`Checkpointer` root).
        stripes: the stripe roots the saves used (``Config.stripes``), a list; stripe
            directories are looked for, and deleted, only there. A single path (a string) is
            refused (``ValueError``): write ``stripes=[path]``.
        dry_run: list what would be removed without removing it.

    Only provable leftovers are removed (see the module docstring): a save in progress in any
    process, other roots' data on shared stripe roots, and copies of checkpoints are left alone.

    Example:
        >>> fp.clean("/tmp/fp-doc-runs")  # doctest: +SKIP
        ['/tmp/fp-doc-runs/.step-00000007.fptmp-1f2e3d4c5b6a']
    """
    stripe_roots = given_paths(stripes, "stripes", "fastpersist.clean")
    wait_removed()  # this process's own removals finish first: they are not leftovers
    root = os.path.abspath(os.fspath(root))
    view = RootView(root=root, real_root=os.path.realpath(root))
    with cleaning(root):
        find_dead_tmp_dirs(view)
        dead_stripes = find_stripe_leftovers(view, stripe_roots, None)
        dead_files = dead_tmp_files(root)
        if not dry_run:
            for path in dead_files:  # under the lock: a new temporary file cannot take the name
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
    index_tmp = _index_tmp_orphans(root)
    recycled = recycled_entries(root)
    removed = [*view.dead_tmp.values(), *dead_files, *index_tmp, *dead_stripes, *recycled]
    if not dry_run:
        free_recycled(root)
        for path in dead_stripes:
            remove_stripe_dir(path)
        for path in view.dead_tmp.values():
            shutil.rmtree(path, ignore_errors=True)
        for path in index_tmp:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    for path in removed:
        log.info("clean: %s %s", "would remove" if dry_run else "removed", path)
    return removed
