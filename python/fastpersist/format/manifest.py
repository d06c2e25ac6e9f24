"""The native checkpoint manifest: building it at save time and validating it strictly at load.

A checkpoint is a directory holding ``manifest.json`` and the data files it names. Everything a
loader touches is checked here first, before any data byte is read: version, file names (plain
names, confined to the checkpoint or its recorded stripe directories), byte ranges (in bounds,
covering the stream exactly once), chunk checksum counts, blob bounds, and every tensor's
dtype x shape x stride against its blob. See docs/format.md.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import fastpersist._core as _core

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from . import limits
from .chunkmap import CHUNK_HASH_FIELD, Run, check_coverage, hashes_from_json, hashes_to_json, parse_runs, runs_in_bytes
from .layout import DATA_FILE, MANIFEST_NAME, SHARD_DIR, check_stripe_dirs
from .limits import MAX_BYTES, check_manifest_size
from .quote import shown
from .records import TensorRecord, dtype_itemsize, records_from_json
from .seal import SEAL_FIELD, seal, unseal

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "FileEntry",
    "Manifest",
    "StreamText",
    "build",
    "read_manifest",
    "read_manifest_bytes",
    "stream_text",
]

FORMAT_NAME = "fastpersist"
#: (major, minor). A reader accepts any minor of its major and rejects other majors.
#: 1.1 added the ``manifest_sha256`` seal (see :func:`seal`); 1.0 manifests carry none.
#: 1.2 added ``bytes_blob`` tree nodes (tree spec_version 2): bytes values over 4 KiB in the data
#: stream. A 1.1 reader loads 1.2 checkpoints without them and refuses the others by their
#: spec_version ("upgrade fastpersist").
#: 1.3 added ``chunk_xxh3_128`` and ``incremental`` (a step an incremental save may build on; older
#: 1.x readers ignore both). 2.0 is an incremental step that refers to earlier bytes: its files hold
#: chunks of the stream in runs (``stream_chunks``, format/chunkmap.py), which a 1.x reader cannot
#: place, so it refuses the major ("upgrade fastpersist"). A save writes the lowest that describes it.
FORMAT_VERSION = (1, 2)
#: Majors this reader accepts.
READ_MAJORS = (1, 2)


@dataclass(frozen=True)
class FileEntry:
    """One data file: a contiguous range of the logical byte stream (from `stream_offset_bytes`),
    or, in format 2.0, chunks of it in runs (`stream_chunks`, format/chunkmap.py)."""

    name: str
    stripe: int | None
    writer: int
    stream_offset_bytes: int
    len_bytes: int
    chunk_crc32c: list[int]
    stream_chunks: tuple[Run, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        where: dict[str, Any] = (
            {"stream_offset_bytes": self.stream_offset_bytes}
            if self.stream_chunks is None
            else {"stream_chunks": [list(run) for run in self.stream_chunks]}
        )
        return {
            "name": self.name,
            "stripe": self.stripe,
            "writer": self.writer,
            **where,
            "len_bytes": self.len_bytes,
            "chunk_crc32c": self.chunk_crc32c,
        }

    def chunk_runs(self, chunk_bytes: int) -> tuple[Run, ...]:
        """``(file chunk, stream chunk, count)`` of each run of stream chunks the file holds (a
        format 1.x file is one run: it starts on a chunk boundary, which :func:`parse` checks)."""
        if self.stream_chunks is not None:
            return self.stream_chunks
        return ((0, self.stream_offset_bytes // chunk_bytes, _core.chunk_count(self.len_bytes, chunk_bytes)),)

    def runs(self, chunk_bytes: int, total_bytes: int) -> list[tuple[int, int, int]]:
        """``(file offset, stream offset, length)`` of each range of the stream the file holds."""
        return runs_in_bytes(
            self.stream_chunks,
            self.stream_offset_bytes,
            self.len_bytes,
            chunk_bytes=chunk_bytes,
            total_bytes=total_bytes,
        )


@dataclass(frozen=True)
class Manifest:
    """A validated manifest."""

    format_version: tuple[int, int]
    checkpoint_id: str
    created: str
    library_version: str
    chunk_bytes: int
    checksum: str
    total_bytes: int
    blobs: list[tuple[int, int]]
    files: list[FileEntry]
    stripes: list[str]
    tensors: list[TensorRecord]
    tree: dict[str, Any]
    extra: dict[str, Any]
    #: Sub-directories holding one shard each (a sharded save); empty otherwise.
    shards: list[str] = field(default_factory=list)
    #: XXH3-128 of each chunk of the stream, 16 bytes each (format 1.3+), else None.
    chunk_hashes: bytes | None = None
    #: Saves since the last full one that wrote this step's bytes (0: it holds only its own).
    incremental_depth: int = 0

    @property
    def refers(self) -> bool:
        """Whether some of the step's bytes were written by an earlier save (format 2.0)."""
        return any(f.stream_chunks is not None for f in self.files) and self.format_version[0] >= 2

    def file_path(self, root: str, entry: FileEntry) -> str:
        """Where `entry` lives, for a checkpoint directory `root`."""
        base = root if entry.stripe is None else self.stripes[entry.stripe]
        return os.path.join(base, entry.name)


def _dumps(value: Any) -> str:
    return json.dumps(value, allow_nan=False, separators=(",", ":"))


@dataclass(frozen=True)
class StreamText:
    """The manifest members fixed once a save is planned (blobs, tensors, tree), as JSON text.

    They are most of a manifest's bytes (~8 ms of serialising for 1,000 tensors), so a save
    serialises them while its data is written (:func:`stream_text`) and :func:`build` only
    joins them with the members known at the commit.
    """

    blobs: str
    tensors_tree: str
    tensors: list[dict[str, Any]]
    tree: dict[str, Any]


def stream_text(
    offsets: Sequence[int], lengths: Sequence[int], tensors: list[dict[str, Any]], tree: dict[str, Any]
) -> StreamText:
    """:class:`StreamText` of a planned save's blobs (stream `offsets`, `lengths`), `tensors` and `tree`."""
    body = _dumps({"tensors": tensors, "tree": tree})
    blobs = [{"offset_bytes": o, "len_bytes": n} for o, n in zip(offsets, lengths, strict=True)]
    return StreamText(_dumps(blobs), body[1:-1], tensors, tree)


def build(
    *,
    checkpoint_id: str,
    chunk_bytes: int,
    checksum: str,
    total_bytes: int,
    files: list[FileEntry],
    stripes: list[str],
    stream: StreamText | None = None,
    blobs: list[tuple[int, int]] | None = None,
    tensors: list[dict[str, Any]] | None = None,
    tree: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    shards: list[str] | None = None,
    chunk_hashes: bytes | None = None,
    incremental_depth: int = 0,
) -> bytes:
    """Serialises a manifest (the inverse of :func:`parse`): from `stream`, or from `blobs`,
    `tensors` and `tree` (the same bytes either way). `chunk_hashes` (``_core.chunk_hashes``)
    makes it 1.3; files with ``stream_chunks`` make it 2.0.

    Raises:
        UnsupportedValueError: the manifest would be larger than a reader accepts
            (:func:`~fastpersist.format.limits.check_manifest_size`); nothing is written.
    """
    if stream is None:
        assert blobs is not None and tensors is not None and tree is not None
        stream = stream_text([o for o, _ in blobs], [n for _, n in blobs], tensors, tree)
    mapped = any(f.stream_chunks is not None for f in files)
    version = (2, 0) if mapped else (1, 3) if chunk_hashes is not None else FORMAT_VERSION
    head = {
        "format": FORMAT_NAME,
        "format_version": list(version),
        "checkpoint_id": checkpoint_id,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "library_version": _core.__version__,
        "chunk_bytes": chunk_bytes,
        "checksum": checksum,
        "extent_align_bytes": 64,
        "total_bytes": total_bytes,
    }
    tail: dict[str, Any] = {"extra": extra or {}}
    if shards:
        tail["shards"] = shards
    if chunk_hashes is not None:
        tail["incremental"] = {"depth": incremental_depth}
        tail[CHUNK_HASH_FIELD] = hashes_to_json(chunk_hashes)
    # The members in the order json.dumps of one dict would give them.
    text = (
        f'{_dumps(head)[:-1]},"blobs":{stream.blobs},"files":{_dumps([f.to_json() for f in files])},'
        f'"stripes":{_dumps(stripes)},{stream.tensors_tree},{_dumps(tail)[1:]}'
    )
    manifest = seal(text.encode())
    check_manifest_size(manifest, stream.tree, stream.tensors)
    return manifest


def read_manifest(root: str, *, layout_only: bool = False) -> Manifest:
    """Reads and validates ``root/manifest.json``.

    Raises:
        CheckpointNotFoundError: `root` or its manifest does not exist (a partial or missing
            checkpoint); it is also a ``FileNotFoundError``.
        CorruptCheckpointError: the manifest is malformed, inconsistent, fails its seal, or is
            not a regular file; the message says where.
    """
    return parse(read_manifest_bytes(root), where=os.path.join(root, MANIFEST_NAME), layout_only=layout_only)


def read_manifest_bytes(root: str) -> bytes:
    """The bytes of ``root/manifest.json``, unparsed (what a partner is sent), read as
    :func:`read_manifest` reads them: never through a link, never waiting on a FIFO, bounded.

    Raises:
        CheckpointNotFoundError: as :func:`read_manifest`.
        CorruptCheckpointError: the manifest is not a regular file, or over the size limit.
    """
    path = os.path.join(root, MANIFEST_NAME)
    if not os.path.isdir(root):
        if os.path.exists(root):
            raise CorruptCheckpointError(f"{root} is not a fastpersist checkpoint (not a directory)")
        raise CheckpointNotFoundError(errno.ENOENT, "no checkpoint here", root)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            errno.ENOENT, "no manifest.json: not a committed fastpersist checkpoint (deleted, or a save died)", path
        ) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorruptCheckpointError(f"{path} is a symbolic link; a manifest is a regular file") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(f"{path} is not a regular file")
        if st.st_size > limits.MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(
                f"{path}: manifest of {st.st_size} bytes is over the {limits.MAX_MANIFEST_BYTES}-byte limit "
                "(MAX_MANIFEST_BYTES); fastpersist never writes one that large, so it is damaged or not its own"
            )
        return f.read(st.st_size + 1)  # bounded by the size checked above; +1 sees growth


def _int(doc: dict[str, Any], key: str, where: str, *, minimum: int = 0) -> int:
    value = doc.get(key)
    if type(value) is not int or not minimum <= value <= MAX_BYTES:
        raise CorruptCheckpointError(
            f"{where}: field {key!r} must be an integer in [{minimum}, 2**60], found {shown(value)}"
        )
    return value


def parse(raw: bytes, *, where: str = MANIFEST_NAME, layout_only: bool = False) -> Manifest:
    """Parses and validates manifest bytes. `where` names the file in error messages.
    `layout_only`: the stream's files, blobs and hashes without the tensors and the tree (left
    empty, not read): what an incremental save needs of its base, at a third of the cost.

    The seal is checked first (:func:`unseal`): nothing in a manifest whose bytes changed is used.
    """
    body, sealed = unseal(raw, where)
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({shown(e)})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: not a fastpersist manifest")
    version = doc.get("format_version")
    if not isinstance(version, list) or len(version) != 2 or not all(type(v) is int and v >= 0 for v in version):
        raise CorruptCheckpointError(f"{where}: bad format_version {shown(version)}")
    if version[0] not in READ_MAJORS:
        raise CorruptCheckpointError(
            f"{where}: format version {version[0]}.{version[1]} is not supported by this fastpersist "
            f"(reads {' and '.join(f'{m}.x' for m in READ_MAJORS)}); upgrade fastpersist to load it"
        )
    if not sealed and version != [1, 0]:
        raise CorruptCheckpointError(
            f"{where}: format {version[0]}.{version[1]} manifests end with a {SEAL_FIELD} seal and this one has "
            "none (damaged or truncated)"
        )
    chunk_bytes = _int(doc, "chunk_bytes", where, minimum=_core.DIRECT_ALIGN_BYTES)
    try:
        _core.check_chunk_bytes(chunk_bytes)
    except ValueError as e:
        raise CorruptCheckpointError(f"{where}: {e}") from None
    total_bytes = _int(doc, "total_bytes", where)
    checksum = doc.get("checksum")
    if checksum not in ("crc32c", "off"):
        raise CorruptCheckpointError(f"{where}: unknown checksum {shown(checksum)}")
    stripes = doc.get("stripes", [])
    if not isinstance(stripes, list) or not all(isinstance(s, str) and os.path.isabs(s) for s in stripes):
        raise CorruptCheckpointError(f"{where}: stripes must be a list of absolute directory paths")
    checkpoint_id = doc.get("checkpoint_id", "")
    check_stripe_dirs(stripes, checkpoint_id if isinstance(checkpoint_id, str) else "", where)
    files = _parse_files(doc.get("files"), where, chunk_bytes, total_bytes, checksum, len(stripes), version[0] >= 2)
    chunk_hashes = hashes_from_json(doc.get(CHUNK_HASH_FIELD), where, chunk_bytes=chunk_bytes, total_bytes=total_bytes)
    blobs = _parse_blobs(doc.get("blobs"), where, total_bytes)
    tensors, tree = ([], {}) if layout_only else (_records(doc, blobs, where), doc.get("tree"))
    if not isinstance(tree, dict):
        raise CorruptCheckpointError(f"{where}: missing tree")
    extra = doc.get("extra", {})
    if not isinstance(extra, dict):
        raise CorruptCheckpointError(f"{where}: extra must be an object")
    shards = doc.get("shards", [])
    if not isinstance(shards, list) or not all(isinstance(n, str) and SHARD_DIR.match(n) for n in shards):
        raise CorruptCheckpointError(f"{where}: shards must be a list of names like 'shard-00000'")
    if len(set(shards)) != len(shards):
        raise CorruptCheckpointError(f"{where}: a shard is listed twice")
    strings = {k: doc.get(k, "") for k in ("checkpoint_id", "created", "library_version")}
    if not all(isinstance(v, str) for v in strings.values()):
        raise CorruptCheckpointError(f"{where}: checkpoint_id, created and library_version must be strings")
    return Manifest(
        format_version=(version[0], version[1]),
        checkpoint_id=strings["checkpoint_id"],
        created=strings["created"],
        library_version=strings["library_version"],
        chunk_bytes=chunk_bytes,
        checksum=checksum,
        total_bytes=total_bytes,
        blobs=blobs,
        files=files,
        stripes=stripes,
        tensors=tensors,
        tree=tree,
        extra=extra,
        shards=shards,
        chunk_hashes=chunk_hashes,
        incremental_depth=_incremental_depth(doc, where),
    )


def _records(doc: dict[str, Any], blobs: list[tuple[int, int]], where: str) -> list[TensorRecord]:
    """The manifest's tensor records, each checked to fit its blob."""
    try:
        tensors = records_from_json(doc.get("tensors"))
    except ValueError as e:
        raise CorruptCheckpointError(f"{where}: bad tensor record: {e}") from None
    _check_tensors_fit(tensors, blobs, where)
    return tensors


def _incremental_depth(doc: dict[str, Any], where: str) -> int:
    incremental = doc.get("incremental", {"depth": 0})
    if not isinstance(incremental, dict) or type(incremental.get("depth")) is not int or incremental["depth"] < 0:
        raise CorruptCheckpointError(f"{where}: incremental must be an object with a non-negative depth")
    return int(incremental["depth"])


def _parse_files(
    items: object, where: str, chunk_bytes: int, total_bytes: int, checksum: str, stripe_count: int, mapped: bool
) -> list[FileEntry]:
    if not isinstance(items, list):
        raise CorruptCheckpointError(f"{where}: files must be a list")
    files = []
    seen: set[tuple[int | None, str]] = set()
    for i, item in enumerate(items):
        at = f"{where}: files[{i}]"
        if not isinstance(item, dict):
            raise CorruptCheckpointError(f"{at} must be an object")
        name = item.get("name")
        if not isinstance(name, str) or not DATA_FILE.match(name) or name == MANIFEST_NAME or ".." in name:
            raise CorruptCheckpointError(
                f"{at}: file name {shown(name)} is not a plain file name inside the checkpoint"
            )
        stripe = item.get("stripe")
        if stripe is not None and (type(stripe) is not int or not 0 <= stripe < stripe_count):
            raise CorruptCheckpointError(f"{at}: stripe {shown(stripe)} out of range (0..{stripe_count - 1})")
        if (stripe, name) in seen:
            raise CorruptCheckpointError(f"{at}: file {shown(name)} listed twice")
        seen.add((stripe, name))
        length = _int(item, "len_bytes", at, minimum=1)
        if mapped:
            offset = 0
            runs: tuple[Run, ...] | None = parse_runs(
                item.get("stream_chunks"),
                f"{at} ({shown(name)})",
                len_bytes=length,
                chunk_bytes=chunk_bytes,
                total_bytes=total_bytes,
            )
        else:
            offset, runs = _int(item, "stream_offset_bytes", at), None
        writer = _int(item, "writer", at)
        crcs = item.get("chunk_crc32c")
        if not isinstance(crcs, list) or not all(type(c) is int and 0 <= c < 1 << 32 for c in crcs):
            raise CorruptCheckpointError(f"{at}: chunk_crc32c must be a list of 32-bit integers")
        chunks = _core.chunk_count(length, chunk_bytes)
        if len(crcs) != (chunks if checksum == "crc32c" else 0):
            raise CorruptCheckpointError(f"{at} ({shown(name)}): {len(crcs)} chunk checksums for {chunks} chunks")
        if offset % chunk_bytes:
            raise CorruptCheckpointError(f"{at} ({shown(name)}): stream offset {offset} is not chunk-aligned")
        files.append(FileEntry(name, stripe, writer, offset, length, crcs, runs))
    if mapped:
        check_coverage(
            [(f.name, f.stream_chunks or ()) for f in files],
            chunk_bytes=chunk_bytes,
            total_bytes=total_bytes,
            where=where,
        )
        return files
    cursor = 0
    for entry in sorted(files, key=lambda f: f.stream_offset_bytes):
        if entry.stream_offset_bytes != cursor:
            kind = "overlaps" if entry.stream_offset_bytes < cursor else "leaves a gap before"
            raise CorruptCheckpointError(
                f"{where}: file {shown(entry.name)} {kind} byte {cursor} of the data stream "
                f"(it starts at {entry.stream_offset_bytes})"
            )
        cursor += entry.len_bytes
    if cursor != total_bytes:
        raise CorruptCheckpointError(f"{where}: files hold {cursor} bytes but total_bytes is {total_bytes}")
    return files


def _parse_blobs(items: object, where: str, total_bytes: int) -> list[tuple[int, int]]:
    if not isinstance(items, list):
        raise CorruptCheckpointError(f"{where}: blobs must be a list")
    blobs = []
    end = 0
    for i, item in enumerate(items):
        at = f"{where}: blobs[{i}]"
        if not isinstance(item, dict):
            raise CorruptCheckpointError(f"{at} must be an object")
        offset, length = _int(item, "offset_bytes", at), _int(item, "len_bytes", at)
        if offset < end or offset + length > total_bytes:
            raise CorruptCheckpointError(
                f"{at}: bytes [{offset}, {offset + length}) overlap the previous blob or leave the "
                f"{total_bytes}-byte stream"
            )
        end = offset + length
        blobs.append((offset, length))
    return blobs


def _check_tensors_fit(tensors: list[TensorRecord], blobs: list[tuple[int, int]], where: str) -> None:
    def at(i: int, t: TensorRecord) -> str:  # built only for an error: a load may check 100,000s
        return f"{where}: tensor {i} ({shown(t.key_path)})"

    itemsizes: dict[tuple[str, str], int] = {}
    for i, t in enumerate(tensors):
        if not 0 <= t.blob < len(blobs):
            raise CorruptCheckpointError(f"{at(i, t)}: blob index {t.blob} out of range")
        if len(t.stride) != len(t.shape) or any(s < 0 for s in t.stride):
            raise CorruptCheckpointError(f"{at(i, t)}: stride {shown(t.stride)} does not fit shape {shown(t.shape)}")
        if t.device == "meta":  # shape and strides only: no bytes in the blob
            continue
        itemsize = itemsizes.get((t.kind, t.dtype))
        if itemsize is None:
            itemsize = itemsizes[t.kind, t.dtype] = dtype_itemsize(t.kind, t.dtype)
        if 0 in t.shape:
            span = 0
        else:
            span = (sum((n - 1) * s for n, s in zip(t.shape, t.stride, strict=True)) + 1) * itemsize
        blob_len = blobs[t.blob][1]
        if t.offset_bytes < 0 or t.offset_bytes + span > blob_len or t.offset_bytes % itemsize:
            raise CorruptCheckpointError(
                f"{at(i, t)}: {shown(t.dtype)} {shown(t.shape)} at byte {t.offset_bytes} needs {span} bytes but blob "
                f"{t.blob} has {blob_len}"
            )
