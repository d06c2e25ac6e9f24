"""Which bytes of a DCP data file a load plan needs: the pure arithmetic behind ranged reads.

A DCP ``ReadItem`` asks for a box (``storage_offsets``, ``lengths``) of a row-major tensor
stored at some offset of a file. :func:`region_spans` turns the box into the byte spans that
hold it; :func:`plan_file_reads` turns every item's spans into whole checksummed chunks to
read (a chunk needed only in part is read whole, so its crc32c can be checked) and into
windows: contiguous stretches of the file, one buffer each, holding every needed chunk at its
file position relative to the window, so that each box is a strided view of one window
(:func:`box_view`).

Example:
    >>> region_spans((4, 1024), 4, (0, 256), (4, 256), merge_gap_bytes=4096)  # a column block
    [(1024, 14336)]
    >>> region_spans((4, 4096), 4, (0, 1024), (4, 1024), merge_gap_bytes=4096)  # rows > a chunk
    [(4096, 8192), (20480, 24576), (36864, 40960), (53248, 57344)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from ..errors import CorruptCheckpointError
from ..format.quote import shown
from ..format.records import TORCH_DTYPES

__all__ = [
    "FileReads",
    "StoredItem",
    "Window",
    "box_view",
    "needed_spans",
    "plan_file_reads",
    "region_spans",
    "stored_dtype",
]


class StoredItem(Protocol):
    """What the writer recorded of an item (``dcp.ItemInfo``): its bytes, dtype and shape."""

    @property
    def len_bytes(self) -> int: ...
    @property
    def dtype(self) -> str | None: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def chunk_bytes(self) -> int: ...


def stored_dtype(item: ReadItem, info: StoredItem) -> torch.dtype:
    """The torch dtype the item was stored with."""
    dtype = TORCH_DTYPES.get(info.dtype or "")
    if dtype is None:
        raise CorruptCheckpointError(f"DCP item {shown(item.storage_index.fqn)}: unknown dtype {shown(info.dtype)}")
    return dtype


def needed_spans(item: ReadItem, info: StoredItem) -> list[tuple[int, int]]:
    """The byte spans of the stored item (from its first byte) that `item` asks for."""
    if item.type == LoadItemType.BYTE_IO:
        return [(0, info.len_bytes)] if info.len_bytes else []
    itemsize = stored_dtype(item, info).itemsize
    if len(item.storage_offsets) != len(info.shape) or any(
        o < 0 or n < 0 or o + n > s for o, n, s in zip(item.storage_offsets, item.lengths, info.shape, strict=False)
    ):
        raise CorruptCheckpointError(
            f"DCP item {shown(item.storage_index.fqn)}: requested offsets {list(item.storage_offsets)} lengths "
            f"{list(item.lengths)} do not fit the stored shape {list(info.shape)}"
        )
    return region_spans(info.shape, itemsize, item.storage_offsets, item.lengths, max(info.chunk_bytes, 1))


def region_spans(
    shape: Sequence[int],
    itemsize: int,
    offsets: Sequence[int],
    lengths: Sequence[int],
    merge_gap_bytes: int,
) -> list[tuple[int, int]]:
    """Sorted byte spans ``(start, end)``, from the tensor's first byte, holding the box
    ``offsets``/``lengths`` of a row-major tensor of `shape`; spans less than `merge_gap_bytes`
    apart are merged (a gap shorter than a chunk cannot hold a whole chunk, so merging them
    reads nothing more). Empty for an empty box."""
    if any(n == 0 for n in lengths):
        return []
    spans = [(0, itemsize)]
    stride = itemsize
    for size, start, count in zip(reversed(shape), reversed(offsets), reversed(lengths), strict=True):
        first, last = spans[0][0], spans[-1][1]
        if len(spans) == 1 and stride - (last - first) < merge_gap_bytes:
            # the repeats touch or nearly do: one span from the first repeat to the last
            spans = [(start * stride + first, (start + count - 1) * stride + last)]
        else:
            merged: list[tuple[int, int]] = []
            for i in range(start, start + count):
                for a, b in spans:
                    a, b = a + i * stride, b + i * stride
                    if merged and a - merged[-1][1] < merge_gap_bytes:
                        merged[-1] = (merged[-1][0], b)
                    else:
                        merged.append((a, b))
            spans = merged
        stride *= size
    return spans


class Window(NamedTuple):
    """A stretch ``[lo_bytes, hi_bytes)`` of a file read into one buffer; only `chunks` (chunk-
    aligned ``(lo, hi)`` file ranges inside it) are read, the rest of the buffer is never looked at."""

    lo_bytes: int
    hi_bytes: int
    chunks: list[tuple[int, int]]


class FileReads(NamedTuple):
    """What to read of one file: its windows, and for each item (in the order given) the index
    of the window holding it, or -1 for an item that needs no bytes."""

    windows: list[Window]
    window_of_item: list[int]


def plan_file_reads(item_spans: Sequence[Sequence[tuple[int, int]]], chunk_bytes: int, file_bytes: int) -> FileReads:
    """Chunks and windows for the items of one file; `item_spans` holds each item's needed
    byte spans as absolute file offsets (sorted within an item)."""

    def down(x: int) -> int:
        return x // chunk_bytes * chunk_bytes

    def up(x: int) -> int:
        return min(-(-x // chunk_bytes) * chunk_bytes, file_bytes)

    chunks = sorted((down(a), up(b)) for spans in item_spans for a, b in spans)
    envelopes = sorted((down(spans[0][0]), up(spans[-1][1]), i) for i, spans in enumerate(item_spans) if spans)
    windows: list[Window] = []
    window_of_item = [-1] * len(item_spans)
    for lo, hi, i in envelopes:
        if windows and lo < windows[-1].hi_bytes:
            windows[-1] = windows[-1]._replace(hi_bytes=max(hi, windows[-1].hi_bytes))
        else:
            windows.append(Window(lo, hi, []))
        window_of_item[i] = len(windows) - 1
    w = 0
    for lo, hi in chunks:
        while windows[w].hi_bytes <= lo:
            w += 1
        runs = windows[w].chunks
        if runs and lo <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(hi, runs[-1][1]))
        else:
            runs.append((lo, hi))
    return FileReads(windows, window_of_item)


def box_view(
    raw: torch.Tensor,
    start_bytes: int,
    shape: Sequence[int],
    dtype: torch.dtype,
    offsets: Sequence[int],
    lengths: Sequence[int],
) -> torch.Tensor:
    """The box ``offsets``/``lengths`` of a row-major tensor of `shape` and `dtype` whose first
    byte would be at `start_bytes` of the uint8 tensor `raw`, as a strided view of `raw`.

    `raw` need only hold the box's bytes: `start_bytes` may be negative (the window starts past
    the tensor's first byte) and `raw` may end before the tensor does. `start_bytes` plus the
    box's first byte offset must be a multiple of the dtype's size, and the box not empty.

    >>> raw = torch.arange(6, dtype=torch.int16).view(torch.uint8)  # bytes 2..13 of a (2, 4)
    >>> box_view(raw, -2, (2, 4), torch.int16, (0, 1), (2, 2)).tolist()
    [[0, 1], [4, 5]]
    """
    itemsize = dtype.itemsize
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    first_bytes = start_bytes + itemsize * sum(o * s for o, s in zip(offsets, strides, strict=True))
    assert first_bytes >= 0 and first_bytes % itemsize == 0, (start_bytes, offsets)
    usable = raw[: raw.numel() // itemsize * itemsize].view(dtype)
    return torch.as_strided(usable, list(lengths), strides, usable.storage_offset() + first_bytes // itemsize)
