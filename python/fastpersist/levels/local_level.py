"""The local level of a :class:`~fastpersist.Checkpointer` without a partner level: its root
alone (an NVMe directory, or one under ``/dev/shm`` for the in-memory level). Rank 0 (or the one
process) cleans the root, writes its index and, with every rank, retires old steps once the new
one checks out; a restore takes the newest step up to the one the index names that verifies
(:mod:`fastpersist.levels.local_steps`).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterable
from typing import Any

from ..cleanup import clean
from ..config import Config
from ..errors import CheckpointNotFoundError, FastPersistError
from ..format.layout import MANIFEST_NAME
from ..format.manifest import read_manifest
from ..loading.fill import check_out
from ..loading.phases import PhaseClock
from ..loading.pipeline import LoadOptions, load_checkpoint
from ..memory_level.spares import make_spare
from ..retention import retire, retire_in_group
from ..saving.leftovers import stripe_leftovers
from .host import LevelHost, gathered
from .local_steps import RESTORE_ATTEMPTS

__all__ = ["LocalLevel"]

log = logging.getLogger("fastpersist")


class LocalLevel:
    """The root level of a Checkpointer with no partner level (:class:`~fastpersist.levels.host.RootLevel`)."""

    per_rank_shares = False

    def __init__(self, host: LevelHost) -> None:
        self.host = host

    def _stripes(self) -> list[str]:
        config = self.host.config
        return [os.fspath(s) for s in config.stripes or []] if config is not None else []

    def clean(self) -> list[str]:
        if self.host.rank == 0:
            return clean(self.host.root, stripes=self._stripes())
        stripes = self._stripes()
        return stripe_leftovers(self.host.root, stripes) if stripes else []

    def committer(self) -> bool:
        return self.host.rank == 0

    def after_commit(self, step: int, result: object, candidates: list[str]) -> None:
        host = self.host
        if host.rank == 0:
            host.write_index(step)
        stripes = host.config.stripes if host.config is not None else None
        if host.group is None:
            retire(host.root, host.path(step), candidates, stripes, rank=0)
        else:
            assert host.config is not None
            retire_in_group(host.root, host.path(step), candidates, host.config, host.group, host.rank)
        if host.rank == 0:
            make_spare(host.root, host.path(step))  # a memory root with no retired step yet: files for the next save

    def latest(self) -> int | None:
        return self.host.local.latest()

    def holds(self, step: int) -> bool:
        return all(gathered(self.host, os.path.exists(os.path.join(self.host.path(step), MANIFEST_NAME))))

    def load(self, step: int | None, out: object, map_location: Any, namedtuple_types: Iterable[type]) -> Any:
        namedtuple_types = tuple(namedtuple_types)  # read again by each attempt
        if step is not None:
            return self._load_step(step, out, map_location, namedtuple_types)
        retries = RESTORE_ATTEMPTS - 1 if self.host.group is None else 0  # a group's load is collective
        for _ in range(retries):
            step = self._latest_or_raise()
            try:
                return self._load_step(step, out, map_location, namedtuple_types)
            except CheckpointNotFoundError:
                if not self.host.local.retired(step):
                    raise
                log.info("step %d was retired before it could be read; loading the newest step again", step)
        return self._load_step(self._latest_or_raise(), out, map_location, namedtuple_types)

    def _latest_or_raise(self) -> int:
        step = self.latest()
        if step is None:
            raise FileNotFoundError(errno.ENOENT, "no committed, verified checkpoint", self.host.root)
        return step

    def _load_step(self, step: int, out: object, map_location: Any, namedtuple_types: Iterable[type]) -> Any:
        check_out(out)
        options = LoadOptions(map_location, True, Config(), namedtuple_types, PhaseClock(None))
        return load_checkpoint(self.host.path(step), options, out=out, group=self.host.group)

    def levels(self) -> dict[str, Any]:
        host = self.host
        steps = host.steps()
        nbytes = 0
        counted: set[tuple[int, int]] = set()  # an incremental step's linked files count once
        for step in steps:
            try:
                m = read_manifest(host.path(step))
                held = [(host.path(step), m)]
                held += [(d, read_manifest(d)) for d in (os.path.join(host.path(step), s) for s in m.shards)]
                for where, manifest in held:
                    for f in manifest.files:
                        st = os.stat(manifest.file_path(where, f))
                        if (st.st_dev, st.st_ino) not in counted:
                            counted.add((st.st_dev, st.st_ino))
                            nbytes += f.len_bytes
            except (FastPersistError, OSError):
                continue
        local: dict[str, Any] = {"root": host.root, "steps": steps, "bytes": nbytes}
        if host.last_result is not None:
            local["last_seconds"] = host.last_result.seconds
        return {"local": local}
