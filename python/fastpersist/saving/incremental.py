"""An incremental save (:class:`Incremental`): what it writes and what it links.

Each chunk (``block_bytes``) of the state's stream is hashed (XXH3-128 of its bytes, in Rust);
a chunk whose hash and length equal the base step's is not written: the base's data file that
holds it is hard-linked into the new step's directory (the same inode, never copied), and the
new manifest (format 2.0, docs/format.md) maps that file's chunk to the stream. Every step is
therefore complete on its own: loading or verifying it reads only its own directory, deleting
the base drops one name of a shared file, and a kill -9 leaves the temporary directory that any
failed save leaves. The changed chunks are written by the engine as one packed stream whose
chunks are byte for byte the state's chunks (:func:`segments_of`), so their checksums are the
stream's.

Example:
    >>> import fastpersist as fp, torch
    >>> state = {"frozen": torch.zeros(1 << 18), "lora": torch.ones(16)}
    >>> _ = fp.save(state, "/tmp/fp-doc-inc-0", incremental=fp.Incremental())
    >>> state["lora"] += 1
    >>> fp.save(state, "/tmp/fp-doc-inc-1", incremental=fp.Incremental(base="/tmp/fp-doc-inc-0")).nbytes
    64
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

import fastpersist._core as _core

from ..config import Config
from ..engine import Guard
from ..errors import FastPersistError
from ..format.blobs import Blob
from ..format.chunkmap import HASH_BYTES, Run
from ..format.flatten import FlatState
from ..format.layout import data_file_origin, linked_data_file_name
from ..format.manifest import FileEntry, Manifest, read_manifest
from ..gpu.device_side import has_device_blobs

__all__ = [
    "Incremental",
    "IncrementalPlan",
    "Link",
    "Segment",
    "check_packed",
    "chunk_ranges",
    "link_into",
    "plan_for_save",
    "plan_incremental",
    "segments_of",
]

log = logging.getLogger("fastpersist")


@dataclass(frozen=True, kw_only=True)
class Incremental:
    """Save only the chunks whose bytes changed since `base`; the rest is `base`'s, linked.

    Pass it as ``fp.save(..., incremental=...)`` / ``fp.save_async`` (with `base`, the step to
    build on: a missing one makes a full save) or ``fp.Checkpointer(..., incremental=...)``
    (the base is the previous committed step).

    Attributes:
        base: the checkpoint this save builds on (fp.save and save_async; the Checkpointer's own).
        block_bytes: the unit of comparison and of writing: the step's chunk size (a multiple of
            4096). Smaller finds more unchanged bytes in a tensor updated in places; larger
            writes in larger requests.
        full_every: a full write when this many saves in a row were incremental (None: no such
            bound; a step never needs its bases to load, so this bounds only the space below).
        max_span: a full write when the new step's bytes would come from more than this many
            saves: each such save's file is kept whole while any step links it, so a step's files
            hold at most `max_span` times its own size.
    """

    base: str | os.PathLike[str] | None = None
    block_bytes: int = 1 << 20
    full_every: int | None = None
    max_span: int = 4

    def __post_init__(self) -> None:
        try:
            _core.check_chunk_bytes(self.block_bytes)
        except ValueError as e:
            raise ValueError(f"Incremental(block_bytes={self.block_bytes}): {e}") from None
        if self.full_every is not None and (type(self.full_every) is not int or self.full_every < 1):
            raise ValueError(f"Incremental(full_every={self.full_every!r}): a positive integer or None")
        if type(self.max_span) is not int or self.max_span < 1:
            raise ValueError(f"Incremental(max_span={self.max_span!r}): a positive integer")
        if self.base is not None:
            os.fspath(self.base)  # a path, or a TypeError here rather than in the save


class Segment(NamedTuple):
    """Bytes ``[lo, hi)`` of blob `blob`: one source of the packed stream of changed chunks."""

    blob: int
    lo: int
    hi: int


class Link(NamedTuple):
    """A base data file this step links as `entry` (named for its origin): open at `fd` since the
    base's manifest was read through the same directory handle, so the file linked is the one
    that manifest describes even if the base is replaced meanwhile; `source` names it in messages."""

    source: str
    fd: int
    entry: FileEntry


@dataclass
class IncrementalPlan:
    """What an incremental save writes (`changed` chunks of the stream, as `segments` of the
    state's blobs laid out by `own`) and links (`links`), for the stream laid out by `stream`."""

    stream: _core.Plan
    hashes: bytes
    depth: int
    changed: list[int]
    segments: list[Segment]
    own: _core.Plan
    links: list[Link]
    #: Every blob whole: the segments of :meth:`in_full`.
    whole: list[Segment] = field(default_factory=list)
    #: The links' handles are closed (:meth:`close`).
    closed: bool = False

    def in_full(self) -> IncrementalPlan:
        """This plan as a full write (its base vanished before it was linked); closes the links."""
        self.close()
        chunks = list(range(_core.chunk_count(self.stream.total_bytes, self.stream.chunk_bytes)))
        return IncrementalPlan(self.stream, self.hashes, 0, chunks, self.whole, self.stream, [], whole=self.whole)

    @property
    def full(self) -> bool:
        return not self.links

    def close(self) -> None:
        """Closes the base files' handles (once linked, or when the save is discarded); idempotent."""
        if not self.closed:
            self.closed = True
            for link in self.links:
                os.close(link.fd)

    def engine_sources(
        self, blobs: Sequence[Blob], copy_early: Sequence[int], check_staged: Callable[[list[int]], bool]
    ) -> tuple[list[object], Guard]:
        """The engine's sources of `own` (a view of each segment's bytes) and its mutation guard:
        the blobs' (`copy_early`, `check_staged`: by blob index) turned to the segments'."""
        segments = self.segments
        early = set(copy_early)

        def on_staged(staged: list[int]) -> bool:
            return check_staged(sorted({segments[i].blob for i in staged}))

        guard = Guard(
            watched=[blobs[s.blob].version is not None for s in segments],
            on_staged=on_staged,
            copy_early=[i for i, s in enumerate(segments) if s.blob in early],
        )
        return [blobs[s.blob].data[s.lo : s.hi] for s in segments], guard

    def link_into(self, directory: str) -> bool:
        """Hard-links the base files into `directory` (under their entries' names) and closes their
        handles; False, with none left in `directory`, when the base was deleted since it was read
        (a deleted file cannot be linked again)."""
        made: list[str] = []
        try:
            for link in self.links:
                link_into(link, directory)
                made.append(link.entry.name)
        except FileNotFoundError:
            for name in made:
                os.unlink(os.path.join(directory, name))
            return False
        finally:
            self.close()
        return True

    def own_entry(self, entry: FileEntry) -> FileEntry:
        """`entry` (the engine's file of the packed stream) as a format 2.0 file of the stream."""
        if self.full:
            return entry
        chunk = self.stream.chunk_bytes
        first = entry.stream_offset_bytes // chunk
        count = _core.chunk_count(entry.len_bytes, chunk)
        runs = _runs([(k - first, self.changed[k]) for k in range(first, first + count)])
        return FileEntry(entry.name, entry.stripe, entry.writer, 0, entry.len_bytes, entry.chunk_crc32c, runs)


def _runs(pairs: Sequence[tuple[int, int]]) -> tuple[Run, ...]:
    """(file chunk, stream chunk) pairs in file order, as runs of consecutive chunks."""
    runs: list[list[int]] = []
    for fc, sc in pairs:
        if runs and runs[-1][0] + runs[-1][2] == fc and runs[-1][1] + runs[-1][2] == sc:
            runs[-1][2] += 1
        else:
            runs.append([fc, sc, 1])
    return tuple((a, b, c) for a, b, c in runs)


def segments_of(
    offsets: Sequence[int], lengths: Sequence[int], total: int, chunk: int, chunks: Sequence[int]
) -> list[Segment]:
    """The bytes of stream `chunks` (ascending) as segments of the blobs at `offsets` (`lengths`
    each), in stream order, zero-length blobs at their place included: laid out by ``_core.Plan``
    (64-byte alignment), they make a stream whose k-th chunk is byte for byte the stream's
    ``chunks[k]`` (the gaps are the same alignment padding; :func:`check_packed` holds it)."""
    ends = np.asarray(offsets, dtype=np.int64) + np.asarray(lengths, dtype=np.int64)
    segments: list[Segment] = []
    for lo, hi in chunk_ranges(chunks, chunk, total):
        i = int(np.searchsorted(ends, lo, side="left"))
        while i < len(offsets):
            start, n = offsets[i], lengths[i]
            if not (start < hi or (hi == total and n == 0 and start == total)):
                break
            if n == 0 and start >= lo:
                segments.append(Segment(i, 0, 0))
            elif n and start + n > lo:
                segments.append(Segment(i, max(lo, start) - start, min(hi, start + n) - start))
            i += 1
    return segments


def chunk_ranges(chunks: Sequence[int], chunk: int, total: int) -> list[tuple[int, int]]:
    """Runs of consecutive `chunks` as stream byte ranges ``[lo, hi)``."""
    ranges: list[tuple[int, int]] = []
    for c in chunks:
        lo, hi = c * chunk, min((c + 1) * chunk, total)
        if ranges and ranges[-1][1] == lo:
            ranges[-1] = (ranges[-1][0], hi)
        else:
            ranges.append((lo, hi))
    return ranges


def check_packed(
    own: _core.Plan, segments: Sequence[Segment], offsets: Sequence[int], chunks: Sequence[int], total: int
) -> None:
    """That `own` (the plan of `segments`) puts each segment at its place in its chunk: the k-th
    chunk of the packed stream is the stream's ``chunks[k]``.

    Raises:
        RuntimeError: it does not (a bug: the save stops before anything is written).
    """
    chunk = own.chunk_bytes
    packed_at = {c: k * chunk for k, c in enumerate(chunks)}
    expected_total = (len(chunks) - 1) * chunk + (min((chunks[-1] + 1) * chunk, total) - chunks[-1] * chunk)
    for seg, at in zip(segments, own.extent_offsets, strict=True):
        where = offsets[seg.blob] + seg.lo
        c = min(where // chunk, (total - 1) // chunk) if total else 0
        if c not in packed_at or at - packed_at[c] != where - c * chunk:
            raise RuntimeError(f"incremental save: segment {seg} lands at {at}, not at its place in stream chunk {c}")
    if own.total_bytes != expected_total:
        raise RuntimeError(f"incremental save: the packed stream is {own.total_bytes} bytes, not {expected_total}")


def plan_for_save(
    flat: FlatState, incremental: Incremental | None, *, path: str, config: Config, alone: bool, gated: bool
) -> IncrementalPlan | None:
    """A save's incremental plan, or None: not asked for, or a state written in full (device
    tensors: their bytes are not on the host to hash; `gated`: a snapshot staged at once).

    Raises:
        ValueError: `incremental` for a save that is not one process's alone (`alone`), unstriped.
    """
    if incremental is None:
        return None
    if not alone:
        raise ValueError(
            f"incremental save of {path}: one process's save without stripes only (not yet in a group or striped)"
        )
    if has_device_blobs(flat.blobs) or gated:
        log.info("incremental save of %s: device tensors (or a snapshot): a full write", path)
        return None
    return plan_incremental(
        flat.blobs, incremental, path=path, checksum=config.checksum, threads=config.resolved_staging_threads
    )


def plan_incremental(
    blobs: Sequence[Blob], incremental: Incremental, *, path: str, checksum: str, threads: int
) -> IncrementalPlan:
    """Hashes the state's chunks and decides what to write and what to link from the base.

    A full write (every chunk, no link) when there is no usable base (none given, missing,
    unreadable, of another chunk size or checksum setting, on another filesystem), when
    `full_every` saves in a row were incremental, or when the linked bytes would come from more
    than `max_span` saves; each reason is logged at INFO.
    """
    lengths = [b.nbytes for b in blobs]
    chunk = incremental.block_bytes
    stream = _core.Plan(lengths, 1, 1, chunk)
    hashes = _core.chunk_hashes(stream, [b.data for b in blobs], threads)
    chunks = _core.chunk_count(stream.total_bytes, chunk)
    base = _usable_base(incremental, path, chunk, checksum)
    whole = [Segment(i, 0, n) for i, n in enumerate(lengths)]
    full = IncrementalPlan(stream, hashes, 0, list(range(chunks)), whole, stream, [], whole=whole)
    if base is None or chunks == 0:
        return full
    base_fd, base_dir, m = base
    try:
        return _plan_on(base_fd, base_dir, m, stream, lengths, hashes, incremental, path, full)
    finally:
        os.close(base_fd)


def _plan_on(
    base_fd: int,
    base_dir: str,
    m: Manifest,
    stream: _core.Plan,
    lengths: list[int],
    hashes: bytes,
    incremental: Incremental,
    path: str,
    full: IncrementalPlan,
) -> IncrementalPlan:
    """:func:`plan_incremental` on the base `m`, read through the directory handle `base_fd`."""
    chunk = stream.chunk_bytes
    if incremental.full_every is not None and m.incremental_depth + 1 >= incremental.full_every:
        log.info("incremental save of %s: a full write (full_every=%d)", path, incremental.full_every)
        return full
    assert m.chunk_hashes is not None
    same = _same_chunks(hashes, m.chunk_hashes, stream.total_bytes, m.total_bytes, chunk)
    holders = _holders(m)
    origins = {data_file_origin(holders[int(c)][0].name, m.checkpoint_id) for c in np.flatnonzero(same)}
    changed = [int(c) for c in np.flatnonzero(~same)]
    if len(origins) + bool(changed) > incremental.max_span:
        log.info(
            "incremental save of %s: a full write (its bytes would span more than %d saves)", path, incremental.max_span
        )
        return full
    links = _links(base_fd, base_dir, m, holders, [int(c) for c in np.flatnonzero(same)])
    if not links:
        return full
    if not changed:
        empty = _core.Plan([], 1, 1, chunk)
        return IncrementalPlan(stream, hashes, m.incremental_depth + 1, [], [], empty, links, whole=full.whole)
    offsets = stream.extent_offsets
    segments = segments_of(offsets, lengths, stream.total_bytes, chunk, changed)
    own = _core.Plan([s.hi - s.lo for s in segments], 1, 1, chunk)
    check_packed(own, segments, offsets, changed, stream.total_bytes)
    return IncrementalPlan(stream, hashes, m.incremental_depth + 1, changed, segments, own, links, whole=full.whole)


def _usable_base(incremental: Incremental, path: str, chunk: int, checksum: str) -> tuple[int, str, Manifest] | None:
    """A handle on the base's directory (the caller closes it), its path and its manifest read
    through that handle; or None (logged) when a save cannot build on it."""
    if incremental.base is None:
        return None
    base_dir = os.path.abspath(os.fspath(incremental.base))
    try:
        fd = os.open(base_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        log.info("incremental save of %s: no base at %s, a full write", path, base_dir)
        return None
    except OSError as e:
        log.warning("incremental save of %s: base %s unreadable (%s), a full write", path, base_dir, e)
        return None
    try:
        m = read_manifest(f"/proc/self/fd/{fd}", layout_only=True)
    except (FastPersistError, OSError) as e:
        os.close(fd)
        level = logging.INFO if isinstance(e, FileNotFoundError) else logging.WARNING
        log.log(level, "incremental save of %s: base %s unreadable (%s), a full write", path, base_dir, e)
        return None
    why = None
    if m.chunk_hashes is None:
        why = "it has no chunk hashes (not saved with Incremental)"
    elif m.chunk_bytes != chunk:
        why = f"its block_bytes is {m.chunk_bytes}, this save's {chunk}"
    elif m.checksum != checksum:
        why = f"its checksum is {m.checksum!r}, this save's {checksum!r}"
    elif m.stripes or m.shards:
        why = "it is striped or sharded"
    elif os.fstat(fd).st_dev != os.stat(os.path.dirname(path)).st_dev:
        why = "it is on another filesystem (its files cannot be linked)"
    if why:
        log.info("incremental save of %s: base %s not used, %s: a full write", path, base_dir, why)
        os.close(fd)
        return None
    return fd, base_dir, m


def _same_chunks(new: bytes, old: bytes, new_total: int, old_total: int, chunk: int) -> np.ndarray:
    """Which chunks of the new stream have the base chunk's hash and length."""
    a = np.frombuffer(new, dtype=np.uint8).reshape(-1, HASH_BYTES)
    b = np.frombuffer(old, dtype=np.uint8).reshape(-1, HASH_BYTES)
    n = min(len(a), len(b))
    same = np.zeros(len(a), dtype=bool)
    same[:n] = (a[:n] == b[:n]).all(axis=1)
    if n and (min(chunk, new_total - (n - 1) * chunk) != min(chunk, old_total - (n - 1) * chunk)):
        same[n - 1] = False  # a short last chunk of one stream, a full one of the other
    return same


def _holders(m: Manifest) -> dict[int, tuple[FileEntry, int]]:
    """Each chunk of `m`'s stream: the file that holds it, and which chunk of that file."""
    held: dict[int, tuple[FileEntry, int]] = {}
    for f in m.files:
        for fc, sc, n in f.chunk_runs(m.chunk_bytes):
            for i in range(n):
                held[sc + i] = (f, fc + i)
    return held


def _links(
    base_fd: int, base_dir: str, m: Manifest, holders: dict[int, tuple[FileEntry, int]], same: list[int]
) -> list[Link] | None:
    """The base files holding the `same` chunks, opened through the base's directory handle, each
    as this step will name and map it; None (logged) when one of them is not the plain file of its
    length that the base's manifest says (a link, missing, resized)."""
    used: dict[str, list[tuple[int, int]]] = {}
    files: dict[str, FileEntry] = {}
    for c in same:
        f, fc = holders[c]
        used.setdefault(f.name, []).append((fc, c))
        files[f.name] = f
    links: list[Link] = []
    for name, pairs in used.items():
        f = files[name]
        source = m.file_path(base_dir, f)
        why = ""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=base_fd)
        except OSError as e:
            fd, why = -1, e.strerror or str(e)
        if fd >= 0:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != f.len_bytes:
                os.close(fd)
                fd, why = -1, f"not a plain file of {f.len_bytes} bytes"
        if fd < 0:
            log.warning("incremental save: base file %s unusable (%s), a full write", source, why)
            for link in links:
                os.close(link.fd)
            return None
        entry = FileEntry(
            linked_data_file_name(name, m.checkpoint_id), None, 0, 0, f.len_bytes, f.chunk_crc32c, _runs(sorted(pairs))
        )
        links.append(Link(source, fd, entry))
    return links


def link_into(link: Link, directory: str) -> None:
    """Hard-links the base file open at `link.fd` into `directory` as ``link.entry.name``."""
    # A directory fd makes os.link call linkat(AT_SYMLINK_FOLLOW), which links the opened inode
    # (link() would link /proc's symbolic link itself).
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(f"/proc/self/fd/{link.fd}", link.entry.name, dst_dir_fd=dir_fd, follow_symlinks=True)
    finally:
        os.close(dir_fd)
