"""``torch_save``: a file ``torch.load`` reads unchanged, written through the fastpersist engine.

``torch.save`` streams its zip archive through many small buffered writes and computes a CRC-32
of every byte. Here torch composes the archive *without the data*: under
``torch.serialization.skip_data()`` its zip writer emits every header, the pickle and the
central directory, and seeks over each storage's bytes. A small file-like object records those
writes (the skeleton) and seeks (the holes), and a pickler hook records which storage each hole
belongs to. The skeleton pieces and the storages then become the extents of one engine plan,
written with large aligned O_DIRECT writes, fsynced, and renamed into place.

The engine lays extents at 64-byte-aligned offsets; torch aligns every storage record to 64
bytes too (``storage_alignment``). So extent boundaries are put where both agree: a storage's
bytes up to its last 64-byte boundary are one extent (zero-copy), and its unaligned tail is
copied in front of the skeleton bytes that follow it. The composed file is byte-identical to
``torch.save(obj, io.BytesIO())`` with CRC-32 off (``torch.load`` does not check CRCs; the zip
CRC fields of storage records are 0, as with ``skip_data``).

Any surprise in torch's private behaviour (a hole that does not match a storage, an unaligned
record) makes ``torch_save`` fall back to plain ``torch.save`` + fsync, with a warning.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import threading
import time
import types
from dataclasses import dataclass, field
from typing import IO, Any, cast

import numpy as np
import torch

from .. import _core
from ..config import Config, SaveResult
from ..format.layout import atomic_file

__all__ = ["torch_save"]

log = logging.getLogger("fastpersist")

_ALIGN = 64  # torch's default storage_alignment; also the engine's EXTENT_ALIGN_BYTES
_config_lock = threading.Lock()  # torch's serialization config is process-global


@dataclass
class Skeleton:
    """What torch wrote without data: bytes at offsets, holes where storages go, their storages."""

    pieces: list[tuple[int, bytes]] = field(default_factory=list)
    holes: list[tuple[int, int]] = field(default_factory=list)
    storages: dict[str, torch.UntypedStorage] = field(default_factory=dict)
    total_bytes: int = 0


class _Capture(io.RawIOBase):
    """A write-only file that keeps written bytes and records seeks over storage bodies."""

    def __init__(self, skeleton: Skeleton) -> None:
        super().__init__()
        self.skel = skeleton
        self.pos = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        if data:
            self.skel.pieces.append((self.pos, data))
            self.pos += len(data)
            self.skel.total_bytes = max(self.skel.total_bytes, self.pos)
        return len(data)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        target = {os.SEEK_SET: offset, os.SEEK_CUR: self.pos + offset}.get(whence)
        if target is None or target < self.pos:
            raise io.UnsupportedOperation("torch_save's capture only seeks forward")
        if target > self.pos:
            self.skel.holes.append((self.pos, target - self.pos))
        self.pos = target
        self.skel.total_bytes = max(self.skel.total_bytes, self.pos)
        return self.pos

    def tell(self) -> int:
        return self.pos


def _hook_module(skeleton: Skeleton) -> types.SimpleNamespace:
    """A ``pickle_module`` whose Pickler records torch's storage keys (``("storage", type, key, ...)``)."""

    class Pickler(pickle.Pickler):
        def __init_subclass__(cls, **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            inner = cls.persistent_id

            def persistent_id(self: Any, obj: Any) -> Any:
                pid = inner(self, obj)
                if isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage":
                    storage = obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj
                    skeleton.storages[str(pid[2])] = storage
                return pid

            cls.persistent_id = persistent_id  # type: ignore[method-assign]

    return types.SimpleNamespace(Pickler=Pickler, Unpickler=pickle.Unpickler, __name__="fastpersist_pickle")


def capture_skeleton(obj: object, pickle_protocol: int = 2) -> Skeleton:
    """Runs ``torch.save`` without data and returns the skeleton (see the module docstring)."""
    from torch.utils.serialization import config

    skel = Skeleton()
    with _config_lock:
        saved = (config.save.storage_alignment, config.save.compute_crc32)
        config.save.storage_alignment, config.save.compute_crc32 = _ALIGN, False
        try:
            with torch.serialization.skip_data():
                torch.save(
                    obj,
                    cast(IO[bytes], _Capture(skel)),
                    pickle_module=_hook_module(skel),
                    pickle_protocol=pickle_protocol,
                )
        finally:
            config.save.storage_alignment, config.save.compute_crc32 = saved
    return skel


def _byte_array(storage: torch.UntypedStorage) -> np.ndarray:
    if storage.device.type != "cpu":
        storage = storage.cpu()  # type: ignore[no-untyped-call]
    t = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    return t.numpy()


def compose_extents(skel: Skeleton) -> list[np.ndarray]:
    """The engine extents that, laid out by a plan, reproduce the file byte for byte.

    Raises ValueError when torch's skeleton is not what this module expects.
    """
    keys = sorted((k for k, s in skel.storages.items() if s.nbytes() > 0), key=int)
    if len(keys) != len(skel.holes):
        raise ValueError(f"{len(skel.holes)} holes in the archive but {len(keys)} non-empty storages")
    extents: list[np.ndarray] = []
    pending: list[np.ndarray] = []  # bytes of the extent being assembled (tails + skeleton bytes)
    cursor = 0
    pieces = iter(skel.pieces)
    next_piece = next(pieces, None)

    def take_skeleton(until: int) -> None:
        nonlocal cursor, next_piece
        while cursor < until:
            if next_piece is None or next_piece[0] != cursor:
                raise ValueError(f"the archive skeleton has a gap at byte {cursor}")
            off, data = next_piece
            if off + len(data) > until:
                raise ValueError(f"skeleton bytes at {off} overlap the storage at {until}")
            pending.append(np.frombuffer(data, np.uint8))
            cursor = off + len(data)
            next_piece = next(pieces, None)

    for key, (hole_at, hole_bytes) in zip(keys, skel.holes, strict=True):
        storage = skel.storages[key]
        if storage.nbytes() != hole_bytes or hole_at % _ALIGN:
            raise ValueError(f"storage {key} ({storage.nbytes()} bytes) does not fit the hole at {hole_at}")
        take_skeleton(hole_at)
        if pending:
            extents.append(np.concatenate(pending) if len(pending) > 1 else pending[0])
            pending = []
        data = _byte_array(storage)
        head = hole_bytes - hole_bytes % _ALIGN
        if head:
            extents.append(data[:head])
        if head < hole_bytes:
            pending.append(data[head:].copy())
        cursor = hole_at + hole_bytes
    take_skeleton(skel.total_bytes)
    if pending:
        extents.append(np.concatenate(pending) if len(pending) > 1 else pending[0])
    return extents


def _fallback(obj: object, path: str, pickle_protocol: int, why: str) -> None:
    log.warning("torch_save fell back to torch.save for %s: %s", path, why)
    torch.save(obj, path, pickle_protocol=pickle_protocol)
    _core.fsync_path(path)
    _core.fsync_dir(os.path.dirname(path) or ".")


def torch_save(
    obj: object,
    path: str | os.PathLike[str] | IO[bytes],
    *,
    pickle_protocol: int = 2,
    config: Config | None = None,
) -> SaveResult:
    """A drop-in for ``torch.save(obj, path)`` that writes with large aligned writes.

    The file is a regular torch zip archive: ``torch.load(path)`` reads it unchanged, also with
    ``weights_only=True`` and ``mmap=True``. It is written to a temporary name, fsynced and
    renamed into place (durable on return when ``config.durable``, the default). CRC-32 fields
    of the zip records are 0 (``torch.load`` does not check them; ``fastpersist convert`` to our
    format gives a checksummed copy). If torch's internals are not as expected, this falls back
    to ``torch.save`` + fsync and logs a warning. A file object instead of a path is handed to
    ``torch.save`` as is.

    Example:
        >>> import fastpersist as fp, torch
        >>> res = fp.torch_save({"w": torch.arange(4.0)}, "/tmp/fp-doc.pt")
        >>> torch.load("/tmp/fp-doc.pt", weights_only=True)["w"]
        tensor([0., 1., 2., 3.])
    """
    started = time.perf_counter()
    if not isinstance(path, (str, os.PathLike)):  # a file object: nothing to align, torch writes it
        torch.save(obj, path, pickle_protocol=pickle_protocol)
        return _result(repr(path), path.tell() if path.seekable() else 0, started, "torch.save")
    target = os.path.abspath(os.fspath(path))
    config = (config or Config()).resolved_for(target)
    skel = capture_skeleton(obj, pickle_protocol)
    try:
        extents = compose_extents(skel)
        plan = _core.Plan([e.nbytes for e in extents], 1, 1, config.resolved_chunk_bytes)
        if plan.total_bytes != skel.total_bytes:
            raise ValueError(f"the plan has {plan.total_bytes} bytes but the archive {skel.total_bytes}")
    except ValueError as e:
        _fallback(obj, target, pickle_protocol, str(e))
        return _result(target, skel.total_bytes, started, "torch.save")
    from ..saving.pools import pool_for

    with atomic_file(target, durable=config.durable) as tmp:
        handle = _core.start_write(
            plan,
            0,
            [tmp],
            extents,
            pool_for(config),
            backend=config.backend,
            direct_io=config.direct_io,
            queue_depth=config.resolved_queue_depth,
            checksum=False,
            durable=config.durable,
        )
        report = handle.wait()
        if handle.fallback_reason:
            log.warning("%s", handle.fallback_reason)
    return _result(target, skel.total_bytes, started, str(report["backend"]))


def _result(path: str, nbytes: int, started: float, backend: str) -> SaveResult:
    seconds = time.perf_counter() - started
    log.info(
        "torch_save %s: %d bytes in %.3f s (%.2f GB/s, backend %s)",
        path,
        nbytes,
        seconds,
        nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        backend,
    )
    return SaveResult(
        path=path,
        nbytes=nbytes,
        seconds=seconds,
        staged_seconds=seconds,
        gb_per_s=nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        backend=backend,
        files=[path],
    )
