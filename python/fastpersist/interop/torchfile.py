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
copied in front of the skeleton bytes that follow it. Torch leaves every record's CRC-32 at 0
under ``skip_data``; the engine computes each record's CRC-32 while staging its bytes and fills
in the data descriptor and central-directory fields (both come after the bytes: see
:mod:`.ziprecords`). The composed file is byte-identical to ``torch.save(obj, io.BytesIO())``
but for the ``.data/serialization_id`` record (an id torch derives from its own running CRC),
and ``zipfile``, ``unzip -t`` and CRC-checking readers accept it.

What is not a path to a new zip archive written with the standard ``pickle`` (a file object,
the legacy format, a custom ``pickle_module``, a path torch.save itself refuses) is handed to
``torch.save`` unchanged, with a DEBUG log saying why, so that code can swap the call blindly.
Any surprise in torch's private behaviour (a hole that does not match a storage, an unaligned
record) makes ``torch_save`` fall back to plain ``torch.save`` + fsync, with a warning.
"""

from __future__ import annotations

import bisect
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

import fastpersist._core as _core

from ..config import Config
from ..engine import Crc32Field, Guard, JobHooks, WriteOptions, WriteRequest, start_write
from ..format.blobs import byte_view
from ..format.layout import atomic_file
from ..futures import SaveResult
from ..gpu.copiers import copier_for
from ..gpu.device_side import stage_from_devices
from ..saving.pools import pool_for
from .torchroutes import (
    TORCH_DEFAULT,
    TorchSaveArgs,
    save_elsewhere,
    torch_save_result,
    torch_save_route,
)
from .ziprecords import ReadAt, zip_records

__all__ = [
    "Archive",
    "Skeleton",
    "TorchSaveArgs",
    "fast_path_target",
    "lay_out_archive",
    "save_instead",
    "torch_save",
    "torch_save_result",
    "torch_save_route",
]

log = logging.getLogger("fastpersist")

_ALIGN = 64  # torch's default storage_alignment; also the engine's EXTENT_ALIGN_BYTES
_config_lock = threading.Lock()  # torch's serialization config is process-global


@dataclass
class Skeleton:
    """What torch wrote without data: bytes at offsets, holes where storages go, their storages,
    and every tensor pickled with its version counter at that moment (what an overlapped save
    watches: :mod:`.torchasync`)."""

    pieces: list[tuple[int, bytes]] = field(default_factory=list)
    holes: list[tuple[int, int]] = field(default_factory=list)
    storages: dict[str, torch.UntypedStorage] = field(default_factory=dict)
    tensors: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    #: Tensors pickled that keep no version counter (inference tensors): nothing can watch them.
    unversioned: list[torch.Tensor] = field(default_factory=list)
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
                if isinstance(obj, torch.Tensor):
                    version = _version_of(obj)
                    if version is None:
                        skeleton.unversioned.append(obj)
                    else:
                        skeleton.tensors.append((obj, version))
                pid = inner(self, obj)
                if isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage":
                    storage = obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj
                    skeleton.storages[str(pid[2])] = storage
                return pid

            cls.persistent_id = persistent_id  # type: ignore[method-assign]

    return types.SimpleNamespace(Pickler=Pickler, Unpickler=pickle.Unpickler, __name__="fastpersist_pickle")


def _version_of(t: torch.Tensor) -> int | None:
    """`t`'s version counter; None for a tensor that keeps none (an inference tensor)."""
    try:
        return int(t._version)
    except (RuntimeError, AttributeError):
        return None


def capture_skeleton(obj: object, pickle_protocol: int = 2, disable_byteorder_record: bool = False) -> Skeleton:
    """Runs ``torch.save`` without data and returns the skeleton (see the module docstring)."""
    from torch.utils.serialization import config

    skel = Skeleton()
    with _config_lock:
        saved = (config.save.storage_alignment, config.save.compute_crc32)
        config.save.storage_alignment, config.save.compute_crc32 = _ALIGN, False
        try:
            with torch.serialization.skip_data():
                # torch.serialization.save, not torch.save: a wrapper the caller put in place of
                # torch.save (choosing the legacy format, say) must not shape the skeleton.
                torch.serialization.save(
                    obj,
                    cast(IO[bytes], _Capture(skel)),
                    pickle_module=_hook_module(skel),
                    pickle_protocol=pickle_protocol,
                    _disable_byteorder_record=disable_byteorder_record,
                )
        finally:
            config.save.storage_alignment, config.save.compute_crc32 = saved
    return skel


def _byte_array(storage: torch.UntypedStorage) -> np.ndarray | torch.Tensor:
    """The storage's bytes: a host view, or, for a storage a device copier stages, a 1-D uint8
    tensor over it on its device (staged through the arena, as a checkpoint's tensors are)."""
    t = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))
    if copier_for(t) is not None:
        return t
    return byte_view(t.cpu() if t.device.type != "cpu" else t)


def _host_bytes(data: np.ndarray | torch.Tensor) -> np.ndarray:
    return data.cpu().numpy().copy() if isinstance(data, torch.Tensor) else data.copy()


def compose_extents(skel: Skeleton) -> list[np.ndarray | torch.Tensor]:
    """The engine extents that, laid out by a plan, reproduce the file byte for byte: host
    bytes, or device tensors (the aligned heads of device storages; their short tails are
    copied to the host, since they share an extent with the archive's next record).

    Raises ValueError when torch's skeleton is not what this module expects.
    """
    keys = sorted((k for k, s in skel.storages.items() if s.nbytes() > 0), key=int)
    if len(keys) != len(skel.holes):
        raise ValueError(f"{len(skel.holes)} holes in the archive but {len(keys)} non-empty storages")
    extents: list[np.ndarray | torch.Tensor] = []
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
            pending.append(_host_bytes(data[head:]))
        cursor = hole_at + hole_bytes
    take_skeleton(skel.total_bytes)
    if pending:
        extents.append(np.concatenate(pending) if len(pending) > 1 else pending[0])
    return extents


def _skeleton_bytes(skel: Skeleton) -> ReadAt:
    """Reads the skeleton's bytes at an offset (ValueError inside a hole)."""
    starts = [off for off, _ in skel.pieces]

    def read_at(offset: int, nbytes: int) -> bytes:
        i = bisect.bisect_right(starts, offset) - 1
        if i >= 0 and offset + nbytes <= starts[i] + len(skel.pieces[i][1]):  # within one write
            return skel.pieces[i][1][offset - starts[i] : offset - starts[i] + nbytes]
        out = bytearray()
        while len(out) < nbytes:
            at = offset + len(out)
            if i < 0 or i >= len(starts) or not starts[i] <= at < starts[i] + len(skel.pieces[i][1]):
                raise ValueError(f"the archive skeleton has no bytes at {at}")
            data = skel.pieces[i][1]
            out += data[at - starts[i] : at - starts[i] + nbytes - len(out)]
            i += 1
        return bytes(out)

    return read_at


def crc32_fields(skel: Skeleton) -> list[Crc32Field]:
    """The engine's ``crc32_fields`` for the archive: each non-empty record and its CRC offsets."""
    records = zip_records(_skeleton_bytes(skel), skel.total_bytes)
    return [Crc32Field(r.data_offset_bytes, r.len_bytes, list(r.crc_offsets)) for r in records if r.len_bytes]


def torch_save(
    obj: object,
    f: str | os.PathLike[str] | IO[bytes],
    pickle_module: Any = TORCH_DEFAULT,
    pickle_protocol: int = TORCH_DEFAULT,
    _use_new_zipfile_serialization: bool = TORCH_DEFAULT,
    _disable_byteorder_record: bool = TORCH_DEFAULT,
    *,
    config: Config | None = None,
) -> SaveResult:
    """A drop-in for ``torch.save`` that writes a path with large aligned writes.

    Takes what ``torch.save`` takes. A path (``str`` or ``os.PathLike``) with the default zip
    format and the standard ``pickle`` module (any ``pickle_protocol``, either
    ``_disable_byteorder_record``) takes the fast path: the file is a regular torch zip
    archive, laid out byte for byte as ``torch.save`` writes it to a buffer, with real CRC-32s;
    ``torch.load(path)`` reads it unchanged, also with ``weights_only=True`` and ``mmap=True``.
    With ``torch.serialization.set_crc32_options(False)`` the CRC fields are left 0, as
    ``torch.save`` leaves them. The file is written to a temporary name, fsynced and renamed
    into place (durable on return when ``config.durable``, the default).

    Everything else is handed to torch's own ``torch.save`` (with exactly the arguments given:
    one left out is left out, so torch's defaults apply; never to what ``torch.save`` is bound
    to, so ``torch.save = fp.torch_save`` installs the drop-in everywhere), with a DEBUG log
    saying why, and
    behaves exactly as it does (same output, same exceptions): a file object (``io.BytesIO``,
    anything with ``write``), ``_use_new_zipfile_serialization=False``, a custom
    ``pickle_module``, a path whose directory is missing, a device or FIFO (never renamed
    over; a symlink is written through, the link kept). A path written that way is fsynced
    afterwards when ``config.durable``. If torch's internals are not as expected, this falls
    back to ``torch.save`` + fsync and logs a warning.

    Example:
        >>> import fastpersist as fp, torch
        >>> res = fp.torch_save({"w": torch.arange(4.0)}, "/tmp/fp-doc.pt")
        >>> torch.load("/tmp/fp-doc.pt", weights_only=True)["w"]
        tensor([0., 1., 2., 3.])
    """
    started = time.perf_counter()
    args = TorchSaveArgs.of(pickle_module, pickle_protocol, _use_new_zipfile_serialization, _disable_byteorder_record)
    why = torch_save_route(f, args)
    if why is not None or not isinstance(f, (str, os.PathLike)):  # (the second for the type checker)
        log.debug("torch_save hands %r to torch.save: %s", f, why)
        return save_elsewhere(obj, f, args, config, started)
    target = fast_path_target(f)
    config = (config or Config()).resolved_for(target)
    try:
        archive = lay_out_archive(capture_skeleton(obj, args.pickle_protocol, args.disable_byteorder_record), config)
    except Exception as e:  # torch's own error, if any, is raised by torch.save in save_instead
        return save_instead(obj, target, args, config, started, e)
    with atomic_file(target, durable=config.durable) as tmp:
        report = archive.start(config, tmp, what=target).wait()
    return torch_save_result(target, archive.total_bytes, started, str(report["backend"]))


def fast_path_target(f: str | os.PathLike[str]) -> str:
    """The file a fast-path save of `f` replaces: its absolute path, or the file a symlink there
    names (as ``torch.save`` writes through a link)."""
    target = os.path.abspath(os.fspath(f))
    if os.path.islink(target):  # replace the file the link names, not the link (as torch.save does)
        target = os.path.realpath(target)
    return target


@dataclass(frozen=True)
class Archive:
    """A torch zip archive laid out for the engine: torch's skeleton of it, the extents that
    reproduce it byte for byte, their plan (one writer, one file) and the CRC-32 fields the
    engine fills in while it stages."""

    skeleton: Skeleton
    extents: list[np.ndarray | torch.Tensor]
    plan: _core.Plan
    crc32_fields: list[Crc32Field]

    @property
    def total_bytes(self) -> int:
        return self.skeleton.total_bytes

    def start(
        self, config: Config, tmp: str, *, what: str, guard: Guard | None = None, background: bool = False
    ) -> _core.WriteHandle:
        """Starts the engine's write of this archive to `tmp` (`what`: the file, for messages);
        device storages are staged through an arena. `guard` and `background`: for an overlapped
        save (:mod:`.torchasync`)."""
        sources, device = stage_from_devices(self.extents, self.plan, pinned_bytes=config.pinned_bytes, what=what)
        request = WriteRequest(
            plan=self.plan,
            paths=[tmp],
            sources=sources,
            pool=pool_for(config),
            background=background,
            # The archive's integrity is its CRC-32s; the engine's chunk crc32c would go nowhere.
            options=WriteOptions.of(config, checksum=False),
            hooks=JobHooks(guard=guard, device=device, crc32_fields=self.crc32_fields),
        )
        return start_write(request)


def lay_out_archive(skel: Skeleton, config: Config) -> Archive:
    """The write of the archive `skel` captured, planned with `config` (resolved for its file).
    Raises ValueError when torch's skeleton is not what this module expects."""
    with_crc32 = torch.serialization.get_crc32_options()  # set_crc32_options(False) is honoured
    extents = compose_extents(skel)
    plan = _core.Plan([e.nbytes for e in extents], 1, 1, config.resolved_chunk_bytes)
    if plan.total_bytes != skel.total_bytes:
        raise ValueError(f"the plan has {plan.total_bytes} bytes but the archive {skel.total_bytes}")
    return Archive(skel, extents, plan, crc32_fields(skel) if with_crc32 else [])


def save_instead(
    obj: object, target: str, args: TorchSaveArgs, config: Config, started: float, why: Exception
) -> SaveResult:
    """Plain ``torch.save`` of `target`, into a temporary file renamed into place (fsynced when
    ``config.durable``), with a warning saying why the fast path was left: torch refused to
    compose the archive without its data (quantized or nested tensors under ``skip_data``), or
    the archive was not what :func:`lay_out_archive` expects. An object that ``torch.save``
    refuses too raises torch's own error, and `target` stays as it was."""
    with atomic_file(target, durable=config.durable) as tmp:
        args.save(obj, tmp)
    log.warning("torch_save fell back to torch.save for %s (%s: %s)", target, type(why).__name__, why)
    return torch_save_result(target, os.path.getsize(target), started, "torch.save")
