"""One save, start to commit: flatten, plan, stage and write (in Rust), check, commit.

The commit protocol (docs/format.md): data files go into a fresh temporary directory beside the
target (and into fresh per-checkpoint directories under each stripe); the Rust job fsyncs them;
the manifest is written and fsynced last; the temporary directory is atomically exchanged with
the target (``renameat2``), and the parent directory fsynced. A reader therefore sees the old
checkpoint or the new one, never a mix; a crash at any point leaves the old one intact plus a
``.NAME.fptmp-*`` leftover that carries no manifest at the target path.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import threading
import time
import uuid
import warnings
from typing import Any

from . import _core
from .config import Config, SaveResult
from .errors import SaveCancelledError
from .flatten import FlatState, flatten, records_to_json
from .manifest import MANIFEST_NAME, FileEntry, build, read_manifest

__all__ = ["SaveJob", "pool_for"]

log = logging.getLogger("fastpersist")

TMP_MARKER = ".fptmp-"
STRIPE_SUFFIX = ".fpstripe"

_pools: dict[tuple[int, int], _core.Pool] = {}
_pools_lock = threading.Lock()
_warned_fallback = False


def pool_for(config: Config) -> _core.Pool:
    """The process-wide staging pool for this chunk size and budget (reused across saves)."""
    key = (config.chunk_bytes, config.pool_bytes)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = _core.Pool(config.chunk_bytes, config.pool_bytes)
        return pool


def _warn_fallback_once(reason: str | None) -> None:
    global _warned_fallback
    if reason and not _warned_fallback:
        _warned_fallback = True
        log.warning("%s", reason)
        warnings.warn(reason, RuntimeWarning, stacklevel=4)


def _check_target(path: str) -> None:
    """Refuses to replace anything but a fastpersist checkpoint (or an empty directory)."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        if os.path.exists(os.path.join(path, MANIFEST_NAME)) or not os.listdir(path):
            return
    raise FileExistsError(17, "exists and is not a fastpersist checkpoint; refusing to replace it", path)


class SaveJob:
    """A save in progress. Not public: :class:`SaveFuture` and :func:`save` drive it."""

    def __init__(self, state: object, path: str | os.PathLike[str], config: Config, *, background: bool) -> None:
        self.started = time.perf_counter()
        self.path = os.path.abspath(os.fspath(path))
        self.config = config
        _check_target(self.path)
        flat = flatten(state)
        self._flat: FlatState | None = flat
        self.checkpoint_id = uuid.uuid4().hex
        parent, name = os.path.split(self.path)
        self.tmp_dir = os.path.join(parent, f".{name}{TMP_MARKER}{self.checkpoint_id[:12]}")
        stripe_roots = list(config.stripes or [])
        self.stripe_dirs = [os.path.join(r, f"{name}.{self.checkpoint_id[:12]}{STRIPE_SUFFIX}") for r in stripe_roots]
        self.plan = _core.Plan([b.nbytes for b in flat.blobs], 1, max(1, len(stripe_roots)), config.chunk_bytes)
        self.tensor_json = records_to_json(flat.tensors)
        self._tree = flat.spec
        self._blob_lengths = [b.nbytes for b in flat.blobs]
        self.committed = False
        self.blob_owner = {}
        for rec in flat.tensors:
            self.blob_owner.setdefault(rec.blob, rec.key_path)
        self._mutation_lock = threading.Lock()
        self._mutation_checked = False
        self.stripe_dirs_used: list[str] = []
        os.mkdir(self.tmp_dir)
        try:
            used_stripes = {stripe for _w, stripe, _o, _n in self.plan.parts} if stripe_roots else set()
            self.stripe_dirs_used = [d for i, d in enumerate(self.stripe_dirs) if i in used_stripes]
            for d in self.stripe_dirs_used:
                os.mkdir(d)
            self.part_names: list[tuple[int | None, str]] = []
            paths = []
            for _writer, stripe, _offset, _length in self.plan.parts:
                fname = f"data-w{_writer}-s{stripe}.bin"
                if stripe_roots:
                    self.part_names.append((stripe, fname))
                    paths.append(os.path.join(self.stripe_dirs[stripe], fname))
                else:
                    self.part_names.append((None, fname))
                    paths.append(os.path.join(self.tmp_dir, fname))
            self.handle = _core.start_write(
                self.plan,
                0,
                paths,
                [b.data for b in flat.blobs],
                pool_for(config),
                backend=config.backend,
                direct_io=config.direct_io,
                queue_depth=config.queue_depth,
                checksum=config.checksum == "crc32c",
                durable=config.durable,
                background=background,
            )
        except BaseException:
            self.discard()
            raise
        _warn_fallback_once(self.handle.fallback_reason)

    # -- staging and the mutation guard ------------------------------------------------------

    def wait_staged(self, timeout: float | None = None) -> None:
        """Returns when the sources may be modified; raises if they were modified too early."""
        self.handle.wait_staged(timeout)
        self.check_mutation()

    def check_mutation(self) -> None:
        """Compares each torch source's version counter with its value at flatten time.

        Run once, by whoever first sees staging finish. A bump means an in-place change (e.g.
        ``optimizer.step()``) raced the copy, so the staged bytes may mix two iterations.
        """
        with self._mutation_lock:
            if self._mutation_checked:
                return
            self._mutation_checked = True
            flat, self._flat = self._flat, None  # drop references to the user's tensors
        if flat is None:
            return
        for index, blob in enumerate(flat.blobs):
            if blob.version is None:
                continue
            now = blob.source._version  # type: ignore[attr-defined]
            if now != blob.version:
                self.handle.cancel()
                raise SaveCancelledError(
                    f"tensor {self.blob_owner.get(index, f'blob {index}')!r} was modified in place while the "
                    f"save of {self.path} was copying it (version {blob.version} -> {now}); call "
                    "wait_staged() before optimizer.step(). The checkpoint was not committed; the "
                    "previous one is untouched."
                )

    # -- commit ------------------------------------------------------------------------------

    def finish(self, timeout: float | None = None) -> SaveResult:
        """Waits for the data, checks sources, writes the manifest and commits atomically."""
        try:
            report = self.handle.wait(timeout)
            self.check_mutation()
            self._commit(report)
        except BaseException:
            self.discard()
            raise
        seconds = time.perf_counter() - self.started
        nbytes = int(report["bytes_written"])
        staged = report.get("staged_seconds")
        return SaveResult(
            path=self.path,
            nbytes=nbytes,
            seconds=seconds,
            staged_seconds=float(staged) if staged is not None else seconds,
            gb_per_s=nbytes / seconds / 1e9 if seconds > 0 else 0.0,
            backend=self.handle.backend,
            files=[p["path"] for p in report["parts"]],
        )

    def _commit(self, report: dict[str, Any]) -> None:
        entries = []
        for (stripe, fname), (writer, _s, offset, length), part in zip(
            self.part_names, self.plan.parts, report["parts"], strict=True
        ):
            entries.append(FileEntry(fname, stripe, writer, offset, length, list(part["chunk_crc32c"])))
        offsets = self.plan.extent_offsets
        doc = build(
            checkpoint_id=self.checkpoint_id,
            created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            library_version=_core.__version__,
            chunk_bytes=self.config.chunk_bytes,
            checksum=self.config.checksum,
            total_bytes=self.plan.total_bytes,
            blobs=list(zip(offsets, self._blob_lengths, strict=True)),
            files=entries,
            stripes=self.stripe_dirs,
            tensors=self.tensor_json,
            tree=self._tree,
        )
        manifest_path = os.path.join(self.tmp_dir, MANIFEST_NAME)
        fd = os.open(manifest_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(doc)
            while view:
                view = view[os.write(fd, view) :]
            if self.config.durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if self.config.durable:
            _core.fsync_dir(self.tmp_dir)
            for d in self.stripe_dirs_used:
                _core.fsync_dir(d)
                _core.fsync_dir(os.path.dirname(d))
        _check_target(self.path)
        exchanged = _core.replace_atomically(self.tmp_dir, self.path)
        self.committed = True
        if self.config.durable:
            _core.fsync_dir(os.path.dirname(self.path))
        if exchanged:
            remove_checkpoint_tree(self.tmp_dir)

    def discard(self) -> None:
        """Removes everything this job created (it was never committed)."""
        self.handle_cancel_quietly()
        if self.committed:
            # The new checkpoint is in place; only the old tree (exchanged to tmp_dir) remains.
            remove_checkpoint_tree(self.tmp_dir)
            return
        for d in [self.tmp_dir, *self.stripe_dirs]:
            shutil.rmtree(d, ignore_errors=True)

    def handle_cancel_quietly(self) -> None:
        handle = getattr(self, "handle", None)
        if handle is not None and not handle.done():
            handle.cancel()
            try:
                handle.wait()
            except BaseException:
                pass


def remove_checkpoint_tree(root: str) -> None:
    """Deletes a checkpoint directory and the stripe directories its manifest names."""
    try:
        stripes = read_manifest(root).stripes
    except Exception:
        stripes = []
    for d in stripes:
        if d.endswith(STRIPE_SUFFIX):
            shutil.rmtree(d, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
