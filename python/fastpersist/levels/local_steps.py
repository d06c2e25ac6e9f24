"""The local level of a :class:`~fastpersist.Checkpointer`: the committed steps in its root, the
step its index names, and the newest step that verifies, chosen again when another process's
retention retires a step while it is being checked (docs/failure-model.md, section 10).

Example:
    >>> import fastpersist as fp, torch
    >>> with fp.Checkpointer("/tmp/fp-doc-local-steps", keep=1) as ck:
    ...     _ = ck.save(3, {"w": torch.ones(2)})
    >>> local = LocalSteps("/tmp/fp-doc-local-steps")
    >>> local.steps(), local.index_step(), local.latest()
    ([3], 3, 3)
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any, Literal

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..format.layout import MANIFEST_NAME, parse_step_dir, step_dir_name
from ..format.manifest import read_manifest
from ..loading.examine import verify_checkpoint
from .run_identity import read_local_index

__all__ = ["RESTORE_ATTEMPTS", "LocalSteps", "Verdict"]

log = logging.getLogger("fastpersist")

#: Times a restore reads the index and the steps again when retention (another process saving
#: to the root, or this one) retires the step it chose before it is verified or opened.
RESTORE_ATTEMPTS = 8

#: What checking a step found: it verifies, it is damaged (logged), or it was retired meanwhile.
Verdict = Literal["verifies", "damaged", "retired"]


class LocalSteps:
    """The steps committed in `root`; verification results cached per checkpoint while its
    files are unchanged."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._verified: dict[str, tuple[Any, ...]] = {}

    def path(self, step: int) -> str:
        """The directory of `step`'s checkpoint."""
        return os.path.join(self.root, step_dir_name(step))

    def steps(self) -> list[int]:
        """Steps with a committed checkpoint (a manifest), oldest first. Does not verify data."""
        found = []
        for name in os.listdir(self.root):
            step = parse_step_dir(name)
            if step is not None and os.path.exists(os.path.join(self.root, name, MANIFEST_NAME)):
                found.append(step)
        return sorted(found)

    def index_step(self) -> int | None:
        """The step ``latest.json`` names, or None (no index yet, or unreadable: then logged)."""
        return read_local_index(self.root).step

    def retired(self, step: int) -> bool:
        """Whether `step` is no longer committed here (retention takes the manifest away first)."""
        return not os.path.exists(os.path.join(self.path(step), MANIFEST_NAME))

    def latest(self) -> int | None:
        """The newest committed step, up to the one the index names, that verifies, or None;
        the index and the steps are read again (up to :data:`RESTORE_ATTEMPTS` times) while the
        steps chosen are retired under it, then ``CheckpointNotFoundError`` says to try again."""
        indexed = self.index_step()
        for _ in range(RESTORE_ATTEMPTS):
            found, retired = self._newest_verified(indexed)
            if found is not None:
                return found
            again = self.index_step()
            if not retired and again == indexed:
                return None
            # A commit since the index was read: its retention may have taken every step listed.
            indexed = again
        raise CheckpointNotFoundError(
            errno.ENOENT,
            f"the steps chosen were retired while they were being checked, {RESTORE_ATTEMPTS} times in a row "
            "(another process keeps saving here with a small keep=); nothing is damaged: try again",
            self.root,
        )

    def _newest_verified(self, indexed: int | None) -> tuple[int | None, bool]:
        """The newest committed step up to `indexed` that verifies (damaged ones are skipped), or
        None; and whether a step was retired while it was checked (then the listing is stale)."""
        for step in reversed(self.steps()):
            if indexed is not None and step > indexed:
                continue
            verdict = self.verdict(step)
            if verdict != "damaged":
                return (step, False) if verdict == "verifies" else (None, True)
        return None, False

    def fingerprint(self, path: str) -> tuple[Any, ...]:
        """What a cached verification of the checkpoint at `path` holds for: its id and its files' stats."""
        manifest = read_manifest(path)
        stats = []
        for entry in manifest.files:
            st = os.stat(manifest.file_path(path, entry))
            stats.append((st.st_size, st.st_mtime_ns, st.st_ino))
        return (manifest.checkpoint_id, tuple(stats))

    def verdict(self, step: int) -> Verdict:
        """Whether `step` verifies, is damaged (logged as failing verification) or was retired."""
        path = self.path(step)
        try:
            fingerprint = self.fingerprint(path)
            if self._verified.get(path) == fingerprint:
                return "verifies"
            verify_checkpoint(path)
        except (CorruptCheckpointError, OSError) as e:
            if self.retired(step):
                # Renamed away by retention after it was listed: gone, not damaged.
                self._verified.pop(path, None)
                return "retired"
            log.warning("checkpoint %s fails verification, skipping it: %s", path, e)
            return "damaged"
        self._verified[path] = fingerprint
        return "verifies"
