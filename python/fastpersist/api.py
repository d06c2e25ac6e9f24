"""The public entry points: save, save_async, load, inspect, verify, prepare.

Each is its documented signature and docstring over one call: saves start in
:mod:`fastpersist.saving.start`, loads run :mod:`fastpersist.loading.pipeline`, inspect and
verify :mod:`fastpersist.loading.examine`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from .arguments import given_path
from .config import Config, given_config
from .futures import SaveFuture, SaveResult
from .levels.remote_fetch import fetched, is_url, verify_url
from .loading.examine import inspect_checkpoint, verify_checkpoint
from .loading.fill import check_out
from .loading.maplocation import MapLocation, check_load_flags
from .loading.phases import PhaseClock
from .loading.pipeline import LoadOptions, load_checkpoint
from .saving.incremental import Incremental
from .saving.pools import pool_for, prefault_in_background
from .saving.start import save_blocking, start_save

__all__ = ["inspect", "load", "prepare", "save", "save_async", "verify"]

_CHECKPOINT_PATH = "the checkpoint directory to write"


def prepare(path: str | os.PathLike[str], *, config: Config | None = None) -> None:
    """Does now, for saves to `path`, what a process's first save would otherwise pay once, and
    returns at once: settles `config`'s ``"auto"`` values for the device of `path` (the tuning
    cache, the device's identity) and faults the staging pool's memory in on a background
    thread. The first touch of fresh memory is the one cost a first save has that later saves
    do not (0.35-0.5 s for the default 256 MiB pool on the VMs we measure, docs/performance.md);
    call this while the model loads. A save that starts meanwhile uses what is ready. The whole
    pool is faulted in, even the part a state smaller than ``pool_bytes`` would not use.

    Example:
        >>> import fastpersist as fp, torch
        >>> fp.prepare("/tmp/fp-doc-prepare")
        >>> fp.save({"w": torch.ones(2)}, "/tmp/fp-doc-prepare").nbytes
        8
    """
    resolved = given_config(config).resolved_for(given_path(path, "path", "fastpersist.prepare", _CHECKPOINT_PATH))
    prefault_in_background(pool_for(resolved))


def save(
    state: object,
    path: str | os.PathLike[str],
    *,
    config: Config | None = None,
    group: object = None,
    sharded: bool = False,
    incremental: Incremental | None = None,
) -> SaveResult:
    """Writes `state` to the checkpoint directory `path` and returns once it is durable and committed.

    `state` is any nesting of dict / OrderedDict / list / tuple / namedtuple whose leaves are
    tensors, numpy arrays or plain values (None, bool, int, float, str, bytes, torch.dtype,
    torch.Size, ...). Nothing is pickled: an unsupported leaf raises
    :class:`UnsupportedValueError` naming its key path, and so does a state whose manifest would
    exceed what :func:`load` accepts (``fastpersist.format.limits``), before anything is
    committed. Bytes values over 4 KiB go into the data stream like tensors. An existing
    checkpoint at `path` is replaced atomically: readers see the old one or the new one, never a mix.
    Missing directories above `path` are created (as ``mkdir -p``; durable with the save); an
    empty `path` is refused (``ValueError``: it would replace the working directory).
    The replaced tree is deleted after the commit, in the background (:func:`wait_removed`); a
    save that runs out of space while such deletions are queued waits for them and tries once more.

    With ``group=`` (a ``torch.distributed`` process group, or ``dist.group.WORLD``) every rank
    of the group must call ``save`` with the same `path`. Replicated state (identical on every
    rank): each writer rank (``Config.writers``) writes a disjoint ~1/N of the bytes and the
    result is one checkpoint. ``sharded=True``: each rank's own state becomes one shard;
    ``load(path, group=...)`` gives each rank its shard back. See docs/distributed.md.

    With ``incremental=fp.Incremental(base=OLDER)`` only the blocks whose bytes differ from the
    checkpoint `OLDER` are written; the others are `OLDER`'s files, hard-linked, so the new
    checkpoint loads, verifies and survives `OLDER`'s deletion on its own (docs/incremental.md).

    Example:
        >>> import fastpersist as fp, torch
        >>> model = torch.nn.Linear(4, 2)
        >>> res = fp.save({"model": model.state_dict(), "step": 10}, "/tmp/fp-doc-ckpt")
        >>> res.nbytes > 0
        True
    """
    path = given_path(path, "path", "fastpersist.save", _CHECKPOINT_PATH)
    return save_blocking(state, path, given_config(config), group=group, sharded=sharded, incremental=incremental)


def save_async(
    state: object,
    path: str | os.PathLike[str],
    *,
    config: Config | None = None,
    group: object = None,
    sharded: bool = False,
    incremental: Incremental | None = None,
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
    path = given_path(path, "path", "fastpersist.save_async", _CHECKPOINT_PATH)
    return SaveFuture(
        start_save(state, path, given_config(config), group=group, sharded=sharded, incremental=incremental)
    )


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
            :mod:`fastpersist.loading.shared_read`).
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
        TypeError / ValueError: an argument it cannot take (`config` not a Config, `phases` not
            a dict, `out` not a state or holding a meta tensor), named in the message, before any read.

    Example:
        >>> state = fp.load("/tmp/fp-doc-ckpt")
        >>> sorted(state)
        ['model', 'step']
    """
    check_load_flags(weights_only, mmap)
    check_out(out)
    options = LoadOptions(map_location, verify, given_config(config), namedtuple_types, PhaseClock(phases))
    if is_url(path):  # s3://...: fetched into a temporary directory, every chunk checked
        with fetched(str(path)) as local:
            return load_checkpoint(local, options, out=out, group=group, shard=shard, shared_read=False)
    return load_checkpoint(path, options, out=out, group=group, shard=shard, shared_read=shared_read)


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
    stripes = given_config(config).stripes
    if is_url(path):
        with fetched(str(path), data=False) as local:
            return inspect_checkpoint(local)
    return inspect_checkpoint(path, stripes)


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
    stripes = given_config(config).stripes
    if is_url(path):
        return verify_url(str(path))
    return verify_checkpoint(path, progress, stripes)
