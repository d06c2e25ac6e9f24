"""``torch.distributed.checkpoint`` storage plug-in: DCP plans, fastpersist writes and checks.

DCP's planners decide what each rank saves (deduplicating replicated tensors, keeping shards)
and what each rank loads (resharding to whatever layout the loading job has). These classes
only store the bytes: each rank writes all its items as one file through the fastpersist
engine (large aligned O_DIRECT writes, crc32c per chunk, fsync), and the coordinator commits
the checkpoint by writing DCP's ``.metadata`` last (temporary name, fsync, rename, fsync the
directory). Reads go through the engine too, only the chunks holding what the load plan asks
for, and every chunk read has its checksum verified.

Example:
    >>> import torch.distributed.checkpoint as dcp
    >>> from fastpersist.integrations.dcp import FastPersistReader, FastPersistWriter
    >>> dcp.save(state, storage_writer=FastPersistWriter("ckpt/step-100"))    # doctest: +SKIP
    >>> dcp.load(state, storage_reader=FastPersistReader("ckpt/step-100"))    # doctest: +SKIP

``dcp.async_save(state, storage_writer=FastPersistWriter(path))`` works too: the writer stages
the state into one of the process's staging arenas (integrations/dcp_staging.py), then DCP
calls it from its background thread.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

import fastpersist._core as _core

from ..config import Config
from ..engine import JobHooks, WriteOptions, WriteRequest, read_ranges, start_write
from ..errors import CorruptCheckpointError
from ..format.blobs import byte_view
from ..format.layout import DCP_DATA_SUFFIX, DCP_METADATA_NAME, dcp_data_file_name, write_small_file
from ..format.quote import shown
from ..gpu.copiers import copier_for, device_bytes
from ..gpu.device_side import stage_from_devices
from ..loading.reading import aligned_uint8, direct_padded
from ..saving.pools import pool_for
from .dcp_args import checked_config, refuse_rank_local_metadata, writer_config
from .dcp_metadata import read_dcp_metadata
from .dcp_ranges import FileReads, box_view, needed_spans, plan_file_reads, stored_dtype
from .dcp_staging import ArenaStaging

__all__ = ["FastPersistReader", "FastPersistWriter", "ItemInfo"]

log = logging.getLogger("fastpersist")


@dataclass(frozen=True)
class ItemInfo:
    """Where one DCP item lives: a file of the checkpoint, a byte range, and how to view it.

    ``chunk_crc32c`` (the file's chunk checksums) is set on the first item of each file only.
    """

    relative_path: str
    offset_bytes: int
    len_bytes: int
    dtype: str | None = None  # None: a BYTE_IO item
    shape: tuple[int, ...] = ()
    file_bytes: int = 0
    chunk_bytes: int = 0
    chunk_crc32c: tuple[int, ...] | None = None


class _LocalDirectory:
    """What the writer and the reader say of their checkpoint id: a local directory."""

    path: str

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint directory (as ``FileSystemWriter``/``FileSystemReader`` say it)."""
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any local path will do."""
        return isinstance(checkpoint_id, (str, os.PathLike))


class FastPersistWriter(_LocalDirectory, StorageWriter, ArenaStaging, BlockingAsyncStager):
    """A DCP ``StorageWriter`` that writes through the fastpersist engine.

    It takes ``FileSystemWriter``'s arguments (by keyword) with the same meaning where the
    engine has one, so code can swap the class; ``config`` holds the engine's own knobs.

    Args:
        path: the checkpoint directory (created if missing).
        config: engine knobs (``chunk_bytes``, ``backend``, ``direct_io``, ``checksum``,
            ``durable``, ...); ``stripes`` is not used here.
        single_file_per_rank: ``True``: one data file per rank; ``False``: one per item, as
            ``FileSystemWriter`` does (each still written with the engine and checksummed).
        sync_files: fsync the data files, ``.metadata`` and the directory before the save
            returns; the same switch as ``Config(durable=...)``, and it wins over the config's
            (``None``: the config's, ``True`` unless set); ``True`` with ``durable=False`` is refused.
        thread_count: accepted and kept, changes nothing: ``FileSystemWriter`` needs threads
            to have several writes in flight, the engine keeps ``config.queue_depth`` aligned
            writes in flight from one thread (io_uring, or its own thread pool).
        per_thread_copy_ahead: accepted and kept, changes nothing: the engine stages through
            ``config.pool_bytes`` of page-aligned memory whatever this says.
        cache_staged_state_dict: for ``dcp.async_save``: keep the CPU copy of the state
            between saves and copy into it (``BlockingAsyncStager``'s meaning).
        overwrite: ``False`` refuses a directory that already holds a checkpoint (a
            ``.metadata``), as ``FileSystemWriter`` does; ``True`` replaces it (the new
            ``.metadata`` is renamed over the old one, then the old data files are removed).
        _extensions: stream transforms (``ZStandard``, ...) are refused: see below.
        serialization_format: accepted, changes nothing: items are always stored as raw
            bytes in fastpersist's files (what ``SAFETENSORS`` stores), which only
            :class:`FastPersistReader` reads.

    Raises:
        NotImplementedError: ``_extensions`` is not empty. Items are written as raw aligned
            bytes checksummed per chunk so that a load can read only the ranges it needs; a
            compressed stream has no such ranges. Use ``FileSystemWriter`` to compress.
        ValueError: ``sync_files=True`` with ``config.durable=False``, or a count out of range.
        TypeError: ``config`` is not a :class:`~fastpersist.Config` (pass
            ``FileSystemWriter``'s arguments by keyword).

    Example:
        >>> w = FastPersistWriter("/tmp/fp-dcp-doc", sync_files=False, thread_count=4, overwrite=False)
        >>> w.config.durable, w.thread_count
        (False, 4)
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: Config | None = None,
        *,
        single_file_per_rank: bool = True,
        sync_files: bool | None = None,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Sequence[object] | None = None,
        serialization_format: object = None,
    ) -> None:
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        config = writer_config(config, sync_files, thread_count, per_thread_copy_ahead, _extensions)
        self.path = os.path.abspath(os.fspath(path))
        self.config = config
        self.single_file_per_rank = bool(single_file_per_rank)
        self.sync_files = config.durable
        self.thread_count = thread_count
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.overwrite = bool(overwrite)
        self.serialization_format = serialization_format
        self.rank = 0
        self.is_coordinator = True
        ArenaStaging.__init__(self)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Points the writer at `checkpoint_id` (a directory) when DCP passes one."""
        if checkpoint_id is not None:
            self.path = os.path.abspath(os.fspath(checkpoint_id))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Records this rank's role; refuses ``use_collectives=False`` on several ranks."""
        refuse_rank_local_metadata(kwargs.get("use_collectives", True))
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        self.rank = int(rank or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Creates the checkpoint directory; with ``overwrite=False`` refuses one that holds a checkpoint."""
        os.makedirs(self.path, exist_ok=True)
        if not self.overwrite and os.path.exists(os.path.join(self.path, DCP_METADATA_NAME)):
            raise RuntimeError(
                f"Checkpoint already exists and self.overwrite=False: {self.path}/{DCP_METADATA_NAME} "
                "(pass overwrite=True to replace it, or save to another directory)"
            )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Gives every rank a file name unique to this save (an interrupted save never clobbers a committed one)."""
        save_id = uuid.uuid4().hex[:12]
        return [dataclasses.replace(p, storage_data=dcp_data_file_name(i, save_id)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Writes this rank's items as one engine write (or one per item with
        ``single_file_per_rank=False``); the future holds their WriteResults."""
        name = str(plan.storage_data or dcp_data_file_name(self.rank, uuid.uuid4().hex[:12]))
        items = [(item, *_source(item, planner.resolve_data(item))) for item in plan.items]
        try:
            if self.single_file_per_rank:
                results = self._write_file(name, items)
            else:
                stem = name.removesuffix(DCP_DATA_SUFFIX)
                results = [
                    r for i, one in enumerate(items) for r in self._write_file(f"{stem}_{i}{DCP_DATA_SUFFIX}", [one])
                ]
        finally:
            self._release_written([source for _, source, _, _ in items])
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_file(
        self, name: str, items: list[tuple[WriteItem, np.ndarray | torch.Tensor, str | None, tuple[int, ...]]]
    ) -> list[WriteResult]:
        started = time.perf_counter()
        cfg = self.config.resolved_for(self.path)  # each rank's file records its own chunk size
        engine_plan = _core.Plan([source.nbytes for _, source, _, _ in items], 1, 1, cfg.resolved_chunk_bytes)

        report: Any = {"parts": [], "backend": "none"}
        if engine_plan.total_bytes:  # a rank with nothing (or only empty tensors) to write writes no file
            target = os.path.join(self.path, name)
            sources, device = stage_from_devices(
                [source for _, source, _, _ in items], engine_plan, pinned_bytes=cfg.pinned_bytes, what=target
            )
            request = WriteRequest(
                plan=engine_plan,
                paths=[target],
                sources=sources,
                pool=pool_for(cfg),
                options=WriteOptions.of(cfg),
                hooks=JobHooks(device=device),
            )
            report = start_write(request).wait()
        part = report["parts"][0] if report["parts"] else None
        results = []
        for i, (item, source, dtype, shape) in enumerate(items):
            info = ItemInfo(
                name,
                engine_plan.extent_offsets[i],
                source.nbytes,
                dtype,
                shape,
                file_bytes=engine_plan.total_bytes,
                chunk_bytes=engine_plan.chunk_bytes,
                chunk_crc32c=tuple(part["chunk_crc32c"]) if i == 0 and part else None,
            )
            results.append(WriteResult(index=item.index, size_in_bytes=source.nbytes, storage_data=info))
        seconds = time.perf_counter() - started
        log.info(
            "dcp write rank %d: %d bytes in %.3f s (%.2f GB/s, %s) to %s",
            self.rank,
            engine_plan.total_bytes,
            seconds,
            engine_plan.total_bytes / seconds / 1e9 if seconds > 0 else 0.0,
            report["backend"],
            os.path.join(self.path, name),
        )
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: writes ``.metadata`` last and durably; removes data files of older saves."""
        storage: dict[MetadataIndex, ItemInfo] = {}
        for rank_results in results:
            for r in rank_results:
                storage[r.index] = r.storage_data
        metadata.storage_data = storage
        write_small_file(
            os.path.join(self.path, DCP_METADATA_NAME), pickle.dumps(metadata), durable=self.config.durable
        )
        live = {info.relative_path for info in storage.values()}
        for name in os.listdir(self.path):
            if name.endswith(DCP_DATA_SUFFIX) and name not in live:
                os.remove(os.path.join(self.path, name))


def _source(item: WriteItem, data: object) -> tuple[np.ndarray | torch.Tensor, str | None, tuple[int, ...]]:
    """An item's bytes as a flat uint8 array, with its dtype name (None: bytes) and shape; a
    tensor a device copier stages stays on its device (a 1-D uint8 view) and is staged through
    the arena, as a checkpoint's tensors are."""
    if item.type == WriteItemType.BYTE_IO:
        assert isinstance(data, io.BytesIO)
        return np.frombuffer(data.getbuffer(), np.uint8).copy(), None, ()
    assert isinstance(data, torch.Tensor)
    dtype, shape = str(data.dtype).removeprefix("torch."), tuple(data.shape)
    t = data.detach().contiguous()
    if t.numel() and copier_for(t) is not None:
        return device_bytes(t), dtype, shape
    t = t.to("cpu")
    return byte_view(t), dtype, shape


class FastPersistReader(_LocalDirectory, StorageReader):
    """A DCP ``StorageReader`` for checkpoints written by :class:`FastPersistWriter`.

    Each rank reads only the chunks holding the regions its load plan asks for (a resharded
    load on many ranks reads each byte about once), all files in one engine call with every
    chunk's crc32c verified; a chunk needed only in part is read whole so that its checksum can
    be checked. Damage in a chunk no rank needs does not fail a load.

    Args:
        path: the checkpoint directory.
        config: engine knobs for reading (``backend``, ``direct_io``, ``queue_depth``).
        _extension_registry: ``FileSystemReader``'s, accepted (by keyword) and never needed:
            checkpoints written by :class:`FastPersistWriter` hold no stream transforms.

    Example:
        >>> FastPersistReader("/tmp/fp-dcp-doc", Config(direct_io="off")).config.direct_io
        'off'
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: Config | None = None,
        *,
        _extension_registry: object = None,
    ) -> None:
        super().__init__()
        self.path = os.path.abspath(os.fspath(path))
        self.config = checked_config(config, "FastPersistReader", "FileSystemReader")
        # Kept for FileSystemReader's callers; never consulted, as FastPersistWriter refuses
        # stream transforms, so no item of a checkpoint it wrote names one.
        self._extension_registry = _extension_registry
        self.storage: dict[MetadataIndex, ItemInfo] = {}
        self._crcs: dict[str, list[int]] = {}
        #: What the engine reported over this reader's loads: ``bytes`` read, ``crc32c_s``.
        self.read_stats: dict[str, float] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Points the reader at `checkpoint_id` (a directory) when DCP passes one."""
        if checkpoint_id is not None:
            self.path = os.path.abspath(os.fspath(checkpoint_id))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Reads ``.metadata`` (a restricted unpickler: no code from the file runs)."""
        return read_dcp_metadata(self.path)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Keeps the item locations and each file's chunk checksums from the metadata."""
        self.storage = metadata.storage_data
        self._crcs = {i.relative_path: list(i.chunk_crc32c) for i in self.storage.values() if i.chunk_crc32c}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Unchanged: DCP's planner decides what this rank reads."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Unchanged."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads only the chunks holding the requested regions, of every file in one engine call
        (checksums verified), and hands every item to the planner."""

        started = time.perf_counter()
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage[item.storage_index].relative_path, []).append(item)
        planned: list[tuple[list[ReadItem], FileReads, list[int]]] = []
        # by chunk size (the engine reads one chunk size per call; ranks may have had their own)
        ranges: dict[int, list[tuple[str, int, int, int, int, list[int]]]] = {}
        total = 0
        for _, items in sorted(per_file.items()):
            reads = self._file_reads(items)
            slots = []  # each window's offset in the one buffer all files are read into
            for window in reads.windows:
                slots.append(total)
                total += direct_padded(window.hi_bytes - window.lo_bytes)
            chunk_bytes = self.storage[items[0].storage_index].chunk_bytes
            ranges.setdefault(chunk_bytes, []).extend(self._ranges(items[0], reads, slots))
            planned.append((items, reads, slots))
        buf = aligned_uint8(total)
        stats: dict[str, float] = {}
        for chunk_bytes, chunk_ranges in ranges.items():
            read_ranges(
                chunk_ranges,
                buf.numpy(),
                chunk_bytes=chunk_bytes,
                backend=self.config.backend,
                direct_io=self.config.direct_io,
                queue_depth=self.config.resolved_for(self.path, "read").resolved_queue_depth,
                stats=stats,
                named_in=f"{self.path}/{DCP_METADATA_NAME}",
            )
        for items, reads, slots in planned:
            for item, w in zip(items, reads.window_of_item, strict=True):
                info = self.storage[item.storage_index]
                if w < 0:  # nothing to read: an empty region
                    raw, start = buf[:0], 0
                else:
                    window = reads.windows[w]
                    raw = buf[slots[w] : slots[w] + window.hi_bytes - window.lo_bytes]
                    start = info.offset_bytes - window.lo_bytes
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(raw[start : start + info.len_bytes].numpy().tobytes()))
                else:
                    _copy_item(item, info, raw, start, planner)
        for key, value in stats.items():
            self.read_stats[key] = self.read_stats.get(key, 0) + value
        log.info(
            "dcp read: %d bytes of %d files in %.3f s for %d items from %s",
            stats.get("bytes", 0),
            len(per_file),
            time.perf_counter() - started,
            len(plan.items),
            self.path,
        )
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _file_reads(self, items: list[ReadItem]) -> FileReads:
        """The windows and chunks of one file that `items` (all in that file) need."""
        info = self.storage[items[0].storage_index]
        if not info.file_bytes:
            return FileReads([], [-1] * len(items))
        spans = []
        for item in items:
            at = self.storage[item.storage_index].offset_bytes
            spans.append([(at + a, at + b) for a, b in needed_spans(item, self.storage[item.storage_index])])
        return plan_file_reads(spans, info.chunk_bytes, info.file_bytes)

    def _ranges(
        self, item: ReadItem, reads: FileReads, slots: list[int]
    ) -> list[tuple[str, int, int, int, int, list[int]]]:
        """The engine's read ranges, with their checksums, for the chunks of the file holding `item`."""
        info = self.storage[item.storage_index]
        crcs = self._crcs.get(info.relative_path, [])
        path = os.path.join(self.path, info.relative_path)
        ranges = []
        for window, slot in zip(reads.windows, slots, strict=True):
            for lo, hi in window.chunks:
                first = lo // info.chunk_bytes
                checked = crcs[first : first + _core.chunk_count(hi - lo, info.chunk_bytes)]
                ranges.append((path, info.file_bytes, lo, hi - lo, slot + lo - window.lo_bytes, checked))
        return ranges


def _copy_item(item: ReadItem, info: ItemInfo, raw: torch.Tensor, start_bytes: int, planner: LoadPlanner) -> None:
    """Copies the requested box of the item stored at `start_bytes` of `raw` (which may begin
    after the item's first byte, so `start_bytes` may be negative) into the planner's tensor."""
    target = planner.resolve_tensor(item).detach()
    lengths = list(item.lengths)
    if target.shape != torch.Size(lengths):
        raise CorruptCheckpointError(
            f"DCP item {shown(item.storage_index.fqn)}: stored region {lengths} != requested {list(target.shape)}"
        )
    if target.numel():
        target.copy_(box_view(raw, start_bytes, info.shape, stored_dtype(item, info), item.storage_offsets, lengths))
    planner.commit_tensor(item, target)
