"""Where the remote level keeps its objects: a directory (a shared filesystem mount) or an
S3-compatible object store.

Both are a flat space of keys (``step-00000012/data-w0-s0.bin``) with the few operations the
remote level needs. A file is uploaded from a local copy piece by piece, every chunk's crc32c
checked against the manifest on the way (a damaged local copy is never propagated), and
downloaded with ranged reads, checked again. The object store is reached through obstore (the
Rust ``object_store`` crate: parallel multipart uploads and concurrent ranged reads, the GIL
released while it waits; docs/levels.md says why); its endpoint, region and credentials come
from the usual AWS environment variables (``AWS_ENDPOINT_URL``, ``AWS_REGION``,
``AWS_ACCESS_KEY_ID``, ...), so S3-compatible stores work too. With no credentials in the
environment, the client asks the cloud's instance metadata service (169.254.169.254) for them;
``FASTPERSIST_S3_INSTANCE_METADATA=off`` forbids that (:func:`check_credentials`).
"""

from __future__ import annotations

import abc
import contextlib
import datetime
import errno
import os
import shutil
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, cast

import fastpersist._core as _core

from ..engine import PartFile, read_file_range
from ..errors import CorruptCheckpointError
from ..format.layout import write_small_file
from ..format.ownership import REMOVING, remove_owned_dir

__all__ = [
    "COPY_PIECE_BYTES",
    "METADATA_ENV",
    "PROBE_TIMEOUT_S",
    "DirStore",
    "FileCopy",
    "S3Store",
    "Store",
    "check_credentials",
    "open_store",
]

#: One piece of an object read from a store: ``(lo, hi, its bytes)``.
Piece = tuple[int, int, bytes | memoryview]
#: Bytes moved at a time (the throttle runs between pieces).
COPY_PIECE_BYTES = 8 << 20
#: The longest one request of a restore's first look at an object store may take, retries
#: included (a bounded store: see :class:`S3Store`); connecting gets a fifth of it.
PROBE_TIMEOUT_S = 10.0
#: ``off``: never ask the instance metadata service for credentials (:func:`check_credentials`).
METADATA_ENV = "FASTPERSIST_S3_INSTANCE_METADATA"
#: The environment variables that give the object store client credentials without asking the
#: instance metadata service.
_CREDENTIAL_SOURCES = (
    ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
    ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN"),
    ("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",),
    ("AWS_CONTAINER_CREDENTIALS_FULL_URI",),
)


@dataclass(frozen=True)
class FileCopy:
    """One file to move: its key relative to the step, size, and chunk checksums (empty: a manifest)."""

    name: str
    len_bytes: int
    chunk_crc32c: list[int]
    chunk_bytes: int

    def pieces(self) -> list[tuple[int, int]]:
        step = max(self.chunk_bytes, COPY_PIECE_BYTES // self.chunk_bytes * self.chunk_bytes)
        return [(a, min(a + step, self.len_bytes)) for a in range(0, self.len_bytes, step)]

    def check(self, where: str, offset: int, data: bytes | memoryview) -> None:
        """Raises :class:`~fastpersist.ChecksumMismatchError` (the engine's, naming `where` and the
        chunk) unless `data`, the bytes at `offset`, match the recorded chunk checksums."""
        if self.chunk_crc32c:
            _core.check_chunks(where, data, offset, self.chunk_bytes, self.chunk_crc32c)


def _manifest_pieces(path: str, f: FileCopy, throttle: Callable[[int], None]) -> Iterator[bytes]:
    """A manifest's pieces (no chunk checksums: its seal is checked where it is parsed), read
    whole; part files are read by the engine (:func:`_engine_pieces`)."""
    with open(path, "rb", buffering=0) as fin:
        for lo, hi in f.pieces():
            data = fin.read(hi - lo)
            if len(data) != hi - lo:
                raise CorruptCheckpointError(f"{path}: ends before {hi} bytes, the manifest says {f.len_bytes}")
            yield data
            throttle(len(data))


def _local_pieces(path: str, f: FileCopy, throttle: Callable[[int], None]) -> Iterator[bytes | memoryview]:
    """The local file's pieces, checked, each one valid until the next is asked for."""
    return _engine_pieces(path, f, throttle) if f.chunk_crc32c else _manifest_pieces(path, f, throttle)


def _engine_pieces(path: str, f: FileCopy, throttle: Callable[[int], None]) -> Generator[memoryview, None, None]:
    """The local data file's pieces read by the engine (O_DIRECT where the filesystem takes it,
    each chunk's crc32c checked in Rust, the GIL released), one piece ahead into the other of two
    page-aligned buffers; a piece stays valid until the next is asked for. Each view is the
    piece's bytes; the buffer behind it (``view.obj``) is page-aligned and padded to the page."""
    pieces = f.pieces()
    align = _core.DIRECT_ALIGN_BYTES
    size = -(-max((hi - lo for lo, hi in pieces), default=align) // align) * align
    buffers = [_core.PagedBuffer(size), _core.PagedBuffer(size)]

    def read(k: int) -> None:
        lo, hi = pieces[k]
        read_file_range(path, f.len_bytes, lo, hi - lo, f.chunk_crc32c, buffers[k % 2], f.chunk_bytes)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastpersist-drain-read") as reader:
        ahead = reader.submit(read, 0) if pieces else None
        for k, (lo, hi) in enumerate(pieces):
            assert ahead is not None
            ahead.result()
            ahead = reader.submit(read, k + 1) if k + 1 < len(pieces) else None
            yield memoryview(buffers[k % 2])[: hi - lo]
            throttle(hi - lo)


class Store(abc.ABC):
    """The operations of a remote store (see the module docstring)."""

    url: str

    @abc.abstractmethod
    def where(self, key: str) -> str:
        """The key as a user names it (a path or a URL), for messages and ``fp.load``."""
        ...

    @abc.abstractmethod
    def upload(self, key: str, local: str, f: FileCopy, throttle: Callable[[int], None]) -> None: ...

    @abc.abstractmethod
    def copy(self, src: str, dst: str, f: FileCopy, throttle: Callable[[int], None]) -> None:
        """Makes `dst` the object `src` (the file `f`) holds, inside the store (no byte through
        this process): an incremental step's file that an earlier remote step holds already."""
        ...

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes, *, durable: bool = True) -> None:
        """Writes the object whole. ``durable=False``: visible to every reader but not forced to
        stable storage (a drain's marker: the data it vouches for is durable already, and only the
        manifest commits)."""
        ...

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes | None:
        """The object's bytes, or None if there is none."""
        ...

    @abc.abstractmethod
    def get_range(self, key: str, lo: int, hi: int) -> bytes: ...

    @abc.abstractmethod
    def size(self, key: str) -> int | None:
        """The object's size in bytes (a stat or a HEAD: no data read), or None if there is none."""
        ...

    @abc.abstractmethod
    def children(self) -> list[str]:
        """The names directly under the store's root (step directories, the index)."""
        ...

    @abc.abstractmethod
    def remove_step(self, name: str, manifest: str) -> None:
        """Removes the step `name`: its `manifest` key first, so a half-removed step is no step."""
        ...

    def download(self, key: str, local: str, f: FileCopy) -> None:
        """Writes the object to the new local file `local` through the engine, its chunks
        checked, fsynced; a download that fails leaves no file."""
        os.makedirs(os.path.dirname(local), exist_ok=True)
        with PartFile(local, f.len_bytes, f.chunk_crc32c, f.chunk_bytes) as out:  # checks each chunk
            for _, _, data in self.read_pieces(key, f, checked=False):
                out.append(data)

    def read_pieces(self, key: str, f: FileCopy, *, checked: bool = True) -> Iterator[Piece]:
        """The object's pieces ``(lo, hi, bytes)``, each checked against its chunk checksums
        (`checked` False: for a caller that checks them itself, as a download's part file does)."""
        for lo, hi in f.pieces():
            data = self.get_range(key, lo, hi)
            if len(data) != hi - lo:
                raise CorruptCheckpointError(f"{self.where(key)}: {len(data)} bytes at {lo}, expected {hi - lo}")
            if checked:
                f.check(self.where(key), lo, data)
            yield lo, hi, data


class DirStore(Store):
    """A directory, typically on a shared filesystem."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root
        os.makedirs(self.root, exist_ok=True)

    def where(self, key: str) -> str:
        return os.path.join(self.root, key)

    def upload(self, key: str, local: str, f: FileCopy, throttle: Callable[[int], None]) -> None:
        dst = self.where(key)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):  # a new inode: an old one may be another step's too
            os.unlink(dst)
        # The pieces were checked as they were read: not again. Page-aligned ones go out with
        # O_DIRECT from where they lie.
        with PartFile(dst, f.len_bytes, [], f.chunk_bytes, replace=True) as out:
            for data in _local_pieces(local, f, throttle):
                out.append(data)
        _core.fsync_dir(os.path.dirname(dst))

    def copy(self, src: str, dst: str, f: FileCopy, throttle: Callable[[int], None]) -> None:
        """A hard link (one inode for both steps; nothing writes into a stored file, :meth:`upload`
        makes a new one), or an upload of the stored file where the filesystem links none."""
        target = self.where(dst)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
        try:
            os.link(self.where(src), target, follow_symlinks=False)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
            self.upload(dst, self.where(src), f, throttle)
            return
        _core.fsync_dir(os.path.dirname(target))

    def put_bytes(self, key: str, data: bytes, *, durable: bool = True) -> None:
        os.makedirs(os.path.dirname(self.where(key)), exist_ok=True)
        write_small_file(self.where(key), data, durable=durable)

    def get_bytes(self, key: str) -> bytes | None:
        try:
            with open(self.where(key), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def get_range(self, key: str, lo: int, hi: int) -> bytes:
        with open(self.where(key), "rb") as f:
            f.seek(lo)
            return f.read(hi - lo)

    def read_pieces(self, key: str, f: FileCopy, *, checked: bool = True) -> Iterator[Piece]:
        """A part file's pieces read by the engine, as an upload reads a local one (O_DIRECT where
        the filesystem takes it, its size and, if `checked`, each chunk checked in Rust); each
        piece is valid until the next is asked for. A manifest is read as any object."""
        if not f.chunk_crc32c:
            yield from super().read_pieces(key, f, checked=checked)
            return
        read = f if checked else replace(f, chunk_crc32c=[])
        for (lo, hi), data in zip(f.pieces(), _engine_pieces(self.where(key), read, lambda n: None), strict=True):
            yield lo, hi, data

    def children(self) -> list[str]:
        for name in os.listdir(self.root):
            if REMOVING.match(name):  # a removal a crash cut short
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        return sorted(os.listdir(self.root))

    def size(self, key: str) -> int | None:
        try:
            return os.path.getsize(self.where(key))
        except FileNotFoundError:
            return None

    def remove_step(self, name: str, manifest: str) -> None:
        remove_owned_dir(self.where(name))  # renamed first: one atomic step out of sight


def check_credentials(url: str, environ: Any = os.environ) -> None:
    """Raises ValueError when ``FASTPERSIST_S3_INSTANCE_METADATA=off`` and the environment names
    no credentials: the client would otherwise ask the instance metadata service for them.

    The client's order (obstore, the Rust ``object_store`` crate): ``AWS_ACCESS_KEY_ID`` and
    ``AWS_SECRET_ACCESS_KEY``; a web identity token (``AWS_WEB_IDENTITY_TOKEN_FILE`` and
    ``AWS_ROLE_ARN``); container credentials (``AWS_CONTAINER_CREDENTIALS_RELATIVE_URI`` or
    ``_FULL_URI``); else the instance metadata service (``AWS_METADATA_ENDPOINT``, by default
    ``http://169.254.169.254``). ``AWS_SKIP_SIGNATURE=true`` sends unsigned requests instead.
    """
    if environ.get(METADATA_ENV, "").lower() not in ("off", "0", "false", "no"):
        return
    if environ.get("AWS_SKIP_SIGNATURE", "").lower() in ("1", "true", "yes"):
        return
    if any(all(environ.get(name) for name in names) for names in _CREDENTIAL_SOURCES):
        return
    wanted = "; ".join(" and ".join(names) for names in _CREDENTIAL_SOURCES)
    raise ValueError(
        f"{url}: no S3 credentials in the environment, and {METADATA_ENV}=off forbids asking the instance "
        f"metadata service for them. Set one of: {wanted}; or AWS_SKIP_SIGNATURE=true for a public bucket"
    )


class S3Store(Store):
    """An S3-compatible bucket and prefix, through obstore.

    `bounded`: each request, retries included, gives up after :data:`PROBE_TIMEOUT_S` (a
    restore's first look at the store); otherwise the client's defaults (30 s per request,
    retried for up to 3 minutes: a drain outlives a short outage)."""

    def __init__(self, url: str, *, bounded: bool = False) -> None:
        try:
            from obstore.store import S3Store as ObjectStore
        except ImportError as e:
            raise ImportError("Remote('s3://...') needs obstore: pip install 'fastpersist[s3]'") from e
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not bucket:
            raise ValueError(f"{url!r}: expected s3://bucket/prefix")
        check_credentials(url)
        self.url = url.rstrip("/")
        self.prefix = prefix.strip("/")
        client: dict[str, Any] = {}
        # An http:// endpoint (a local S3-compatible server) needs plain HTTP allowed.
        if os.environ.get("AWS_ENDPOINT_URL", "").startswith("http://"):
            client["allow_http"] = True
        retry: Any = None
        if bounded:
            limit = datetime.timedelta(seconds=PROBE_TIMEOUT_S)
            client.update(connect_timeout=limit / 5, timeout=limit)
            retry = {"max_retries": 2, "retry_timeout": limit}
        self.store: Any = ObjectStore(
            bucket, prefix=self.prefix or None, client_options=cast(Any, client or None), retry_config=retry
        )

    def where(self, key: str) -> str:
        return f"{self.url}/{key}"

    def upload(self, key: str, local: str, f: FileCopy, throttle: Callable[[int], None]) -> None:
        import obstore

        # obstore may hold a piece after asking for the next: each is its own bytes
        pieces = (bytes(data) for data in _local_pieces(local, f, throttle))
        obstore.put(self.store, key, pieces, chunk_size=COPY_PIECE_BYTES)

    def copy(self, src: str, dst: str, f: FileCopy, throttle: Callable[[int], None]) -> None:
        import obstore  # S3 CopyObject: the bytes move inside the store

        obstore.copy(self.store, src, dst, overwrite=True)

    def put_bytes(self, key: str, data: bytes, *, durable: bool = True) -> None:
        import obstore  # a completed PUT is durable: nothing to choose

        obstore.put(self.store, key, data)

    def get_bytes(self, key: str) -> bytes | None:
        import obstore

        try:
            return bytes(obstore.get(self.store, key).bytes())
        except FileNotFoundError:
            return None

    def get_range(self, key: str, lo: int, hi: int) -> bytes:
        import obstore

        return bytes(obstore.get_range(self.store, key, start=lo, end=hi))

    def size(self, key: str) -> int | None:
        import obstore

        try:
            return int(obstore.head(self.store, key)["size"])
        except FileNotFoundError:
            return None

    def read_pieces(self, key: str, f: FileCopy, *, checked: bool = True) -> Iterator[Piece]:
        import obstore

        spans = f.pieces()
        batch = 8  # ranged reads in flight at once
        for k in range(0, len(spans), batch):
            group = spans[k : k + batch]
            datas = obstore.get_ranges(self.store, key, starts=[a for a, _ in group], ends=[b for _, b in group])
            for (lo, hi), data in zip(group, datas, strict=True):
                raw = bytes(data)
                if len(raw) != hi - lo:
                    raise CorruptCheckpointError(f"{self.where(key)}: {len(raw)} bytes at {lo}, expected {hi - lo}")
                if checked:
                    f.check(self.where(key), lo, raw)
                yield lo, hi, raw

    def children(self) -> list[str]:
        import obstore

        found = obstore.list_with_delimiter(self.store, None)
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in found["common_prefixes"]]
        names += [o["path"].rsplit("/", 1)[-1] for o in found["objects"]]
        return sorted(set(names))

    def remove_step(self, name: str, manifest: str) -> None:
        import obstore

        obstore.delete(self.store, f"{name}/{manifest}")  # uncommitted first
        keys = [o["path"] for batch in obstore.list(self.store, f"{name}/") for o in batch]
        if keys:
            obstore.delete(self.store, keys)


def open_store(target: str | os.PathLike[str], *, bounded: bool = False) -> Store:
    """The store `target` names: ``s3://bucket/prefix``, else a directory (`bounded`: see :class:`S3Store`)."""
    text = os.fspath(target)
    if text.startswith("s3://"):
        return S3Store(text, bounded=bounded)
    if "://" in text:
        raise ValueError(f"{text!r}: a remote is a directory or an s3://bucket/prefix URL")
    return DirStore(text)
