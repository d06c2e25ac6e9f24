"""Reading a checkpoint's byte stream: whole, for a new state whose large tensors own their
memory; or window by window, to fill an existing state without a buffer of the state's size.

Example:
    >>> import fastpersist as fp, torch
    >>> from fastpersist.format.manifest import read_manifest
    >>> _ = fp.save({"w": torch.ones(4)}, "/tmp/fp-doc-reading")
    >>> m = read_manifest("/tmp/fp-doc-reading")
    >>> [len(b) for b in blob_buffers(read_stream("/tmp/fp-doc-reading", m, True, Config()), m)]
    [16]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

import fastpersist._core as _core

from ..config import Config
from ..engine import ReadRange, read_ranges
from ..errors import ChecksumMismatchError
from ..format.layout import MANIFEST_NAME
from ..format.manifest import Manifest
from ..format.quote import shown
from ..format.records import dtype_itemsize, span_elems

__all__ = [
    "OWN_STORAGE_BELOW_BYTES",
    "WINDOW_BYTES",
    "aligned_uint8",
    "blob_buffers",
    "checksum_error",
    "direct_padded",
    "paged_uint8",
    "read_queue_depth",
    "read_stream",
    "read_window",
    "stream_windows",
    "windowable",
]

#: Blobs up to a page are copied into storage of their own (a small allocation, cheap; and
#: some torch APIs, torch.set_rng_state for one, crash on a tensor whose storage_offset is not
#: 0); larger ones keep the pages they were read into, which go back to the OS when the tensor
#: does. Copying up to 1 MiB, as before, made a cold load of 2,048 tensors of 512 KiB take
#: 1.062 s against 0.537 s (benches/cold.py, docs/performance.md): each copy faulted in fresh
#: pages of its own.
OWN_STORAGE_BELOW_BYTES = 4096

#: Bytes of stream read at a time when filling an existing state (``load(out=...)``); a blob
#: larger than this is read in one window of its own size.
WINDOW_BYTES = 64 << 20

T = TypeVar("T")


def aligned_uint8(nbytes: int) -> torch.Tensor:
    """An uninitialised CPU uint8 tensor of `nbytes` rounded up to whole pages (room for
    O_DIRECT's padded tail), starting on a page boundary: a read destination. Its memory is a
    `_core.PagedBuffer` (kept alive by the tensor), so a large one is backed by huge pages and
    costs a load's first touch what `read_stream`'s buffer costs."""
    return paged_uint8(nbytes)[1]


def paged_uint8(nbytes: int) -> tuple[_core.PagedBuffer, torch.Tensor]:
    """A page-aligned buffer of `nbytes` rounded up to whole pages (room for O_DIRECT's padded
    tail), and a 1-D uint8 tensor over it: a window to read stream bytes into."""
    paged = _core.PagedBuffer(direct_padded(nbytes))
    return paged, torch.frombuffer(paged, dtype=torch.uint8)


def direct_padded(nbytes: int) -> int:
    """`nbytes` rounded up to whole pages (at least one): room for O_DIRECT's padded tail."""
    align = _core.DIRECT_ALIGN_BYTES
    return max(align, -(-nbytes // align) * align)


def read_queue_depth(config: Config, root: str) -> int:
    """Reads in flight for a load from `root`: the config's integer, else the depth tuned for
    reads on its device (the chunk size is the manifest's). The device lookup is remembered,
    so calling this per window costs a stat and a small file read."""
    return config.resolved_for(root, "read").resolved_queue_depth


def _naming_tensors(root: str, m: Manifest, read: Callable[[], T]) -> T:
    """Runs `read`; a checksum mismatch is raised again naming the tensors in its range."""
    try:
        return read()
    except ChecksumMismatchError as e:
        assert e.filename is not None and e.offset_bytes is not None and e.len_bytes is not None
        raise checksum_error(m, root, e.filename, e.offset_bytes, e.len_bytes, e.expected or 0, e.found or 0) from None


def read_stream(
    root: str, m: Manifest, verify: bool, config: Config, stats: dict[str, float] | None = None
) -> _core.PagedBuffer:
    """Reads the whole logical stream (O_DIRECT, checksums checked) into page-aligned memory:
    :func:`read_window` of ``[0, total_bytes)``, every file of the manifest in one engine call;
    the engine adds its measures (``bytes``, ``crc32c_s``) to `stats`."""
    stream = _core.PagedBuffer(direct_padded(m.total_bytes))
    read_window(root, m, 0, m.total_bytes, stream, verify, config, stats)
    return stream


def blob_buffers(stream: _core.PagedBuffer, m: Manifest) -> list[torch.Tensor]:
    """One 1-D uint8 tensor per blob: those over a page over their own pages of `stream` (so
    dropping a tensor frees its memory even while others are kept), smaller ones copied."""
    whole = torch.frombuffer(stream, dtype=torch.uint8)
    buffers = []
    for offset, nbytes in m.blobs:
        if nbytes > OWN_STORAGE_BELOW_BYTES:
            buffers.append(torch.frombuffer(stream.span(offset, nbytes), dtype=torch.uint8))
        else:
            buffers.append(whole[offset : offset + nbytes].clone())
    return buffers


def windowable(m: Manifest) -> bool:
    """Whether every file starts on a chunk boundary of the stream (as the writer lays them out),
    so that a chunk-aligned window of the stream maps to whole chunks of each file."""
    return all(f.stream_offset_bytes % m.chunk_bytes == 0 for f in m.files)  # 2.0's runs are whole chunks


def stream_windows(m: Manifest, window_bytes: int = WINDOW_BYTES) -> Iterator[tuple[int, int, list[int]]]:
    """Cuts the stream into chunk-aligned windows of whole blobs: ``(lo, hi, blob indices)``.

    A window holds at most `window_bytes` of blobs (or one blob larger than that), plus the
    partial chunks at its ends.
    """
    chunk = m.chunk_bytes
    group: list[int] = []
    start = 0

    def window() -> tuple[int, int, list[int]]:
        end = m.blobs[group[-1]][0] + m.blobs[group[-1]][1]
        lo = start // chunk * chunk
        return lo, min(_core.chunk_count(end, chunk) * chunk, m.total_bytes), group

    for index, (offset, nbytes) in enumerate(m.blobs):
        if group and offset + nbytes - start > window_bytes:
            yield window()
            group = []
        if not group:
            start = offset
        group.append(index)
    if group:
        yield window()


def read_window(
    root: str,
    m: Manifest,
    lo: int,
    hi: int,
    dest: _core.PagedBuffer,
    verify: bool,
    config: Config,
    stats: dict[str, float] | None = None,
) -> None:
    """Reads stream bytes ``[lo, hi)`` (chunk-aligned `lo`; see :func:`windowable`) into `dest`;
    the engine adds its measures (``bytes``, ``crc32c_s``) to `stats`."""
    chunk = m.chunk_bytes
    ranges = []
    for f in m.files:
        for at, start, nbytes in f.runs(chunk, m.total_bytes):
            a, b = max(lo, start), min(hi, start + nbytes)
            if a >= b:
                continue
            first = (at + a - start) // chunk
            crcs = f.chunk_crc32c[first : first + _core.chunk_count(b - a, chunk)] if verify else []
            ranges.append(ReadRange(m.file_path(root, f), f.len_bytes, at + a - start, b - a, a - lo, crcs))
    _naming_tensors(
        root,
        m,
        lambda: read_ranges(
            ranges,
            dest,
            chunk_bytes=chunk,
            backend=config.backend,
            direct_io=config.direct_io,
            queue_depth=read_queue_depth(config, root),
            stats=stats,
            named_in=f"{root}/{MANIFEST_NAME}",
        ),
    )


def checksum_error(
    m: Manifest, root: str, file_path: str, offset: int, length: int, expected: int, found: int
) -> ChecksumMismatchError:
    """A ChecksumMismatchError naming the file, the byte range and the tensors stored there."""
    lo = hi = -1
    for f in m.files:
        if m.file_path(root, f) != file_path:
            continue
        for at, start, nbytes in f.runs(m.chunk_bytes, m.total_bytes):
            if at <= offset < at + nbytes:
                lo, hi = start + offset - at, start + min(offset + length, at + nbytes) - at
        break
    hit = []
    for t in m.tensors:
        start = m.blobs[t.blob][0] + t.offset_bytes
        end = start + span_elems(t.shape, t.stride) * dtype_itemsize(t.kind, t.dtype)
        if start < hi and lo < end:
            hit.append(t.key_path)
    if hit:
        names = ", ".join(map(shown, hit[:5])) + (f" and {len(hit) - 5} more" if len(hit) > 5 else "")
        which = f"tensors affected: {names}"
    else:
        which = "no tensor data in that range (alignment padding)"
    error = ChecksumMismatchError(
        f"checksum mismatch in {shown(file_path, 300)} bytes [{offset}, {offset + length}): "
        f"expected crc32c {expected:#010x}, "
        f"found {found:#010x}; {which}"
    )
    error.filename, error.offset_bytes, error.len_bytes = file_path, offset, length
    error.expected, error.found, error.tensors = expected, found, hit
    return error
