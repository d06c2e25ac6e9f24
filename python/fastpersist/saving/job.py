"""One process's part of a save: flatten, plan, stage and write (in Rust), check, commit.

The commit protocol (docs/format.md): data files go into a fresh temporary directory beside the
target (and into fresh per-checkpoint directories under each stripe); the Rust job fsyncs them;
the manifest is written and fsynced last; the temporary directory is atomically exchanged with
the target (``renameat2``), and the parent directory fsynced. A reader therefore sees the old
checkpoint or the new one, never a mix; a crash leaves the old one intact plus a ``.NAME.fptmp-*``.

A single-process save is one :class:`SaveJob` that owns the temporary directory and commits.
In a process group (:mod:`fastpersist.saving.group`) every rank runs a :class:`SaveJob` for its
share, and the rank that owns the temporary directory writes the manifest and commits for all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Literal

import fastpersist._core as _core

from ..config import Config
from ..engine import Guard, JobHooks, WriteOptions, WriteRequest, start_write
from ..errors import SaveCancelledError
from ..format.flatten import FlatState, TensorRecord, records_to_json
from ..format.layout import data_file_name, stripe_dir_name
from ..format.manifest import FileEntry, StreamText, build, stream_text
from ..format.ownership import DirLock, make_locked_dir, remove_owned_dir, write_owner
from ..format.quote import shown
from ..futures import SaveResult
from ..gcpause import paused_gc
from ..gpu.arenas import ARENAS
from ..gpu.device_side import DeviceStaging, has_device_blobs, share_bytes, start_device_staging
from ..gpu.early import choose_early_copies, copy_unversioned, split_by_side
from ..logs import log_save, log_save_call
from ..memory_level.recycle import file_to_stage_in, take_recycled
from .engine_save import EngineSave
from .incremental import Incremental, IncrementalPlan, plan_for_save
from .pools import pool_for
from .remover import held_for_removal, make_room
from .share_layout import Layout, PlanPart, flatten_to_save, single_layout
from .target import (
    check_name_fits,
    check_stripe_roots,
    check_target,
    remove_checkpoint_tree,
    replace_as_last_writer,
    write_manifest,
)
from .verdict import Verdict

__all__ = ["SaveJob", "Written"]

log = logging.getLogger("fastpersist")


@dataclass
class Written:
    """What this process wrote: its files (stripe = local index) and its stripe directories."""

    entries: list[FileEntry]
    stripe_dirs: list[str]
    report: dict[str, Any]


class SaveJob(EngineSave):
    """This process's share of a save. Not public: :class:`SaveFuture`, :func:`save` and the
    group protocol drive it.

    Construction records where the save goes and how (every setting is given here, none is set
    later); :meth:`start` flattens, plans, makes directories, starts the engine.

    `pool`: a staging pool to reuse (a Checkpointer's). `tmp_lock`: held from the temporary
    directory's creation until commit or discard (cleaners leave it alone). `early_copy`: copy
    small watched tensors before start returns (docs/overlap.md), not for a caller that waits
    (``fp.save``). `hold_replaced`: a replaced tree stays locked until deleted (not where other
    ranks must see it dead). `engine_backend`: the config's backend unless given (the null sink
    of ``fastpersist bench``, tools/bench/nullsink.py). `write_gate`: holds the writes back until
    opened (a Checkpointer's snapshot waiting for the disk): the state is staged into an arena
    at once, host tensors included. `incremental`: write only the chunks that differ from its
    base (:mod:`fastpersist.saving.incremental`); a state with device tensors, or a save held
    back by a write gate, is written in full.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: Config,
        *,
        layout: Layout | None = None,
        pool: _core.Pool | None = None,
        tmp_lock: DirLock | None = None,
        early_copy: bool = True,
        hold_replaced: bool = True,
        engine_backend: Literal["null"] | None = None,
        write_gate: _core.WriteGate | None = None,
        incremental: Incremental | None = None,
    ) -> None:
        self.started = self._laid_out = self._written = time.perf_counter()
        self.path = os.path.abspath(os.fspath(path))
        self.config = config.resolved_for(self.path)  # a group's job gets a resolved config
        self.layout = layout or single_layout(self.path)
        self.pool = pool
        self.tmp_lock = tmp_lock
        self.hold_replaced = hold_replaced
        self.early_copy = early_copy
        self.engine_backend: Literal["auto", "io_uring", "threads", "null"] = engine_backend or self.config.backend
        self.handle: Any = None
        self.verdict = Verdict()
        self._created: list[str] = []
        self._flat: FlatState | None = None
        #: The early copy: watched host blobs the engine copies before start returns, and
        #: device blobs whose copies are ordered before the caller's later work.
        self._copy_early: list[int] = []
        self._copy_early_on_device: list[int] = []
        self._device: DeviceStaging | None = None
        self.write_gate = write_gate
        #: Some of the state's tensors are staged from a device (known once the engine started).
        self.from_device = False
        self.stripe_dirs: list[str] = []
        self.stripe_dirs_used: list[str] = []
        self.my_parts: list[PlanPart] = []
        self.part_names: list[tuple[int | None, str]] = []
        self.records: list[TensorRecord] = []
        self.blob_lengths: list[int] = []
        self.incremental = incremental
        #: What an incremental save writes and links (None: a plain save).
        self.increment: IncrementalPlan | None = None

    def start(self, state: object, *, background: bool = True) -> SaveJob:
        """Flattens `state`, lays out the stream, creates the directories and starts the engine."""
        check_stripe_roots(self.config.stripes)
        check_name_fits(self.path, striped=bool(self.config.stripes), tag=self.layout.tag)
        if self.layout.owner:
            check_target(self.path)
        try:
            with paused_gc():  # a few objects per tensor, no cycles: collections would cost more
                self._lay_out(state)
                self._laid_out = time.perf_counter()
                paths = self._make_directories()
                if self.my_parts:
                    self._start_engine(paths, background)
            engine_started = time.perf_counter()
            if self.handle is not None and self.config.guard == "copy":
                # Writes the version counter cannot see (.data, .numpy(), CUDA) are kept out only by waiting.
                self.handle.wait_staged()
        except BaseException:
            self.discard()
            raise
        log_save_call(self.path, len(self.records), self.started, self._laid_out, engine_started)
        return self

    def _lay_out(self, state: object) -> None:
        """Flattens the state (unless given flattened already, by :func:`flatten_to_save`) and
        plans the stream: what this process writes, and where."""
        layout, config = self.layout, self.config
        flat = self._flat = state if isinstance(state, FlatState) else flatten_to_save(state)
        name = os.path.basename(self.path)
        stripe_roots = list(config.stripes or [])
        stripe_name = stripe_dir_name(name, layout.checkpoint_id, layout.tag)
        self.stripe_dirs = [os.path.join(r, stripe_name) for r in stripe_roots]
        alone = not config.stripes and layout.writer_count == 1 and layout.owner
        self.increment = plan_for_save(
            flat, self.incremental, path=self.path, config=config, alone=alone, gated=bool(self.write_gate)
        )
        if self.increment is not None:
            self.plan = self.increment.own
        else:
            self.plan = _core.Plan(
                [b.nbytes for b in flat.blobs],
                layout.writer_count,
                max(1, len(stripe_roots)),
                config.resolved_chunk_bytes,
            )
        self.records = flat.tensors  # hold no tensors: kept after the save is staged
        self.tree = flat.spec
        self.blob_lengths = [b.nbytes for b in flat.blobs]
        self.pool = self.pool if self.pool is not None else pool_for(self.config)
        if self.early_copy:
            copy_unversioned(flat.blobs, flat.tensors, flat.leaves)
            self._copy_early, self._copy_early_on_device = split_by_side(flat.blobs, choose_early_copies(flat.blobs))
        self._take_parts()

    def _take_parts(self) -> None:
        """This process's parts of the plan, their files and stripe directories."""
        striped = bool(self.config.stripes)
        self.my_parts = [p for w in self.writers for p in map(PlanPart._make, self.plan.parts) if p.writer == w]
        self.stripe_dirs_used = sorted({self.stripe_dirs[part.stripe] for part in self.my_parts} if striped else set())
        self.part_names = [
            (part.stripe if striped else None, data_file_name(writer=part.writer, stripe=part.stripe))
            for part in self.my_parts
        ]

    @property
    def stream_plan(self) -> _core.Plan:
        """The plan of the state's stream (the manifest's): an incremental save's engine writes
        only the changed chunks of it."""
        return self.increment.stream if self.increment is not None else self.plan

    def _make_directories(self) -> list[str]:
        """Creates the temporary checkpoint and stripe directories; returns the data file paths."""
        layout = self.layout
        if layout.owner:
            # In a group the owner made it already, before the others could write into it.
            if self.tmp_lock is None:
                self.tmp_lock = make_locked_dir(layout.tmp_dir)
            self._created.append(layout.tmp_dir)
        if layout.data_dir != layout.tmp_dir:
            os.mkdir(layout.data_dir)
            self._created.append(layout.data_dir)
        for d in self.stripe_dirs_used:
            os.mkdir(d)
            self._created.append(d)
            write_owner(d, self.path, layout.checkpoint_id, durable=self.config.durable)
        paths = [
            os.path.join(self.stripe_dirs[stripe] if stripe is not None else layout.data_dir, fname)
            for stripe, fname in self.part_names
        ]
        take_recycled(os.path.dirname(self.path), layout.tmp_dir, paths)  # a memory root's retired files
        if self.increment is not None and not self.increment.link_into(layout.data_dir):
            log.info("incremental save of %s: its base was deleted meanwhile, a full write", self.path)
            self.increment = self.increment.in_full()
            self.plan = self.increment.own
            self._take_parts()
            paths = [os.path.join(layout.data_dir, fname) for _, fname in self.part_names]
        return paths

    @property
    def writers(self) -> tuple[int, ...]:
        """The writers whose parts this process writes: its own first, then `also_writers`."""
        own = () if self.layout.writer is None else (self.layout.writer,)
        return own + self.layout.also_writers

    def _start_engine(self, paths: list[str], background: bool) -> None:
        """Hands this process's parts to the engine (stage, checksum, write, fsync); a save with
        device tensors leases an arena for them first (fastpersist.gpu.device_side)."""
        flat, config, pool = self._flat, self.config, self.pool
        assert flat is not None and self.writers and pool is not None
        make_room(paths, [part.len_bytes for part in self.my_parts])  # a replaced tree's space may be queued
        self.from_device = has_device_blobs(flat.blobs)
        if self.from_device or self.write_gate is not None:
            chunk = config.resolved_chunk_bytes
            self._device = start_device_staging(
                flat.blobs,
                share_bytes(self.plan, self.writers, chunk),
                pinned_bytes=config.pinned_bytes,
                min_bytes=chunk,
                key_path=self.blob_owner,
                fail=self.verdict.fail,
                early=self._copy_early_on_device,
                in_file=file_to_stage_in(
                    paths, self.my_parts, self.layout.tmp_dir, backend=self.engine_backend, direct_io=config.direct_io
                ),
            )
        if self._device is None or not self._device.lease.arena.over_a_file:
            ARENAS.let_go_of_files(paths)  # written another way: their pinned pages must not outlive it
        if self.increment is not None:
            sources, guard = self.increment.engine_sources(flat.blobs, self._copy_early, self._check_staged)
        else:
            sources = [None if b.device_copier is not None else b.data for b in flat.blobs]
            watched = [b.version is not None for b in flat.blobs]
            guard = Guard(watched=watched, on_staged=self._check_staged, copy_early=self._copy_early)
        self.handle = start_write(
            WriteRequest(
                plan=self.plan,
                writer=self.writers[0],
                also_writers=self.writers[1:],
                paths=paths,
                sources=sources,
                pool=pool,
                background=background,
                options=self._write_options(),
                hooks=JobHooks(
                    guard=guard,
                    device=self._device,
                    write_gate=self.write_gate,
                ),
            )
        )

    def _write_options(self) -> WriteOptions:
        """The config's write options; an incremental save's smaller chunks keep as many bytes in
        flight as the config's chunks would (1 MiB writes at depth 8 ran ~20% slower here)."""
        options = WriteOptions.of(self.config, backend=self.engine_backend)
        chunk, usual = self.plan.chunk_bytes, self.config.resolved_chunk_bytes
        if self.increment is None or chunk >= usual:
            return options
        return dataclasses.replace(options, queue_depth=min(64, options.queue_depth * (usual // chunk)))

    @functools.cached_property
    def manifest_stream(self) -> StreamText:
        """The manifest's blobs, tensors and tree as JSON: serialised while the data is written."""
        offsets = self.stream_plan.extent_offsets
        return stream_text(offsets, self.blob_lengths, records_to_json(self.records), self.tree)

    def blob_owner(self, index: int) -> str:
        """The key path of the first tensor stored in blob `index`, for messages."""
        return next((rec.key_path for rec in self.records if rec.blob == index), f"blob {index}")

    @property
    def backend(self) -> str:
        if self.handle is not None:
            return str(self.handle.backend)
        return _core.select_backend(self.config.backend)[0]

    # -- staging and the mutation guard ------------------------------------------------------

    def _check_staged(self, blobs: list[int]) -> bool:
        """The mutation guard, called by the job's thread as soon as `blobs` are staged whole.

        Each torch source's version counter (bumped by every in-place operation, shared by
        views) must still be what it was at flatten time: otherwise the staged bytes may mix
        two iterations, and the save fails for everyone. A change after this point is fine.
        """
        flat = self._flat
        if flat is None:
            return True
        for index in blobs:
            blob = flat.blobs[index]
            # Only torch sources are watched; a plain attribute read, as this runs once per tensor.
            now = blob.source._version  # type: ignore[union-attr]
            if now != blob.version:
                return self._torn(self.blob_owner(index), blob.version, now)
            for member in blob.members:  # a shared storage: each tensor of it, by its own counter
                now = member.tensor._version
                if now != member.version:
                    return self._torn(self.records[member.record].key_path, member.version, now)
        return True

    def _torn(self, key_path: str, before: int | None, now: int) -> bool:
        """Fails the save: the tensor at `key_path` changed before it was staged. Returns False."""
        self.verdict.fail(
            SaveCancelledError(
                f"tensor {shown(key_path)} was modified in place before the save of {self.path} had "
                f"copied it (version {before} -> {now}); call wait_staged() before optimizer.step(). The "
                "checkpoint was not committed; the previous one is untouched."
            )
        )
        return False

    def drop_sources(self) -> None:
        self._flat = None
        self._device = None

    # -- the pieces of a commit --------------------------------------------------------------

    def wait_written(self, timeout: float | None = None) -> Written:
        """Waits until this process's files are written (and durable); raises the save's verdict."""
        report: dict[str, Any] = {"parts": [], "bytes_written": 0, "staged_seconds": 0.0}
        try:
            if self.handle is not None:
                if self.layout.owner and timeout is None:
                    # The manifest is built (and cached) while the data is written, but only once
                    # staged: this runs on the thread SaveFuture starts inside the save call, and
                    # Python work here at once would hold the GIL while that call waits.
                    with contextlib.suppress(Exception):  # a failure is handle.wait's to raise
                        self.handle.wait_staged()
                    self.manifest_stream  # noqa: B018
                report = self.handle.wait(timeout)
        except TimeoutError:
            raise
        except BaseException as e:
            raise self.verdict.fail(e) or e from None
        finally:
            self.drop_sources_if_staged()
        if self.verdict.error is not None:
            raise self.verdict.error
        entries = [
            FileEntry(
                name=fname,
                stripe=stripe,
                writer=part.writer,
                stream_offset_bytes=part.stream_offset_bytes,
                len_bytes=part.len_bytes,
                chunk_crc32c=list(written["chunk_crc32c"]),
            )
            for (stripe, fname), part, written in zip(self.part_names, self.my_parts, report["parts"], strict=True)
        ]
        if self.increment is not None:
            entries = [self.increment.own_entry(e) for e in entries] + [link.entry for link in self.increment.links]
        if self.config.durable:
            for d in self.stripe_dirs_used:
                _core.fsync_dir(d)
                _core.fsync_dir(os.path.dirname(d))
            if self.layout.data_dir != self.layout.tmp_dir and os.path.isdir(self.layout.data_dir):
                _core.fsync_dir(self.layout.data_dir)
        self._written = time.perf_counter()
        return Written(entries, self.stripe_dirs, report)

    def manifest(self, entries: list[FileEntry], stripes: list[str], extra: dict[str, Any] | None = None) -> bytes:
        """This job's manifest, listing `entries` (from every writer, stripes indexing `stripes`)."""
        increment = self.increment
        return build(
            checkpoint_id=self.layout.checkpoint_id,
            chunk_bytes=self.stream_plan.chunk_bytes,
            checksum=self.config.checksum,
            total_bytes=self.stream_plan.total_bytes,
            files=entries,
            stripes=stripes,
            stream=self.manifest_stream,
            extra=extra,
            chunk_hashes=increment.hashes if increment is not None else None,
            incremental_depth=increment.depth if increment is not None else 0,
        )

    def publish(self, manifest: bytes) -> None:
        """Owner only: writes the manifest into the temporary directory and commits it atomically."""
        write_manifest(self.layout.tmp_dir, manifest, durable=self.config.durable)
        self.commit_tmp()

    def commit_tmp(self) -> None:
        """Owner only: atomically puts the finished temporary directory at the target path,
        unless the save's verdict is already a failure."""
        assert self.layout.owner
        check_target(self.path)
        exchanged = False

        def put_in_place() -> None:
            nonlocal exchanged
            exchanged = replace_as_last_writer(self.layout.tmp_dir, self.path)

        with held_for_removal(self.path, hold=self.hold_replaced) as old:  # no cleaner takes it for a leftover
            self.verdict.commit(put_in_place)
            if self.config.durable:
                _core.fsync_dir(os.path.dirname(self.path))
            self._release_tmp_lock()
            old.remove_later(self.layout.tmp_dir, self.config.stripes, exchanged=exchanged)

    def result(self, written: Written) -> SaveResult:
        seconds = time.perf_counter() - self.started
        nbytes = int(written.report["bytes_written"])
        staged = written.report.get("staged_seconds")
        phases = {
            "flatten_plan": self._laid_out - self.started,
            "staging": float(staged or 0.0),
            "write_fsync": float(written.report.get("seconds") or 0.0),
            "commit": time.perf_counter() - self._written,
        }
        result = SaveResult(
            path=self.path,
            nbytes=nbytes,
            seconds=seconds,
            staged_seconds=float(staged) if staged is not None else seconds,
            gb_per_s=nbytes / seconds / 1e9 if seconds > 0 else 0.0,
            backend=self.backend,
            files=[p["path"] for p in written.report["parts"]],
            phases=phases,
        )
        log_save(result.path, result.nbytes, result.seconds, result.backend)
        return result

    def finish(self, timeout: float | None = None) -> SaveResult:
        """Single process: waits for the data, writes the manifest, commits (unless failed)."""
        try:
            written = self.wait_written(timeout)
            self.publish(self.manifest(written.entries, written.stripe_dirs))
        except BaseException as e:
            error = self.verdict.fail(e) or e
            self.discard()
            if error is e:
                raise
            raise error from None
        return self.result(written)

    def discard(self) -> None:
        """Removes what this process created for a save that did not commit."""
        self.stop_engine()
        if self.increment is not None:
            self.increment.close()
        if self.verdict.committed:  # the new checkpoint is in place; the old tree is at tmp_dir
            remove_checkpoint_tree(self.layout.tmp_dir, self.config.stripes, owner_path=self.path)
        else:
            for d in reversed(self._created):
                if d in self.stripe_dirs_used:
                    remove_owned_dir(d)
                else:
                    shutil.rmtree(d, ignore_errors=True)
        self._release_tmp_lock()

    def _release_tmp_lock(self) -> None:
        if self.tmp_lock is not None:
            self.tmp_lock.release()
