"""The public entry points: save, save_async, load, inspect, verify."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from . import _core
from .config import Config, SaveResult
from .errors import CorruptCheckpointError
from .format.confine import check_data_files, check_shard_dir
from .format.flatten import materialize, unflatten
from .format.layout import MANIFEST_NAME
from .format.manifest import Manifest
from .format.records import TensorRecord
from .futures import SaveFuture, SaveJobLike
from .loading.examine import check_chunks, describe
from .loading.fill import fill_by_key
from .loading.maplocation import MapLocation, MappedStorages, check_load_flags, check_targets_exist, map_tensor
from .loading.opened import OpenedCheckpoint, opened_checkpoint, opened_shard
from .loading.phases import PhaseClock
from .loading.reading import blob_buffers, read_stream, windowable
from .loading.relocate import check_stripes_present, read_opened
from .loading.todevice import device_targets, load_blobs
from .logs import log_load
from .saving.job import SaveJob

__all__ = ["inspect", "load", "save", "save_async", "verify"]


def _start(
    state: object,
    path: str | os.PathLike[str],
    config: Config | None,
    group: object,
    sharded: bool,
) -> SaveJobLike:
    config = config or Config()
    # The engine always runs on its own thread, so that waiting for it can be interrupted.
    if group is None and not sharded:
        return SaveJob(path, config).start(state)
    from .saving.group import GroupSaveJob

    return GroupSaveJob(path, config, group, sharded=sharded).start(state)


def save(
    state: object,
    path: str | os.PathLike[str],
    *,
    config: Config | None = None,
    group: object = None,
    sharded: bool = False,
) -> SaveResult:
    """Writes `state` to the checkpoint directory `path` and returns once it is durable and committed.

    `state` is any nesting of dict / OrderedDict / list / tuple / namedtuple whose leaves are
    tensors, numpy arrays or plain values (None, bool, int, float, str, bytes, torch.dtype,
    torch.Size, ...). Nothing is pickled: an unsupported leaf raises
    :class:`UnsupportedValueError` naming its key path, and so does a state whose manifest would
    exceed what :func:`load` accepts (``fastpersist.format.limits``), before anything is
    committed. Bytes values over 4 KiB go into the data stream like tensors. An existing
    checkpoint at `path` is replaced atomically: readers see the old one or the new one, never a mix.

    With ``group=`` (a ``torch.distributed`` process group, or ``dist.group.WORLD``) every rank
    of the group must call ``save`` with the same `path`. Replicated state (identical on every
    rank): each writer rank (``Config.writers``) writes a disjoint ~1/N of the bytes and the
    result is one checkpoint. ``sharded=True``: each rank's own state becomes one shard;
    ``load(path, group=...)`` gives each rank its shard back. See docs/distributed.md.

    Example:
        >>> import fastpersist as fp, torch
        >>> model = torch.nn.Linear(4, 2)
        >>> res = fp.save({"model": model.state_dict(), "step": 10}, "/tmp/fp-doc-ckpt")
        >>> res.nbytes > 0
        True
    """
    return _start(state, path, config, group, sharded).finish()


def save_async(
    state: object,
    path: str | os.PathLike[str],
    *,
    config: Config | None = None,
    group: object = None,
    sharded: bool = False,
) -> SaveFuture:
    """Starts saving `state` to `path` in the background and returns a :class:`SaveFuture` at once.

    Call ``fut.wait_staged()`` before modifying the state (e.g. before ``optimizer.step()``) and
    ``fut.wait()`` when you need the checkpoint to be committed. With
    ``Config(pool_bytes >= state size)`` staging is one memory copy; otherwise it proceeds as
    the writes drain the bounded pool. With ``Config(guard="copy")`` it returns only once
    every byte is staged, so writes torch cannot see (``.data``, ``.numpy()``, CUDA kernels)
    cannot tear the save (docs/overlap.md).

    Example:
        >>> fut = fp.save_async({"w": torch.ones(3)}, "/tmp/fp-doc-async")
        >>> fut.wait_staged()
        >>> fut.wait().path.endswith("fp-doc-async")
        True
    """
    return SaveFuture(_start(state, path, config, group, sharded))


def load(
    path: str | os.PathLike[str],
    map_location: MapLocation = None,
    *,
    weights_only: bool | None = None,
    mmap: bool | None = None,
    verify: bool = True,
    out: object = None,
    group: object = None,
    config: Config | None = None,
    shard: int | None = None,
    namedtuple_types: Iterable[type] = (),
    shared_read: bool = True,
    phases: dict[str, float] | None = None,
) -> Any:
    """Reads a checkpoint written by :func:`save` and returns the state.

    The manifest is validated strictly before any data is read, and with ``verify=True`` every
    chunk's crc32c is checked as it arrives. Loading never executes code from the file. Each
    tensor over 1 MiB keeps only its own pages of the O_DIRECT read (dropping it frees them),
    smaller ones are copied. Tensors that shared storage when saved share it again. A link at
    `path` is followed once; a save replacing the checkpoint is never mixed in (loading.opened).

    Args:
        map_location: as in ``torch.load`` (also positional): ``None`` (the device each tensor
            was saved from), a device, a ``{saved: target}`` dict, or ``fn(storage, location)``
            returning a storage (see :mod:`fastpersist.loading.maplocation`). CUDA targets skip
            the host copy of the state (:mod:`fastpersist.loading.todevice`).
        weights_only, mmap: accepted for ``torch.load`` compatibility, no effect: loading
            never unpickles, and data is always read with O_DIRECT and checksummed.
        verify: check chunk checksums (cheap: crc32c runs at >10 GB/s).
        out: an existing state whose tensors are filled in place, matched by key path (never
            by position); each must exist in the checkpoint with the same dtype and shape, else
            ``ValueError`` names it and `out` is left untouched. The returned state has the
            checkpoint's structure and non-tensor values, holding `out`'s tensors; tensors
            `out` lacks come back new. Reads 64 MiB windows, a few ahead, through at most
            256 MiB of buffers (or one window of the largest tensor), never a buffer of the
            state's size. All or nothing: a damaged chunk or a missing, truncated or resized
            file raises and leaves `out` as it was (:mod:`fastpersist.loading.fill`).
        group: for a sharded checkpoint, each rank of `group` gets its own shard back. For a
            replicated one, every rank gets the whole state; with `shared_read` each rank reads
            only ~1/N of it from disk and the ranks exchange the rest over gloo (every rank of
            `group` must call ``load`` with the same arguments; see
            :mod:`fastpersist.group_load`).
        shard: read this shard of a sharded checkpoint (without a group).
        config: backend knobs for the read; its ``stripes``, when set, also confine the read:
            stripe directories outside those roots are refused; stripe directories moved to
            other drives are found there by name (:mod:`fastpersist.loading.relocate`).
        namedtuple_types: namedtuple classes the checkpoint may rebuild (an allow-list). A
            saved namedtuple whose module, qualified name and fields match one of them comes
            back as that class (its ``_make`` is called); any other comes back as a plain
            ``collections.namedtuple`` made by fastpersist with the saved name and fields. No
            class is ever looked up or imported from what the file says.
        shared_read: with a `group` and a replicated checkpoint, each rank reads a share
            (``True``) or everything (``False``; also with `out`, and in groups of one).
        phases: a dict filled with seconds per phase (:mod:`fastpersist.loading.phases`).

    Raises:
        CheckpointNotFoundError: there is no committed checkpoint at `path` (a ``FileNotFoundError``),
            or it was deleted or replaced while being loaded (nothing of it is returned).
        CorruptCheckpointError: the manifest or data is damaged (naming file, tensor, byte range).
        FastPersistError: a CUDA device this machine lacks is a target (before any read).

    Example:
        >>> state = fp.load("/tmp/fp-doc-ckpt")
        >>> sorted(state)
        ['model', 'step']
    """
    check_load_flags(weights_only, mmap)
    options = _LoadOptions(map_location, verify, config or Config(), namedtuple_types, PhaseClock(phases))
    with opened_checkpoint(path) as ck:
        m = read_opened(ck, options.config.stripes)
        if m.shards:
            return _load_shard(ck, m.shards[_shard_index(ck.root, len(m.shards), group, shard)], out, options)
        if shard is not None:
            raise ValueError(f"{ck.root} is not sharded; load it without shard=")
        shared = group is not None and shared_read and out is None and _group_size(group) > 1
        return _load_one(ck, m, out, options, group if shared else None)


def _load_shard(ck: OpenedCheckpoint, name: str, out: object, options: _LoadOptions) -> Any:
    """Loads the shard directory `name` of the sharded checkpoint `ck`."""
    check_shard_dir(ck.at, name)
    with opened_shard(ck, name) as shard_ck:
        m = read_opened(shard_ck, options.config.stripes)
        if m.shards:  # fastpersist writes each shard as one rank's plain checkpoint
            raise CorruptCheckpointError(f"{shard_ck.root}/{MANIFEST_NAME}: a shard may not itself be sharded")
        return _load_one(shard_ck, m, out, options, None)


class _LoadOptions(NamedTuple):
    """What one load was asked for, handed down its steps."""

    map_location: MapLocation
    verify: bool
    config: Config
    namedtuple_types: Iterable[type]
    clock: PhaseClock


def _load_one(ck: OpenedCheckpoint, m: Manifest, out: object, options: _LoadOptions, shared_group: object) -> Any:
    """Loads one (unsharded) opened checkpoint whose manifest `m` is already validated; with
    `shared_group`, the ranks of that group each read a share of the stream."""
    config, root = options.config, ck.at
    check_stripes_present(m, ck.root)
    check_data_files(root, m, config.stripes)  # before allocating: sizes, links, confinement
    if out is not None and not windowable(m):
        raise CorruptCheckpointError(
            f"{ck.root}/{MANIFEST_NAME}: its files do not start on chunk boundaries (fastpersist never writes "
            "such a layout), so out= cannot be filled window by window"
        )
    if out is None:
        check_targets_exist(options.map_location, _placed(m.tensors), ck.root)
    options.clock.mark("manifest")
    read_started = time.perf_counter()
    mapped: MappedStorages = {}

    def place(t: torch.Tensor, device: str) -> torch.Tensor:
        return map_tensor(options.map_location, t, device, mapped)

    if out is not None:
        state = fill_by_key(
            out,
            root,
            m,
            options.verify,
            config,
            lambda t, rec: place(t, rec.device),
            namedtuple_types=options.namedtuple_types,
            check_new=lambda records: check_targets_exist(options.map_location, _placed(records), ck.root),
        )
        options.clock.mark("fill")
    else:
        targets = device_targets(m, options.map_location) if shared_group is None and windowable(m) else {}
        state = _load_new(root, m, options, place, shared_group, targets)
    log_load(ck.root, m.total_bytes, time.perf_counter() - read_started, _core.select_backend(config.backend)[0])
    return state


def _placed(records: Iterable[TensorRecord]) -> list[tuple[str, str]]:
    """``(key path, saved device)`` of the torch tensors among `records` (what ``map_location`` moves)."""
    return [(rec.key_path, rec.device) for rec in records if rec.kind == "torch"]


def _load_new(
    root: str,
    m: Manifest,
    options: _LoadOptions,
    place: Callable[[torch.Tensor, str], torch.Tensor],
    shared_group: object = None,
    targets: dict[int, torch.device] | None = None,
) -> Any:
    """Reads the stream and builds a new state (each large tensor owning its pages). Blobs in
    `targets` are loaded straight to their device through a ring of pinned windows
    (:mod:`fastpersist.loading.todevice`); their tensors are already placed."""
    clock, verify, config = options.clock, options.verify, options.config
    stream = None
    with clock.reading() as stats:  # on a device: the host-to-device copies are inside `read`
        if targets:
            buffers = load_blobs(root, m, verify, config, targets, stats)
        elif shared_group is not None and windowable(m):
            from .loading.group import read_stream_shared

            stream = read_stream_shared(root, m, verify, config, shared_group)
        else:
            stream = read_stream(root, m, verify, config, stats)
    if stream is not None:
        buffers = blob_buffers(stream, m)
    try:
        tensors = materialize(m.tensors, buffers)
    except ValueError as e:
        raise CorruptCheckpointError(f"{root}/{MANIFEST_NAME}: {e}") from None
    del buffers
    clock.mark("build")
    on_device = targets or {}
    tensors = [
        place(t, rec.device) if isinstance(t, torch.Tensor) and rec.blob not in on_device else t
        for t, rec in zip(tensors, m.tensors, strict=True)
    ]
    clock.mark("place")
    try:
        state = unflatten(m.tree, tensors, namedtuple_types=options.namedtuple_types)
    except ValueError as e:
        raise CorruptCheckpointError(f"{root}/{MANIFEST_NAME}: {e}") from None
    clock.mark("unflatten")
    return state


def _group_size(group: object) -> int:
    from .distributed.control import group_rank_and_size

    return group_rank_and_size(group)[1]


def _shard_index(root: str, shard_count: int, group: object, shard: int | None) -> int:
    if shard is None:
        if group is None:
            raise ValueError(
                f"{root} is sharded over {shard_count} ranks: load it with group= (a group of that size) or shard=k"
            )
        from .distributed.control import group_rank_and_size

        shard, size = group_rank_and_size(group)
        if size != shard_count:
            raise ValueError(f"{root} has {shard_count} shards but the group has {size} ranks")
    if not 0 <= shard < shard_count:
        raise ValueError(f"shard={shard} out of range: {root} has {shard_count} shards")
    return shard


def inspect(path: str | os.PathLike[str], *, config: Config | None = None) -> dict[str, Any]:
    """Describes a checkpoint from its manifest (reads no tensor data).

    Returns a dict with ``format_version``, ``created``, ``checkpoint_id``, ``library_version``,
    ``tensors`` (count; a bytes value over 4 KiB is a uint8 numpy record of its own), ``bytes``
    (tensor data), ``total_bytes`` (stream incl. alignment),
    ``files`` (path, bytes, chunks), ``checksum``, ``chunk_bytes`` and ``tensor_list``
    (key path, kind, dtype, shape, device, bytes). With ``config=Config(stripes=[roots])``, stripe
    directories are looked up by name in those roots (a checkpoint whose stripes were moved).

    Example:
        >>> fp.inspect("/tmp/fp-doc-ckpt")["tensors"]
        2
    """
    with opened_checkpoint(path) as ck:
        return describe(ck, config.stripes if config else None)


def verify(
    path: str | os.PathLike[str],
    *,
    progress: Callable[[int], object] | None = None,
    config: Config | None = None,
) -> dict[str, Any]:
    """Checks a checkpoint end to end: manifest, file sizes and every chunk's crc32c.

    Uses bounded memory (one chunk at a time). Returns ``{"files", "bytes", "chunks"}``.
    `progress`, when given, is called with the byte count of each chunk checked. With
    ``config=Config(stripes=[roots])``, stripe directories are looked up by name in those roots
    (and must be there), as for :func:`load`.

    Raises:
        CorruptCheckpointError / ChecksumMismatchError: naming the file, byte range and tensors.
        CheckpointNotFoundError: nothing at `path`, or it was deleted or replaced during the check.

    Example:
        >>> fp.verify("/tmp/fp-doc-ckpt")["files"]
        1
    """
    with opened_checkpoint(path) as ck:
        return check_chunks(ck, progress, config.stripes if config else None)
