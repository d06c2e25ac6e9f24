"""The public entry points: save, save_async, load, inspect, verify."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import torch

from . import _core
from .config import Config, SaveResult
from .confine import check_data_files, check_shard_dir
from .errors import ChecksumMismatchError, CorruptCheckpointError
from .flatten import dtype_itemsize, flatten, materialize, unflatten
from .futures import SaveFuture
from .manifest import Manifest, read_manifest
from .saving import SaveJob

__all__ = ["inspect", "load", "save", "save_async", "verify"]

_OWN_STORAGE_BELOW_BYTES = 1 << 20

MapLocation = str | torch.device | Mapping[str, str] | Callable[[torch.Tensor, str], torch.Tensor] | None


def _start(
    state: object, path: str | os.PathLike[str], config: Config | None, group: object, sharded: bool, background: bool
) -> Any:
    config = config or Config()
    if group is None and not sharded:
        return SaveJob(state, path, config, background=background)
    from .distributed import GroupSaveJob

    return GroupSaveJob(state, path, config, group, sharded=sharded, background=background)


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
    :class:`UnsupportedValueError` naming its key path. An existing checkpoint at `path` is
    replaced atomically: readers see the old one or the new one, never a mix.

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
    return _start(state, path, config, group, sharded, background=False).finish()  # type: ignore[no-any-return]


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
    the writes drain the bounded pool.

    Example:
        >>> fut = fp.save_async({"w": torch.ones(3)}, "/tmp/fp-doc-async")
        >>> fut.wait_staged()
        >>> fut.wait().path.endswith("fp-doc-async")
        True
    """
    return SaveFuture(_start(state, path, config, group, sharded, background=True))


def aligned_uint8(nbytes: int) -> torch.Tensor:
    """An uninitialised CPU uint8 tensor of `nbytes` (+ O_DIRECT slack) starting on a page boundary."""
    align = _core.DIRECT_ALIGN_BYTES
    padded = -(-nbytes // align) * align + align
    raw = torch.empty(padded + align, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % align
    return raw[skip : skip + padded]


def _map_device(location: MapLocation, tensor: torch.Tensor, saved_device: str) -> torch.Tensor:
    if location is None:
        target: str | torch.device = saved_device
    elif isinstance(location, (str, torch.device)):
        target = location
    elif isinstance(location, Mapping):
        target = location.get(saved_device, saved_device)
    elif callable(location):
        return location(tensor, saved_device)
    else:
        raise TypeError(f"map_location must be None, a device, a dict or a callable, not {type(location).__name__}")
    if torch.device(target) == tensor.device:
        return tensor
    moved = tensor.to(target)
    if isinstance(tensor, torch.nn.Parameter):
        moved = torch.nn.Parameter(moved, requires_grad=tensor.requires_grad)
    return moved


def _read_stream(path: str, m: Manifest, verify: bool, config: Config) -> torch.Tensor:
    stream = aligned_uint8(m.total_bytes)
    parts = [
        (m.file_path(path, f), f.len_bytes, f.stream_offset_bytes, f.chunk_crc32c if verify else []) for f in m.files
    ]
    try:
        _core.read_into(
            parts,
            stream.numpy(),
            chunk_bytes=m.chunk_bytes,
            backend=config.backend,
            direct_io=config.direct_io,
            queue_depth=config.queue_depth,
        )
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"data file {e.filename} named in {path}/manifest.json is missing") from None
    except ChecksumMismatchError as e:
        assert e.filename is not None and e.offset_bytes is not None and e.len_bytes is not None
        raise _checksum_error(m, path, e.filename, e.offset_bytes, e.len_bytes, e.expected or 0, e.found or 0) from None
    return stream


def _checksum_error(
    m: Manifest, root: str, file_path: str, offset: int, length: int, expected: int, found: int
) -> ChecksumMismatchError:
    """A ChecksumMismatchError naming the file, the byte range and the tensors stored there."""
    lo = hi = -1
    for f in m.files:
        if m.file_path(root, f) == file_path:
            lo, hi = offset + f.stream_offset_bytes, offset + length + f.stream_offset_bytes
            break
    hit = []
    for t in m.tensors:
        start = m.blobs[t.blob][0] + t.offset_bytes
        end = start + math.prod(t.shape) * dtype_itemsize(t.kind, t.dtype)
        if start < hi and lo < end:
            hit.append(t.key_path)
    if hit:
        shown = ", ".join(hit[:5]) + (f" and {len(hit) - 5} more" if len(hit) > 5 else "")
        which = f"tensors affected: {shown}"
    else:
        which = "no tensor data in that range (alignment padding)"
    error = ChecksumMismatchError(
        f"checksum mismatch in {file_path} bytes [{offset}, {offset + length}): expected crc32c {expected:#010x}, "
        f"found {found:#010x}; {which}"
    )
    error.filename, error.offset_bytes, error.len_bytes = file_path, offset, length
    error.expected, error.found, error.tensors = expected, found, hit
    return error


def load(
    path: str | os.PathLike[str],
    *,
    map_location: MapLocation = None,
    verify: bool = True,
    out: object = None,
    group: object = None,
    config: Config | None = None,
    shard: int | None = None,
    namedtuple_types: Iterable[type] = (),
) -> Any:
    """Reads a checkpoint written by :func:`save` and returns the state.

    The manifest is validated strictly before any data is read, and with ``verify=True`` every
    chunk's crc32c is checked as it arrives. Loading never executes code from the file.
    Tensors are views over one page-aligned buffer (read with O_DIRECT); tensors that shared
    storage when saved share it again.

    Args:
        map_location: as in ``torch.load``: ``None`` (the device each tensor was saved from), a
            device, a ``{saved: target}`` dict, or ``fn(tensor, saved_device) -> tensor``.
        verify: check chunk checksums (cheap: crc32c runs at >10 GB/s).
        out: an existing state of the same structure whose tensors are filled in place (no new
            tensor allocation); it is returned.
        group: for a sharded checkpoint, each rank of `group` gets its own shard back. A
            replicated checkpoint is read whole on every rank (group or not).
        shard: read this shard of a sharded checkpoint (without a group).
        config: backend knobs for the read; its ``stripes``, when set, also confine the read:
            stripe directories outside those roots are refused.
        namedtuple_types: namedtuple classes the checkpoint may rebuild (an allow-list). A
            saved namedtuple whose module, qualified name and fields match one of them comes
            back as that class (its ``_make`` is called); any other comes back as a plain
            ``collections.namedtuple`` made by fastpersist with the saved name and fields. No
            class is ever looked up or imported from what the file says.

    Raises:
        CheckpointNotFoundError: there is no committed checkpoint at `path` (a ``FileNotFoundError``).
        CorruptCheckpointError: the manifest or data is damaged (the message names the file,
            tensor and byte range).

    Example:
        >>> state = fp.load("/tmp/fp-doc-ckpt")
        >>> sorted(state)
        ['model', 'step']
    """
    root = os.path.abspath(os.fspath(path))
    config = config or Config()
    m = read_manifest(root)
    if m.shards:
        return load(
            check_shard_dir(root, m.shards[_shard_index(root, len(m.shards), group, shard)]),
            map_location=map_location,
            verify=verify,
            out=out,
            config=config,
            namedtuple_types=namedtuple_types,
        )
    if shard is not None:
        raise ValueError(f"{root} is not sharded; load it without shard=")
    check_data_files(root, m, config.stripes)  # before allocating: sizes, links, confinement
    stream = _read_stream(root, m, verify, config)
    # Large blobs stay zero-copy views of the stream buffer. Small ones get storage of their
    # own: it costs nothing, and some torch APIs (torch.set_rng_state, for one) crash on a
    # tensor whose storage_offset is not 0.
    blob_buffers = [
        stream[o : o + n] if n > _OWN_STORAGE_BELOW_BYTES else stream[o : o + n].clone() for o, n in m.blobs
    ]
    try:
        tensors = materialize(m.tensors, blob_buffers)
    except ValueError as e:
        raise CorruptCheckpointError(f"{root}/manifest.json: {e}") from None
    tensors = [
        _map_device(map_location, t, rec.device) if isinstance(t, torch.Tensor) else t
        for t, rec in zip(tensors, m.tensors, strict=True)
    ]
    if out is not None:
        _fill(out, tensors, root)
        return out
    try:
        return unflatten(m.tree, tensors, namedtuple_types=namedtuple_types)
    except ValueError as e:
        raise CorruptCheckpointError(f"{root}/manifest.json: {e}") from None


def _shard_index(root: str, shard_count: int, group: object, shard: int | None) -> int:
    if shard is None:
        if group is None:
            raise ValueError(
                f"{root} is sharded over {shard_count} ranks: load it with group= (a group of that size) or shard=k"
            )
        from .distributed import group_rank_and_size

        shard, size = group_rank_and_size(group)
        if size != shard_count:
            raise ValueError(f"{root} has {shard_count} shards but the group has {size} ranks")
    if not 0 <= shard < shard_count:
        raise ValueError(f"shard={shard} out of range: {root} has {shard_count} shards")
    return shard


def _fill(out: object, tensors: list[object], where: str) -> None:
    """Copies loaded tensors into the matching tensors of `out` (same structure, dtype, shape)."""
    flat = flatten(out)
    if len(flat.leaves) != len(tensors):
        raise ValueError(f"out= has {len(flat.leaves)} tensors but the checkpoint {where} has {len(tensors)}")
    for rec, dest, loaded in zip(flat.tensors, flat.leaves, tensors, strict=True):
        assert isinstance(loaded, (torch.Tensor, type(dest)))
        if tuple(dest.shape) != tuple(loaded.shape) or dest.dtype != loaded.dtype:  # type: ignore[attr-defined]
            raise ValueError(
                f"out= tensor {rec.key_path} is {dest.dtype}{list(dest.shape)} but the checkpoint has "  # type: ignore[attr-defined]
                f"{loaded.dtype}{list(loaded.shape)}"  # type: ignore[attr-defined]
            )
        if isinstance(dest, torch.Tensor):
            with torch.no_grad():
                dest.copy_(loaded)  # type: ignore[arg-type]
        else:
            cast(Any, dest)[...] = loaded


def inspect(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Describes a checkpoint from its manifest (reads no tensor data).

    Returns a dict with ``format_version``, ``created``, ``checkpoint_id``, ``library_version``,
    ``tensors`` (count), ``bytes`` (tensor data), ``total_bytes`` (stream incl. alignment),
    ``files`` (path, bytes, chunks), ``checksum``, ``chunk_bytes`` and ``tensor_list``
    (key path, kind, dtype, shape, device, bytes).

    Example:
        >>> fp.inspect("/tmp/fp-doc-ckpt")["tensors"]
        2
    """
    root = os.path.abspath(os.fspath(path))
    m = read_manifest(root)
    if m.shards:
        shards = [inspect(check_shard_dir(root, name)) for name in m.shards]
        return {
            "path": root,
            "format_version": f"{m.format_version[0]}.{m.format_version[1]}",
            "created": m.created,
            "checkpoint_id": m.checkpoint_id,
            "library_version": m.library_version,
            "shards": shards,
            "tensors": sum(s["tensors"] for s in shards),
            "bytes": sum(s["bytes"] for s in shards),
            "total_bytes": sum(s["total_bytes"] for s in shards),
            "files": [f for s in shards for f in s["files"]],
            "checksum": m.checksum,
            "chunk_bytes": m.chunk_bytes,
            "tensor_list": [t for s in shards for t in s["tensor_list"]],
        }
    tensor_list = []
    data_bytes = 0
    for t in m.tensors:
        nbytes = math.prod(t.shape) * dtype_itemsize(t.kind, t.dtype)
        data_bytes += nbytes
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
    return {
        "path": root,
        "format_version": f"{m.format_version[0]}.{m.format_version[1]}",
        "created": m.created,
        "checkpoint_id": m.checkpoint_id,
        "library_version": m.library_version,
        "tensors": len(m.tensors),
        "bytes": data_bytes,
        "total_bytes": m.total_bytes,
        "files": [{"path": m.file_path(root, f), "bytes": f.len_bytes, "chunks": len(f.chunk_crc32c)} for f in m.files],
        "checksum": m.checksum,
        "chunk_bytes": m.chunk_bytes,
        "tensor_list": tensor_list,
    }


def verify(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Checks a checkpoint end to end: manifest, file sizes and every chunk's crc32c.

    Uses bounded memory (one chunk at a time). Returns ``{"files", "bytes", "chunks"}``.

    Raises:
        CorruptCheckpointError / ChecksumMismatchError: naming the file, byte range and tensors.

    Example:
        >>> fp.verify("/tmp/fp-doc-ckpt")["files"]
        1
    """
    root = os.path.abspath(os.fspath(path))
    m = read_manifest(root)
    chunks = 0
    if m.shards:
        totals = [verify(check_shard_dir(root, name)) for name in m.shards]
        return {key: sum(t[key] for t in totals) for key in ("files", "bytes", "chunks")}
    check_data_files(root, m)
    for f in m.files:
        file_path = m.file_path(root, f)
        try:
            fd = os.open(file_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"data file {file_path} named in the manifest is missing") from None
        try:
            size = os.fstat(fd).st_size
            if size != f.len_bytes:
                raise CorruptCheckpointError(
                    f"{file_path} has the wrong size (truncated?): expected {f.len_bytes} bytes, found {size}"
                )
            for i, expected in enumerate(f.chunk_crc32c):
                offset = i * m.chunk_bytes
                length = min(m.chunk_bytes, f.len_bytes - offset)
                data = os.pread(fd, length, offset)
                found = _core.crc32c(data)
                if found != expected:
                    raise _checksum_error(m, root, file_path, offset, length, expected, found)
                chunks += 1
        finally:
            os.close(fd)
    return {"files": len(m.files), "bytes": m.total_bytes, "chunks": chunks}
