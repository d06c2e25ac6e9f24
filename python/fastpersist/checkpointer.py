"""`Checkpointer`: per-iteration checkpoints that overlap training, with retention and resume.

Layout under `root`::

    root/step-00000120/      a committed checkpoint (see docs/format.md)
    root/step-00000121/
    root/latest.json         {"step": 121, "path": "step-00000121", ...}, replaced atomically

The loop calls ``ck.save(step, state)`` after ``optimizer.step()`` and ``ck.wait_staged()``
right before the next ``optimizer.step()`` (or installs :func:`fastpersist.integrations.guard_optimizer`
so it cannot be forgotten). The save of step *i* is written while step *i+1* runs forward and
backward.
"""

from __future__ import annotations

import datetime
import errno
import functools
import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Iterable
from typing import Any, Literal

from . import _core
from .advisor.history import DEFAULT_MAX_EVERY, SaveHistory
from .api import load, verify
from .cleanup import INDEX_TMP
from .config import Config, SaveResult
from .errors import CorruptCheckpointError
from .format.manifest import MANIFEST_NAME, read_manifest
from .format.stripes import STRIPE_SUFFIX
from .futures import SaveFuture, SaveJobLike
from .saving.job import SaveJob, pool_for, remove_checkpoint_tree

__all__ = ["Checkpointer"]

log = logging.getLogger("fastpersist")

_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_LEFTOVER_TMP = re.compile(r"^\.step-\d{8,}\.fptmp-[0-9a-f]{12}$")
_LEFTOVER_STRIPE = re.compile(r"^step-\d{8,}\.[0-9a-f]{12}(\.[rw]\d+)?" + re.escape(STRIPE_SUFFIX) + "$")
INDEX_NAME = "latest.json"


class Checkpointer:
    """Saves a training state every `every` steps, asynchronously, keeping the newest `keep`.

    Args:
        root: directory holding the checkpoints (created if missing).
        every: save when ``step % every == 0``; or ``"auto"``: start at 1 and adapt from this
            Checkpointer's own measured stall, write and step times (see docs/advisor.md).
        keep: committed checkpoints to keep (>= 1). Older ones are deleted only after a newer
            one has committed, so there is always at least one good checkpoint.
        config: a :class:`Config`; by default the staging pool is sized to hold the whole state
            (snapshot mode, capped at a quarter of RAM) so ``wait_staged()`` costs one memcpy.
        group: a ``torch.distributed`` process group: every rank calls the same methods; the
            save is replicated across the group (or sharded with ``sharded=True``); rank 0
            commits, applies retention and maintains the index.
        sharded: each rank saves its own shard (FSDP/ZeRO-style); needs `group`.
        mtbf_s: the job's mean time between failures in seconds; needed by ``every="auto"``.
        max_every: the largest interval ``every="auto"`` may choose.

    Example:
        >>> ck = fp.Checkpointer("runs/exp1", every=1, keep=2)        # doctest: +SKIP
        >>> for step in range(start, steps):                           # doctest: +SKIP
        ...     loss = model(batch).loss; loss.backward()
        ...     ck.wait_staged()          # the previous save no longer reads the tensors
        ...     opt.step(); opt.zero_grad()
        ...     ck.save(step, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step})
        >>> ck.wait()
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        every: int | Literal["auto"] = 1,
        keep: int = 2,
        config: Config | None = None,
        group: object = None,
        sharded: bool = False,
        mtbf_s: float | None = None,
        max_every: int = DEFAULT_MAX_EVERY,
    ) -> None:
        if every == "auto" and group is not None:
            raise ValueError('every="auto" is not supported with group= yet: every rank must save the same steps')
        if type(keep) is not int or keep < 1:
            raise ValueError(f"keep={keep!r}: expected an integer >= 1 (the last good checkpoint is always kept)")
        if sharded and group is None:
            raise ValueError("sharded=True needs group=")
        self.root = os.path.abspath(os.fspath(root))
        self.history = SaveHistory(self.root, every=every, mtbf_s=mtbf_s, max_every=max_every)
        self.keep = keep
        self.config = config
        self.group = group
        self.sharded = sharded
        self.rank = 0
        if group is not None:
            from .saving.group import group_rank_and_size

            self.rank = group_rank_and_size(group)[0]
        self._future: SaveFuture | None = None
        self._pool: Any = None
        self._lock = threading.Lock()
        self._verified: dict[str, tuple[Any, ...]] = {}
        os.makedirs(self.root, exist_ok=True)
        # In a group only rank 0 cleans up: the others may share the directory.
        self.removed_leftovers = self._remove_leftovers() if self.rank == 0 else []
        self.history.persist = self.rank == 0

    @property
    def every(self) -> int:
        """Steps between saves (with ``every="auto"``: the current choice)."""
        return self.history.every

    # -- paths -------------------------------------------------------------------------------

    def path(self, step: int) -> str:
        """The directory of `step`'s checkpoint."""
        return os.path.join(self.root, f"step-{step:08d}")

    def steps(self) -> list[int]:
        """Steps with a committed checkpoint (a manifest), oldest first. Does not verify data."""
        found = []
        for name in os.listdir(self.root):
            match = _STEP_DIR.match(name)
            if match and os.path.exists(os.path.join(self.root, name, MANIFEST_NAME)):
                found.append(int(match.group(1)))
        return sorted(found)

    def _remove_leftovers(self) -> list[str]:
        """Deletes temporary directories of crashed saves (and only those)."""
        removed = []
        for name in os.listdir(self.root):
            if _LEFTOVER_TMP.match(name):
                removed.append(os.path.join(self.root, name))
            elif INDEX_TMP.match(name):  # an index replacement killed before its rename
                os.unlink(os.path.join(self.root, name))
        referenced: set[str] = set()
        for step in self.steps():
            try:
                referenced.update(read_manifest(self.path(step)).stripes)
            except (CorruptCheckpointError, OSError):
                pass
        for stripe_root in (self.config.stripes or []) if self.config else []:
            try:
                names = os.listdir(stripe_root)
            except FileNotFoundError:
                continue
            for name in names:
                full = os.path.join(os.fspath(stripe_root), name)
                if _LEFTOVER_STRIPE.match(name) and full not in referenced:
                    removed.append(full)
        for path in removed:
            log.info("removing leftover of an interrupted save: %s", path)
            shutil.rmtree(path, ignore_errors=True)
        return removed

    # -- saving ------------------------------------------------------------------------------

    def _config_for(self, state: object) -> Config:
        if self.config is not None:
            return self.config
        from .format.flatten import flatten

        nbytes = sum(b.nbytes for b in flatten(state).blobs)
        chunk = Config().chunk_bytes
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        wanted = -(-nbytes // chunk) * chunk
        pool = max(Config().pool_bytes, min(wanted, ram // 4 // chunk * chunk))
        self.config = Config(pool_bytes=pool)
        return self.config

    def save(self, step: int, state: object) -> SaveFuture | None:
        """Starts saving `state` as `step` if the step is due; returns its future, else None.

        Waits for the previous save to finish first (at most one save is in flight). If the
        previous save failed and nobody has seen its error yet (``wait_staged()`` raises it at
        once), it is raised here and this step is not saved.
        """
        if type(step) is not int or step < 0:
            raise ValueError(f"step={step!r}: expected a non-negative integer")
        if not self.history.due(step):
            return None
        with self.history.waiting("commit"):
            self._finish_previous()
        with self.history.waiting("start"), self._lock:
            config = self._config_for(state)
            if self._pool is None:
                self._pool = pool_for(config)  # held for this Checkpointer's life, reused by every save
            job: SaveJobLike
            if self.group is None:
                job = SaveJob(self.path(step), config, pool=self._pool).start(state)
            else:
                from .saving.group import GroupSaveJob

                job = GroupSaveJob(self.path(step), config, self.group, sharded=self.sharded, pool=self._pool)
                job.start(state)
            on_commit = functools.partial(self._after_commit, step) if self.rank == 0 else None
            self._future = SaveFuture(job, on_commit=on_commit)
            return self._future

    def _finish_previous(self) -> None:
        """Waits for the save in flight; raises its error unless the caller has seen it already."""
        future = self._future
        if future is None:
            return
        seen = future.error_seen
        try:
            future.wait()
        except BaseException as e:
            if not seen:
                raise
            log.info("not raising again the failure of %s, already raised to the caller: %s", future.path, e)
        finally:
            with self._lock:
                if self._future is future:
                    self._future = None

    def _after_commit(self, step: int, result: SaveResult) -> None:
        self._write_index(step)
        for old in self.steps()[: -self.keep]:
            if old != step:
                remove_checkpoint_tree(self.path(old), self.config.stripes if self.config else None)
        stripes = self.config.stripes if self.config else None
        self.history.committed(result, stripes=stripes, group=self.group is not None)  # costs and wear

    def _write_index(self, step: int) -> None:
        doc = {
            "step": step,
            "path": os.path.basename(self.path(step)),
            "updated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        tmp = os.path.join(self.root, f".{INDEX_NAME}.tmp-{os.getpid()}-{threading.get_ident()}")
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.root, INDEX_NAME))
        _core.fsync_dir(self.root)

    def wait_staged(self, timeout: float | None = None) -> None:
        """Blocks until the in-flight save (if any) no longer reads the state's tensors."""
        future = self._future
        if future is not None:
            with self.history.waiting("staged"):
                future.wait_staged(timeout)

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Blocks until the in-flight save (if any) commits; returns its result or raises its error."""
        future = self._future
        if future is None:
            return None
        try:
            return future.wait(timeout)
        finally:
            if future.done():
                with self._lock:
                    if self._future is future:
                        self._future = None

    # -- resuming ----------------------------------------------------------------------------

    def _fingerprint(self, path: str) -> tuple[Any, ...]:
        manifest = read_manifest(path)
        stats = []
        for entry in manifest.files:
            st = os.stat(manifest.file_path(path, entry))
            stats.append((st.st_size, st.st_mtime_ns, st.st_ino))
        return (manifest.checkpoint_id, tuple(stats))

    def _verifies(self, step: int) -> bool:
        path = self.path(step)
        try:
            fingerprint = self._fingerprint(path)
            if self._verified.get(path) == fingerprint:
                return True
            verify(path)
        except (CorruptCheckpointError, OSError) as e:
            log.warning("checkpoint %s fails verification, skipping it: %s", path, e)
            return False
        self._verified[path] = fingerprint
        return True

    def latest(self) -> int | None:
        """The newest step whose checkpoint is committed and verifies (every chunk checksum), or None.

        Verification results are cached per checkpoint while its files are unchanged.
        """
        for step in reversed(self.steps()):
            if self._verifies(step):
                return step
        return None

    def load(
        self,
        step: int | None = None,
        *,
        out: object = None,
        map_location: Any = None,
        namedtuple_types: Iterable[type] = (),
    ) -> Any:
        """Loads `step` (default: :meth:`latest`); `out`, `map_location` and `namedtuple_types`
        as in :func:`fastpersist.load`.

        Raises:
            FileNotFoundError: there is no good checkpoint under `root`.
        """
        if step is None:
            step = self.latest()
            if step is None:
                raise FileNotFoundError(errno.ENOENT, "no committed, verified checkpoint", self.root)
        with self.history.loading():
            return load(
                self.path(step),
                out=out,
                map_location=map_location,
                group=self.group,
                namedtuple_types=namedtuple_types,
            )

    def guard(self, optimizer: Any) -> Any:
        """Makes ``optimizer.step()`` call :meth:`wait_staged` first; returns the hook handle."""
        from .integrations import guard_optimizer

        return guard_optimizer(optimizer, self)

    def __repr__(self) -> str:
        return f"Checkpointer({self.root!r}, every={self.every}, keep={self.keep})"
