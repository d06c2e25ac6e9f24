"""Describing and checking a checkpoint without building its state: what ``fp.inspect`` and
``fp.verify`` do once :mod:`~fastpersist.loading.opened` has opened it.

``describe`` reads the manifest only; ``check_chunks`` reads every data file a chunk at a time
(bounded memory) and checks each chunk's crc32c, through the checkpoint's directory handle.

Example:
    >>> import fastpersist as fp, torch
    >>> from fastpersist.loading.opened import opened_checkpoint
    >>> _ = fp.save({"w": torch.ones(2)}, "/tmp/fp-doc-examine")
    >>> with opened_checkpoint("/tmp/fp-doc-examine") as ck:
    ...     describe(ck)["tensors"], check_chunks(ck)["files"]
    (1, 1)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

from ..engine import check_part_file
from ..errors import ChecksumMismatchError, CorruptCheckpointError
from ..format.confine import check_data_files
from ..format.layout import data_file_origin
from ..format.manifest import FileEntry, Manifest
from ..format.quote import shown
from ..format.records import dtype_itemsize
from .opened import OpenedCheckpoint, opened_checkpoint, opened_shard
from .reading import checksum_error
from .relocate import StripeRoots, check_stripes_present, read_opened

__all__ = ["check_chunks", "describe", "inspect_checkpoint", "verify_checkpoint", "verify_file"]


def inspect_checkpoint(path: str | os.PathLike[str], stripe_roots: StripeRoots = None) -> dict[str, Any]:
    """:func:`fastpersist.inspect`: opens the checkpoint at `path` once and describes it."""
    with opened_checkpoint(path) as ck:
        return describe(ck, stripe_roots)


def verify_checkpoint(
    path: str | os.PathLike[str], progress: Callable[[int], object] | None = None, stripe_roots: StripeRoots = None
) -> dict[str, Any]:
    """:func:`fastpersist.verify`: opens the checkpoint at `path` once and checks every chunk."""
    with opened_checkpoint(path) as ck:
        return check_chunks(ck, progress, stripe_roots)


def describe(ck: OpenedCheckpoint, stripe_roots: StripeRoots = None) -> dict[str, Any]:
    """What :func:`fastpersist.inspect` returns for the opened checkpoint `ck` (its manifest only)."""
    m = read_opened(ck, stripe_roots)
    if m.shards:
        shards = []
        for name in m.shards:
            with opened_shard(ck, name) as shard_ck:
                shards.append(describe(shard_ck, stripe_roots))
        return _description(
            ck,
            m,
            shards=shards,
            tensors=sum(s["tensors"] for s in shards),
            bytes=sum(s["bytes"] for s in shards),
            total_bytes=sum(s["total_bytes"] for s in shards),
            files=[f for s in shards for f in s["files"]],
            tensor_list=[t for s in shards for t in s["tensor_list"]],
        )
    tensor_list = []
    for t in m.tensors:
        nbytes = math.prod(t.shape) * dtype_itemsize(t.kind, t.dtype)
        tensor_list.append(
            {
                "key": t.key_path,
                "kind": t.kind,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "device": t.device,
                "bytes": nbytes,
            }
        )
    return _description(
        ck,
        m,
        tensors=len(m.tensors),
        bytes=sum(t["bytes"] for t in tensor_list),
        total_bytes=m.total_bytes,
        files=[_file(ck, m, f) for f in m.files],
        tensor_list=tensor_list,
        **_incremental(m),
    )


def _file(ck: OpenedCheckpoint, m: Manifest, f: FileEntry) -> dict[str, Any]:
    """A data file as inspect shows it: with hashes (an Incremental save's step), which save wrote
    its bytes and how many of the stream's bytes the step reads from it."""
    out: dict[str, Any] = {"path": m.file_path(ck.root, f), "bytes": f.len_bytes, "chunks": len(f.chunk_crc32c)}
    if m.chunk_hashes is not None:
        out["written_by"] = data_file_origin(f.name, m.checkpoint_id)
        out["stream_bytes"] = sum(n for _, _, n in f.runs(m.chunk_bytes, m.total_bytes))
    return out


def _incremental(m: Manifest) -> dict[str, Any]:
    """An Incremental save's step: the stream bytes it wrote itself and those it links from the
    saves that wrote them (by the first 12 hex digits of their ids); nothing for another step."""
    if m.chunk_hashes is None:
        return {}
    own = m.checkpoint_id[:12]
    held: dict[str, int] = {}
    for f in m.files:
        origin = data_file_origin(f.name, m.checkpoint_id)
        held[origin] = held.get(origin, 0) + sum(n for _, _, n in f.runs(m.chunk_bytes, m.total_bytes))
    return {
        "incremental": {
            "depth": m.incremental_depth,
            "wrote_bytes": held.pop(own, 0),
            "refers_to": dict(sorted(held.items())),
        }
    }


def _description(
    ck: OpenedCheckpoint, m: Manifest, *, tensor_list: list[dict[str, Any]], **sizes: Any
) -> dict[str, Any]:
    """The inspect dict: what the manifest says of itself, then `sizes` (the shards' sums, or its own)."""
    return {
        "path": ck.root,
        "format_version": f"{m.format_version[0]}.{m.format_version[1]}",
        "created": m.created,
        "checkpoint_id": m.checkpoint_id,
        "library_version": m.library_version,
        **sizes,
        "checksum": m.checksum,
        "chunk_bytes": m.chunk_bytes,
        "tensor_list": tensor_list,
    }


def check_chunks(
    ck: OpenedCheckpoint, progress: Callable[[int], object] | None = None, stripe_roots: StripeRoots = None
) -> dict[str, Any]:
    """What :func:`fastpersist.verify` does for the opened checkpoint `ck`; returns
    ``{"files", "bytes", "chunks"}``."""
    m = read_opened(ck, stripe_roots)
    if m.shards:
        totals = []
        for name in m.shards:
            with opened_shard(ck, name) as shard_ck:
                totals.append(check_chunks(shard_ck, progress, stripe_roots))
        return {key: sum(t[key] for t in totals) for key in ("files", "bytes", "chunks")}
    check_stripes_present(m, ck.root)
    check_data_files(ck.at, m, stripe_roots)
    chunks = 0
    for f in m.files:
        chunks += verify_file(ck.at, m, f, progress)
    return {"files": len(m.files), "bytes": m.total_bytes, "chunks": chunks}


def verify_file(root: str, m: Manifest, f: FileEntry, progress: Callable[[int], object] | None) -> int:
    """Checks every chunk of the data file `f` of the checkpoint at `root`; returns the chunk count."""
    file_path = m.file_path(root, f)
    try:
        fd = os.open(file_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"data file {shown(file_path, 300)} named in the manifest is missing") from None
    try:
        size = os.fstat(fd).st_size
        if size != f.len_bytes:
            raise CorruptCheckpointError(
                f"{shown(file_path, 300)} has the wrong size (truncated?): expected {f.len_bytes} bytes, found {size}"
            )
    finally:
        os.close(fd)
    try:
        check_part_file(file_path, f.len_bytes, f.chunk_crc32c, m.chunk_bytes, progress)  # the engine's reads
    except ChecksumMismatchError as e:  # the engine names the range; the manifest names its tensors
        assert e.offset_bytes is not None and e.len_bytes is not None and e.expected is not None and e.found is not None
        raise checksum_error(m, root, file_path, e.offset_bytes, e.len_bytes, e.expected, e.found) from None
    return len(f.chunk_crc32c)
