"""``torch.distributed.checkpoint`` storage plug-in: DCP plans, fastpersist writes and checks.

DCP's planners decide what each rank saves (deduplicating replicated tensors, keeping shards)
and what each rank loads (resharding to whatever layout the loading job has). These classes
only store the bytes: each rank writes all its items as one file through the fastpersist
engine (large aligned O_DIRECT writes, crc32c per chunk, fsync), and the coordinator commits
the checkpoint by writing DCP's ``.metadata`` last (temporary name, fsync, rename, fsync the
directory). Reads go through the engine too, and every chunk's checksum is verified.

Example:
    >>> import torch.distributed.checkpoint as dcp
    >>> from fastpersist.integrations.dcp import FastPersistReader, FastPersistWriter
    >>> dcp.save(state, storage_writer=FastPersistWriter("ckpt/step-100"))    # doctest: +SKIP
    >>> dcp.load(state, storage_reader=FastPersistReader("ckpt/step-100"))    # doctest: +SKIP

``dcp.async_save(state, storage_writer=FastPersistWriter(path))`` works too (DCP stages the
state to CPU, then calls the writer from its background thread).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import time
import uuid
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
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .. import _core
from ..config import Config
from ..errors import CorruptCheckpointError
from ..format.layout import DCP_DATA_SUFFIX, DCP_METADATA_NAME, dcp_data_file_name, write_small_file
from ..format.quote import shown
from ..format.records import TORCH_DTYPES

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


class FastPersistWriter(StorageWriter):
    """A DCP ``StorageWriter`` that writes through the fastpersist engine.

    Args:
        path: the checkpoint directory (created if missing).
        config: engine knobs (``chunk_bytes``, ``backend``, ``direct_io``, ``checksum``,
            ``durable``, ...); ``stripes`` is not used here.
    """

    def __init__(self, path: str | os.PathLike[str], config: Config | None = None) -> None:
        super().__init__()
        self.path = os.path.abspath(os.fspath(path))
        self.config = config or Config()
        self.rank = 0
        self.is_coordinator = True

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Points the writer at `checkpoint_id` (a directory) when DCP passes one."""
        if checkpoint_id is not None:
            self.path = os.path.abspath(os.fspath(checkpoint_id))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Records this rank's role."""
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        self.rank = int(rank or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Creates the checkpoint directory."""
        os.makedirs(self.path, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Gives every rank a file name unique to this save (an interrupted save never clobbers a committed one)."""
        save_id = uuid.uuid4().hex[:12]
        return [dataclasses.replace(p, storage_data=dcp_data_file_name(i, save_id)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Writes this rank's items as one engine write; the future holds their WriteResults."""
        started = time.perf_counter()
        name = str(plan.storage_data or dcp_data_file_name(self.rank, uuid.uuid4().hex[:12]))
        sources: list[np.ndarray] = []
        shapes: list[tuple[str | None, tuple[int, ...]]] = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                sources.append(np.frombuffer(data.getbuffer(), np.uint8).copy())
                shapes.append((None, ()))
            else:
                assert isinstance(data, torch.Tensor)
                t = data.detach().to("cpu").contiguous()
                sources.append(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8))
                shapes.append((str(t.dtype).removeprefix("torch."), tuple(t.shape)))
        cfg = self.config.resolved_for(self.path)  # each rank's file records its own chunk size
        engine_plan = _core.Plan([s.nbytes for s in sources], 1, 1, cfg.resolved_chunk_bytes)
        from ..saving.pools import pool_for

        report: Any = {"parts": [], "backend": "none"}
        if engine_plan.total_bytes:  # a rank with nothing (or only empty tensors) to write writes no file
            report = _core.start_write(
                engine_plan,
                0,
                [os.path.join(self.path, name)],
                sources,
                pool_for(cfg),
                backend=cfg.backend,
                direct_io=cfg.direct_io,
                queue_depth=cfg.resolved_queue_depth,
                checksum=cfg.checksum == "crc32c",
                durable=cfg.durable,
            ).wait()
        part = report["parts"][0] if report["parts"] else None
        results = []
        for i, (item, source, (dtype, shape)) in enumerate(zip(plan.items, sources, shapes, strict=True)):
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
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

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

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any local path will do."""
        return isinstance(checkpoint_id, (str, os.PathLike))


class _MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's metadata without running code from the file: only DCP's data classes,
    torch dtypes / sizes / layouts / memory formats and a few builtins may appear."""

    _BUILTINS = frozenset({"set", "frozenset", "slice", "tuple", "list", "dict", "bytearray", "complex"})

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint.") or (module == __name__ and name == "ItemInfo"):
            return super().find_class(module, name)
        if (module, name) == ("torch.serialization", "_get_layout"):  # a name -> torch.layout lookup
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if value is torch.Size or isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        if (module, name) in {("collections", "OrderedDict"), ("builtins", name)} and (
            module != "builtins" or name in self._BUILTINS
        ):
            return super().find_class(module, name)
        raise CorruptCheckpointError(
            f"DCP metadata refers to {shown(f'{module}.{name}')}, which a checkpoint never needs"
        )


class FastPersistReader(StorageReader):
    """A DCP ``StorageReader`` for checkpoints written by :class:`FastPersistWriter`.

    Each rank reads the files holding the items its load plan asks for (through the engine,
    every chunk's crc32c verified) and copies each item's requested region into place.
    """

    def __init__(self, path: str | os.PathLike[str], config: Config | None = None) -> None:
        super().__init__()
        self.path = os.path.abspath(os.fspath(path))
        self.config = config or Config()
        self.storage: dict[MetadataIndex, ItemInfo] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Points the reader at `checkpoint_id` (a directory) when DCP passes one."""
        if checkpoint_id is not None:
            self.path = os.path.abspath(os.fspath(checkpoint_id))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Reads ``.metadata`` (a restricted unpickler: no code from the file runs)."""
        path = os.path.join(self.path, DCP_METADATA_NAME)
        with open(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
                raise CorruptCheckpointError(f"{path}: unreadable DCP metadata ({e})") from None
        if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
            raise CorruptCheckpointError(f"{path}: not a checkpoint written by FastPersistWriter")
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Keeps the item locations from the metadata."""
        self.storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Unchanged: DCP's planner decides what this rank reads."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Unchanged."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads the needed files (checksums verified) and hands every item to the planner."""
        files = {self.storage[item.storage_index].relative_path for item in plan.items}
        buffers = {name: self._read_file(name) for name in sorted(files)}
        for item in plan.items:
            info = self.storage[item.storage_index]
            raw = buffers[info.relative_path][info.offset_bytes : info.offset_bytes + info.len_bytes]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(raw.numpy().tobytes()))
                continue
            _copy_item(item, info, raw, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_file(self, name: str) -> torch.Tensor:
        from ..loading.reading import aligned_uint8

        first = next((i for i in self.storage.values() if i.relative_path == name and i.chunk_crc32c is not None), None)
        any_item = first or next(i for i in self.storage.values() if i.relative_path == name)
        if not any_item.file_bytes:
            return torch.empty(0, dtype=torch.uint8)
        buf = aligned_uint8(any_item.file_bytes)
        crcs = list(first.chunk_crc32c or ()) if first else []
        path = os.path.join(self.path, name)
        try:
            _core.read_ranges_into(
                [(path, any_item.file_bytes, 0, any_item.file_bytes, 0, crcs)],
                buf.numpy(),
                chunk_bytes=any_item.chunk_bytes,
                backend=self.config.backend,
                direct_io=self.config.direct_io,
                queue_depth=self.config.resolved_for(path, "read").resolved_queue_depth,
            )
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{shown(path, 300)}, named in {self.path}/{DCP_METADATA_NAME}, is missing"
            ) from None
        return buf[: any_item.file_bytes]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any local path will do."""
        return isinstance(checkpoint_id, (str, os.PathLike))


def _copy_item(item: ReadItem, info: ItemInfo, raw: torch.Tensor, planner: LoadPlanner) -> None:
    dtype = TORCH_DTYPES.get(info.dtype or "")
    if dtype is None:
        raise CorruptCheckpointError(f"DCP item {shown(item.storage_index.fqn)}: unknown dtype {shown(info.dtype)}")
    stored = raw.view(dtype).reshape(info.shape) if raw.numel() else torch.empty(info.shape, dtype=dtype)
    for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
        stored = stored.narrow(dim, offset, length)
    target = planner.resolve_tensor(item).detach()
    if target.shape != stored.shape:
        raise CorruptCheckpointError(
            f"DCP item {shown(item.storage_index.fqn)}: stored region {list(stored.shape)} != requested "
            f"{list(target.shape)}"
        )
    target.copy_(stored)
    planner.commit_tensor(item, target)
