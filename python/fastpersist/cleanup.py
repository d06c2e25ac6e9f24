"""Removing the leftovers of interrupted saves: ``fastpersist.clean(root)`` / ``fastpersist clean ROOT``.

A save that dies (``kill -9``, power loss) before it commits leaves, beside its target:

* ``.{name}.fptmp-{id}``: the temporary checkpoint directory (partial data, maybe a manifest), or,
  when it died just after an atomic exchange, the replaced old checkpoint;
* ``{name}.{id}[.rN|.wN].fpstripe`` directories under each stripe root that no committed
  checkpoint names;
* ``.latest.json.tmp-*`` / ``.history.json.tmp-*``: a :class:`Checkpointer` index or cost
  history being replaced.

The committed checkpoints are never touched: a leftover has no manifest at a checkpoint path.
``Checkpointer`` cleans its own root when it starts; after plain :func:`fastpersist.save` calls,
run :func:`clean` (or ``fastpersist clean ROOT``) when no save into `root` is in progress.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
from collections.abc import Sequence

from .errors import FastPersistError
from .format.confine import remove_checkpoint_tree
from .format.manifest import MANIFEST_NAME, read_manifest
from .format.stripes import STRIPE_SUFFIX

__all__ = ["INDEX_TMP", "clean"]

log = logging.getLogger("fastpersist")

_TMP_DIR = re.compile(r"^\.(.+)\.fptmp-([0-9a-f]{12})$")
#: A Checkpointer's index (latest.json) or cost history (history.json) being replaced.
INDEX_TMP = re.compile(r"^\.(?:latest|history)\.json\.tmp-\d+-\d+$")
_STRIPE_DIR = re.compile(r"^(.+)\.([0-9a-f]{12})(?:\.[rw]\d{1,6})?" + re.escape(STRIPE_SUFFIX) + "$")


def _committed(root: str) -> dict[str, set[str]]:
    """Committed checkpoints directly in `root`: name -> the stripe directories they use."""
    found: dict[str, set[str]] = {}
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith(".") or not os.path.isfile(os.path.join(path, MANIFEST_NAME)):
            continue
        stripes: set[str] = set()
        try:
            m = read_manifest(path)
            stripes.update(os.path.realpath(d) for d in m.stripes)
            for shard in m.shards:
                stripes.update(os.path.realpath(d) for d in read_manifest(os.path.join(path, shard)).stripes)
        except (FastPersistError, OSError) as e:
            log.warning("clean: %s is damaged (%s); keeping every stripe directory named after it", path, e)
            stripes.add("*")
        found[name] = stripes
    return found


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
        stripes: the stripe roots the saves used (``Config.stripes``); stripe directories are
            looked for, and deleted, only there.
        dry_run: list what would be removed without removing it.

    Only leftovers are removed: temporary directories (``.NAME.fptmp-ID``), index temp files,
    and stripe directories that belong to a removed temporary directory or to a committed
    checkpoint of `root` that does not name them. Do not run it while a save into `root` is
    in progress: that save's temporary directory would be removed and the save would fail.

    Example:
        >>> fp.clean("/tmp/fp-doc-runs")  # doctest: +SKIP
        ['/tmp/fp-doc-runs/.step-00000007.fptmp-1f2e3d4c5b6a']
    """
    root = os.path.abspath(os.fspath(root))
    removed: list[str] = []
    dead_ids: set[str] = set()
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        st = os.lstat(path)
        match = _TMP_DIR.match(name)
        if match and stat.S_ISDIR(st.st_mode):
            dead_ids.add(match.group(2))
            removed.append(path)
            if not dry_run:
                remove_checkpoint_tree(path, stripes)
        elif INDEX_TMP.match(name) and stat.S_ISREG(st.st_mode):
            removed.append(path)
            if not dry_run:
                os.unlink(path)
    committed = _committed(root)
    used = set().union(*committed.values()) if committed else set()
    for stripe_root in stripes or []:
        base = os.path.abspath(os.fspath(stripe_root))
        try:
            names = sorted(os.listdir(base))
        except FileNotFoundError:
            continue
        for name in names:
            path = os.path.join(base, name)
            match = _STRIPE_DIR.match(name)
            if match is None or not stat.S_ISDIR(os.lstat(path).st_mode) or os.path.realpath(path) in used:
                continue
            # A save killed after its exchange leaves its id on the temporary directory (which then
            # holds the old tree) while the committed checkpoint uses that id's stripes: kept above.
            owner = committed.get(match.group(1))
            if match.group(2) in dead_ids or (owner is not None and "*" not in owner):
                removed.append(path)
                if not dry_run:
                    shutil.rmtree(path, ignore_errors=True)
    for path in removed:
        log.info("clean: %s %s", "would remove" if dry_run else "removed", path)
    return removed
