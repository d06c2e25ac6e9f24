"""The load pipeline behind :func:`fastpersist.load`: open the checkpoint once, validate its
manifest, pick the shard, check every file and target device before reading, then read the
stream (alone, shared across a group, or straight to the devices), fill `out` or build a new
state, and place its tensors.

The steps it calls each live in their own module of this folder (opened, relocate, reading,
fill, todevice, maplocation, shared_read, phases); this module only orders them.

Example:
    >>> import fastpersist as fp, torch
    >>> _ = fp.save({"w": torch.ones(2)}, "/tmp/fp-doc-pipeline")
    >>> load_checkpoint("/tmp/fp-doc-pipeline", LoadOptions(None, True, fp.Config(), (), PhaseClock(None)))["w"]
    tensor([1., 1.])
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

import fastpersist._core as _core

from ..config import Config
from ..distributed.control import group_rank_and_size
from ..errors import CorruptCheckpointError
from ..format.confine import check_data_files
from ..format.flatten import materialize, unflatten
from ..format.layout import MANIFEST_NAME
from ..format.manifest import Manifest
from ..format.records import TensorRecord
from ..logs import log_load
from .fill import fill_by_key, fill_from_stream
from .maplocation import MapLocation, MappedStorages, check_targets_exist, map_tensor
from .opened import OpenedCheckpoint, opened_checkpoint, opened_shard
from .phases import PhaseClock
from .reading import blob_buffers, read_stream, windowable
from .relocate import check_stripes_present, read_opened
from .shared_read import read_stream_shared
from .todevice import device_targets, load_blobs

__all__ = ["LoadOptions", "build_state", "load_checkpoint", "state_from_stream"]


class LoadOptions(NamedTuple):
    """What one load was asked for, handed down its steps."""

    map_location: MapLocation
    verify: bool
    config: Config
    namedtuple_types: Iterable[type]
    clock: PhaseClock


def load_checkpoint(
    path: str | os.PathLike[str],
    options: LoadOptions,
    *,
    out: object = None,
    group: object = None,
    shard: int | None = None,
    shared_read: bool = True,
) -> Any:
    """Loads the checkpoint at `path` as :func:`fastpersist.load` documents (arguments already checked)."""
    with opened_checkpoint(path) as ck:
        m = read_opened(ck, options.config.stripes)
        if m.shards:
            return _load_shard(ck, m.shards[_shard_index(ck.root, len(m.shards), group, shard)], out, options)
        if shard is not None:
            raise ValueError(f"{ck.root} is not sharded; load it without shard=")
        shared = group is not None and shared_read and out is None and _group_size(group) > 1
        return _load_one(ck, m, out, options, group if shared else None)


def _load_shard(ck: OpenedCheckpoint, name: str, out: object, options: LoadOptions) -> Any:
    """Loads the shard directory `name` of the sharded checkpoint `ck`."""
    with opened_shard(ck, name) as shard_ck:
        m = read_opened(shard_ck, options.config.stripes)
        if m.shards:  # fastpersist writes each shard as one rank's plain checkpoint
            raise CorruptCheckpointError(f"{shard_ck.root}/{MANIFEST_NAME}: a shard may not itself be sharded")
        return _load_one(shard_ck, m, out, options, None)


def _load_one(ck: OpenedCheckpoint, m: Manifest, out: object, options: LoadOptions, shared_group: object) -> Any:
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
    options: LoadOptions,
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
            stream = read_stream_shared(root, m, verify, config, shared_group)
        else:
            stream = read_stream(root, m, verify, config, stats)
    if stream is not None:
        buffers = blob_buffers(stream, m)
    return build_state(root, m, buffers, options, place, targets or {})


def state_from_stream(
    root: str, m: Manifest, stream: _core.PagedBuffer, options: LoadOptions, out: object = None
) -> Any:
    """The state whose whole stream `stream` holds (already read and verified), as a load of the
    checkpoint at `root` with manifest `m` builds it (``map_location`` applied); with `out`,
    its tensors are filled in place as ``load(out=...)`` does."""
    mapped: MappedStorages = {}

    def place(t: torch.Tensor, device: str) -> torch.Tensor:
        return map_tensor(options.map_location, t, device, mapped)

    if out is not None:
        return fill_from_stream(
            out,
            root,
            m,
            stream,
            lambda t, rec: place(t, rec.device),
            namedtuple_types=options.namedtuple_types,
            check_new=lambda records: check_targets_exist(options.map_location, _placed(records), root),
        )
    check_targets_exist(options.map_location, _placed(m.tensors), root)
    return build_state(root, m, blob_buffers(stream, m), options, place, {})


def build_state(
    root: str,
    m: Manifest,
    buffers: list[torch.Tensor],
    options: LoadOptions,
    place: Callable[[torch.Tensor, str], torch.Tensor],
    on_device: dict[int, torch.device],
) -> Any:
    """Builds the state from one buffer per blob; the blobs in `on_device` are already placed."""
    clock = options.clock
    try:
        tensors = materialize(m.tensors, buffers)
    except ValueError as e:
        raise CorruptCheckpointError(f"{root}/{MANIFEST_NAME}: {e}") from None
    del buffers
    clock.mark("build")
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
    return group_rank_and_size(group)[1]


def _shard_index(root: str, shard_count: int, group: object, shard: int | None) -> int:
    if shard is None:
        if group is None:
            raise ValueError(
                f"{root} is sharded over {shard_count} ranks: load it with group= (a group of that size) or shard=k"
            )
        shard, size = group_rank_and_size(group)
        if size != shard_count:
            raise ValueError(f"{root} has {shard_count} shards but the group has {size} ranks")
    if not 0 <= shard < shard_count:
        raise ValueError(f"shard={shard} out of range: {root} has {shard_count} shards")
    return shard
