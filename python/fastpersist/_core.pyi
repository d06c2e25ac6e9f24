"""Type stub of ``fastpersist._core``: the PyO3 bindings to the Rust engine.

Hand-written; checked against the compiled module by
``python -m mypy.stubtest fastpersist._core --allowlist .mypy-stubtest-allowlist``.

Every function that touches a file or a large buffer releases the GIL while it works.
Operating-system failures raise real ``OSError`` subclasses with ``errno`` and ``filename`` set;
engine failures raise the classes of :mod:`fastpersist.errors`, and an exception that a callback
(``on_staged``, ``device.copy``) raised inside a job is raised again as itself.
"""

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, TypedDict, final, type_check_only

import numpy as np
from typing_extensions import Buffer

__all__ = [
    "DIRECT_ALIGN_BYTES",
    "EXTENT_ALIGN_BYTES",
    "MAX_CHUNK_BYTES",
    "MAX_QUEUE_DEPTH",
    "Arena",
    "ArenaLease",
    "Plan",
    "Pool",
    "WriteGate",
    "WriteHandle",
    "__version__",
    "check_chunk_bytes",
    "chunk_count",
    "chunk_hashes",
    "chunk_runs",
    "chunk_spans",
    "check_chunks",
    "crc32c",
    "direct_io_supported",
    "flatten_walk",
    "fsync_dir",
    "fsync_path",
    "is_memory_fs",
    "probe_uring",
    "replace_atomically",
    "select_backend",
    "start_write",
    "writes_in_memory",
    "read_ranges_into",
    "PagedBuffer",
    "PartFileWriter",
    "MemoryFileAhead",
]

__version__: str
#: Alignment (bytes) of file offsets, lengths and buffer addresses for O_DIRECT.
DIRECT_ALIGN_BYTES: int
#: Alignment (bytes) of every extent (tensor) inside the logical stream.
EXTENT_ALIGN_BYTES: int
#: Largest chunk (one aligned write or read).
MAX_CHUNK_BYTES: int
#: Most transfers a job keeps in flight.
MAX_QUEUE_DEPTH: int

_StrPath = str | os.PathLike[str]
# Any object with the buffer protocol. numpy's stubs declare ndarray.__buffer__ only for Python
# >= 3.12, so arrays are named explicitly for checkers targeting 3.11.
_Buffer = Buffer | np.ndarray[Any, Any]
_BackendChoice = Literal["auto", "io_uring", "threads"]
#: ``"null"``: the null sink (benchmarks only): writes complete at once and move no bytes.
_WriteBackendChoice = Literal["auto", "io_uring", "threads", "null"]
_BackendName = Literal["io_uring", "threads", "null"]
_DirectIO = Literal["auto", "require", "off"]

@type_check_only
class PartReport(TypedDict):
    """What one write job wrote to one part file (an entry of ``WriteReport["parts"]``)."""

    path: str
    len_bytes: int
    #: crc32c of each ``chunk_bytes`` chunk of the file; empty when checksums are off.
    chunk_crc32c: list[int]
    #: Whether the file was written with O_DIRECT.
    direct: bool

@type_check_only
class WriteReport(TypedDict):
    """The dict :meth:`WriteHandle.wait` returns."""

    #: One entry per path given to :func:`start_write`, in that order.
    parts: list[PartReport]
    bytes_written: int
    backend: _BackendName
    #: From :func:`start_write` until every byte was written (and fsynced when durable).
    seconds: float
    #: From :func:`start_write` until the job was staged (the sources are no longer read).
    staged_seconds: float | None

@final
class Plan:
    """The layout of a checkpoint: extents in one logical stream, cut into parts.

    >>> plan = Plan([10, 100_000], writer_count=1, stripe_count=2, chunk_bytes=65536)
    >>> plan.extent_offsets, plan.total_bytes
    ([0, 64], 100064)
    """

    def __new__(
        cls,
        extent_bytes: Sequence[int],
        writer_count: int = 1,
        stripe_count: int = 1,
        chunk_bytes: int = 8388608,
    ) -> Plan: ...
    @property
    def total_bytes(self) -> int:
        """Logical stream length in bytes."""
    @property
    def chunk_bytes(self) -> int:
        """Size of one aligned write."""
    @property
    def extent_offsets(self) -> list[int]:
        """Offset of each extent in the stream (64-byte aligned, gaps are zero)."""
    @property
    def parts(self) -> list[tuple[int, int, int, int]]:
        """Parts as ``(writer, stripe, stream_offset_bytes, len_bytes)``, ordered by writer then stripe."""

@final
class Pool:
    """Page-aligned staging memory (``slot_bytes`` per slot, at least two slots), reused across saves.

    >>> pool = Pool(8 << 20, 256 << 20)
    >>> pool.slot_count
    32
    """

    def __new__(cls, slot_bytes: int, pool_bytes: int) -> Pool: ...
    @property
    def slot_bytes(self) -> int:
        """Bytes per slot (a multiple of ``DIRECT_ALIGN_BYTES``)."""
    @property
    def slot_count(self) -> int:
        """Number of slots."""
    @property
    def allocated_bytes(self) -> int:
        """Bytes allocated so far (slots are allocated on first use)."""
    @property
    def spare_bytes(self) -> int:
        """Bytes of the block kept for the next job's early copies (0 if none)."""
    def call_before_free(self, callback: Callable[[], object]) -> None:
        """Calls ``callback()`` when the pool goes, before its memory is freed (an exception is
        reported as unraisable). It must not refer to the pool."""
    def prefault(self) -> int:
        """Allocates every slot not allocated yet and faults its pages in (the GIL released), so
        that a save stages into memory the kernel already handed over; returns the bytes. A save
        running meanwhile takes the slots already made."""

@final
class Arena:
    """Page-aligned memory that saves of device tensors stage into and write from, leased to one
    save's job at a time (``len_bytes`` rounded up to whole 2 MiB pages, zeroed when made).
    Supports the buffer protocol (writable bytes).

    >>> arena = Arena(3 << 20)
    >>> arena.len_bytes, arena.leased
    (4194304, False)
    """

    def __new__(cls, len_bytes: int) -> Arena: ...
    @staticmethod
    def over_file(fd: int, file_len: int, name: str | os.PathLike[str]) -> Arena:
        """An arena that is the open file ``fd`` (duplicated: the caller closes its own), named
        ``name`` in messages: a shared mapping of it, which a save's job whose one part is that file
        stages into and only checksums (any other job refuses it). The file must be a regular file
        of exactly ``file_len`` bytes, all allocated (``ValueError`` otherwise): the mapping never
        changes it. Its length is ``file_len`` rounded up to a page."""
    @property
    def over_a_file(self) -> bool:
        """Whether it is a mapping of a file (made by :meth:`over_file`)."""
    @property
    def file_status(self) -> tuple[tuple[int, int], int] | None:
        """For an arena over a file: ``((st_dev, st_ino), st_nlink)`` of that file now (``st_nlink``
        is 0 once it is deleted); None for anonymous memory."""
    @property
    def len_bytes(self) -> int:
        """Its length in bytes."""
    @property
    def address(self) -> int:
        """The address of its first byte."""
    @property
    def leased(self) -> bool:
        """Whether a save's job holds it now."""
    def try_lease(self) -> ArenaLease | None:
        """A lease for one save, or None while another save holds it."""
    def call_before_free(self, callback: Callable[[], object]) -> None:
        """Calls ``callback()`` when the arena goes, before its memory can be freed (an exception
        is reported as unraisable). It must not refer to the arena."""
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

@final
class ArenaLease:
    """One save's hold on an :class:`Arena`; ``start_write`` takes it over, and the arena is free
    again once that save's job has ended (or the lease is dropped unused)."""

    @property
    def arena(self) -> Arena:
        """The arena it holds."""

@final
class WriteHandle:
    """A running or finished write job, returned by :func:`start_write` (not constructible)."""

    def wait_staged(self, timeout: float | None = None) -> None:
        """Waits until the sources are no longer read; raises ``TimeoutError`` after ``timeout`` seconds."""
    def wait(self, timeout: float | None = None) -> WriteReport:
        """Waits until every byte is written (fsynced when durable); raises the job's error."""
    def done(self) -> bool:
        """True once the job has finished, successfully or not."""
    def staged(self) -> bool:
        """True once the source buffers are no longer read."""
    def cancel(self) -> None:
        """Asks the job to stop; :meth:`wait` then raises ``SaveCancelledError``."""
    @property
    def bytes_staged(self) -> int:
        """Bytes copied into the staging pool so far."""
    @property
    def bytes_written(self) -> int:
        """Bytes whose write has completed so far."""
    @property
    def backend(self) -> _BackendName:
        """The backend the job runs on."""
    @property
    def fallback_reason(self) -> str | None:
        """Why ``backend="auto"`` fell back to threads, if it did."""
    @property
    def staged_seconds(self) -> float | None:
        """Seconds from the start until the job was staged, once it is."""

@final
class WriteGate:
    """Holds a write's writes back until opened: the job stages (and releases its sources) at
    once, then waits before its first write; cancelling the job ends the wait with
    :class:`SaveCancelledError`. A write given a gate stages through its ``device.lease`` arena.

    >>> gate = WriteGate()
    >>> gate.is_open
    False
    """

    def __new__(cls) -> WriteGate: ...
    def open(self) -> None:
        """Lets the job write."""
    @property
    def is_open(self) -> bool:
        """Whether it was opened."""

@type_check_only
class _DeviceHook(Protocol):
    @property
    def lease(self) -> ArenaLease: ...
    def copy(self, pieces: list[tuple[int, int, int, int]]) -> None: ...
    def wait(self) -> None: ...

@type_check_only
class WriteOptions(Protocol):
    """How a job writes (``fastpersist.engine.WriteOptions``, the core's ``job::WriteOptions``):

    * ``backend``, ``direct_io``, ``queue_depth``, ``checksum`` (crc32c per chunk), ``durable``
      (fsync the files before the job ends). ``backend="null"`` (benchmarks only) completes
      every write at once and moves no byte: the files stay empty.
    * ``staging_threads``: the most threads that copy host sources into staging (the pool, or a
      memory root's mapped files) and checksum them at once, each a contiguous share of a
      chunk (chunks of at least 4 MiB; a job with ``crc32_fields`` stages on one).
    """

    @property
    def backend(self) -> _WriteBackendChoice: ...
    @property
    def direct_io(self) -> _DirectIO: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def checksum(self) -> bool: ...
    @property
    def durable(self) -> bool: ...
    @property
    def staging_threads(self) -> int: ...

@type_check_only
class Guard(Protocol):
    """The mutation guard (``fastpersist.engine.Guard``, the core's ``job::Guard``):
    ``watched[i]`` says extent ``i``'s source may be modified while the job runs (an entry per
    extent); ``copy_early`` names watched host extents copied before ``start_write`` returns;
    ``on_staged(extents)`` is called from the job's thread once each other watched extent is
    staged whole (for a device save: once per arena window, every such extent in one call), and
    a false result (or an exception) fails the job.
    """

    @property
    def watched(self) -> Sequence[bool]: ...
    @property
    def on_staged(self) -> Callable[[list[int]], bool]: ...
    @property
    def copy_early(self) -> Sequence[int]: ...

@type_check_only
class JobHooks(Protocol):
    """What a job calls out to or waits for (``fastpersist.engine.JobHooks``, the core's
    ``job::JobHooks``):

    * ``guard``: the mutation :class:`Guard`, or ``None`` (no source is watched).
    * ``device``: for ``None`` sources. The job takes over ``device.lease`` (an arena lease), lays
      its chunks into the arena in stream order (one ``chunk_bytes`` cell each, so a tensor is
      one contiguous run) and, per arena window, calls ``device.copy(pieces)`` once with every
      ``(extent, extent_offset_bytes, arena_offset_bytes, len_bytes)`` of the window (the first
      window's before ``start_write`` returns), copies host sources in, then ``device.wait()``
      once; it writes the window straight from the arena (O_DIRECT), each chunk's crc32c
      computed by a bounded pool of threads before its write is submitted, and reuses the arena
      for the next window only after every write of this one completed. The sources are
      released once the last window is staged.
    * ``crc32_fields``: ``(start_bytes, len_bytes, [write_at_bytes, ...])`` (an
      ``engine.Crc32Field``) per range of the stream whose CRC-32 (IEEE, ``zlib.crc32``) is
      written little-endian at each offset while the range streams through staging (the record
      CRCs of a zip archive). Ranges sorted and disjoint, each offset after its range's end; the
      plan must have a single part.
    * ``write_gate``: a :class:`WriteGate` that holds the writes back until opened (with
      ``device`` only: the arena holds the snapshot meanwhile).
    """

    @property
    def guard(self) -> Guard | None: ...
    @property
    def device(self) -> _DeviceHook | None: ...
    @property
    def crc32_fields(self) -> Sequence[tuple[int, int, Sequence[int]]]: ...
    @property
    def write_gate(self) -> WriteGate | None: ...

@type_check_only
class WriteRequest(Protocol):
    """What :func:`start_write` reads, by attribute name (``fastpersist.engine.WriteRequest``;
    ``rust/fastpersist-py/src/write.rs`` reads the same names, nested as here). The one place
    they are described:

    * ``plan``; ``writer`` and ``also_writers``: the job writes ``writer``'s parts, then each of
      ``also_writers``' parts, to ``paths`` (one per part, in that order).
    * ``sources``: one C-contiguous buffer per extent of ``plan``, held (and not to be modified)
      until the handle reports them staged; ``None`` for an extent in device memory
      (``hooks.device``).
    * ``pool``: the staging slots of host sources (and the memory of their early copies).
    * ``background``: run on a thread of its own (``start_write`` returns once the early copies
      are made and, with ``hooks.device``, the first window's device copies are queued); else on
      the calling thread with the GIL released, and the handle returned is finished.
    * ``options``: :class:`WriteOptions`; ``hooks``: :class:`JobHooks`.
    """

    @property
    def plan(self) -> Plan: ...
    @property
    def writer(self) -> int: ...
    @property
    def also_writers(self) -> Sequence[int]: ...
    @property
    def paths(self) -> Sequence[_StrPath]: ...
    @property
    def sources(self) -> Sequence[object | None]: ...
    @property
    def pool(self) -> Pool: ...
    @property
    def background(self) -> bool: ...
    @property
    def options(self) -> WriteOptions: ...
    @property
    def hooks(self) -> JobHooks: ...

def start_write(request: WriteRequest) -> WriteHandle:
    """Starts the write that ``request`` describes (see :class:`WriteRequest`); returns its handle."""

def read_ranges_into(
    ranges: Sequence[tuple[_StrPath, int, int, int, int, Sequence[int]]],
    dest: _Buffer,
    *,
    chunk_bytes: int,
    backend: _BackendChoice = "auto",
    direct_io: _DirectIO = "auto",
    queue_depth: int = 8,
    stats: dict[str, float] | None = None,
) -> int:
    """Reads ranges of part files into ``dest``, verifying each chunk's crc32c.

    ``ranges`` holds ``(path, file_len_bytes, file_offset_bytes, len_bytes, dest_offset_bytes,
    chunk_crc32c)``: a range starts at a chunk boundary of its file (a whole file of ``n`` bytes
    is ``(path, n, 0, n, dest_offset_bytes, crcs)``) and ``chunk_crc32c`` lists its chunks'
    checksums (empty: unchecked). Returns the bytes read; ``bytes`` and ``crc32c_s``
    (time spent verifying checksums) are added to a ``stats`` dict, so one dict can total reads.
    """

@final
class PartFileWriter:
    """A part file written front to back from bytes that arrive from elsewhere (a level's copy, a
    download, a peer's share): each chunk's crc32c checked before its last byte is written
    (``ChecksumMismatchError``), O_DIRECT where the filesystem takes it, fsynced by ``finish``.
    ``replace``: truncate an existing file (else one there, or a link, is refused)."""

    def __new__(
        cls,
        path: str | os.PathLike[str],
        len_bytes: int,
        chunk_crc32c: Sequence[int],
        chunk_bytes: int,
        *,
        replace: bool = False,
        direct: bool = True,
    ) -> PartFileWriter: ...
    def append(self, data: Buffer) -> None: ...
    def finish(self, *, durable: bool = True) -> None: ...
    def discard(self) -> None: ...
    @property
    def written_bytes(self) -> int: ...
    @property
    def direct(self) -> bool: ...

@final
class PagedBuffer:
    """Page-aligned, writable memory for loads whose pages go back to the OS span by span.

    ``span(offset_bytes, len_bytes)`` is a buffer that keeps only the pages under it mapped;
    pages no span holds any more are unmapped at once.
    """

    def __new__(cls, len_bytes: int) -> PagedBuffer: ...
    def span(self, offset_bytes: int, len_bytes: int) -> PagedBuffer: ...
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

def check_chunk_bytes(chunk_bytes: int) -> None:
    """Raises ``ValueError`` unless ``chunk_bytes`` is a chunk size the engine writes and reads:
    a positive multiple of :data:`DIRECT_ALIGN_BYTES` up to :data:`MAX_CHUNK_BYTES`."""

def chunk_count(len_bytes: int, chunk_bytes: int) -> int:
    """Number of chunks of ``chunk_bytes`` that a range of ``len_bytes`` is cut into."""

def chunk_spans(len_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``(offset_bytes, len_bytes)`` of each chunk of a range of ``len_bytes``, from its start;
    every chunk is ``chunk_bytes`` long but the last.

    >>> chunk_spans(10000, 4096)
    [(0, 4096), (4096, 4096), (8192, 1808)]
    """

def chunk_runs(start_bytes: int, end_bytes: int, chunk_bytes: int, count: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``count`` near-equal runs of whole chunks cutting bytes
    ``[start_bytes, end_bytes)`` (``start_bytes`` chunk-aligned), as the plan shares chunks
    among writers; a run is empty when there are fewer chunks than runs."""

def chunk_hashes(plan: Plan, sources: Sequence[_Buffer], threads: int = 1) -> bytes:
    """XXH3-128 of each chunk of ``plan``'s logical stream (each extent's bytes at its offset,
    zeros between extents), for incremental saves: 16 little-endian bytes per chunk,
    concatenated. ``sources`` are one C-contiguous buffer per extent, as :func:`start_write`
    takes them (``None``, a device-resident source, raises ``ValueError``); they are read on
    ``threads`` threads with the GIL released.

    A 128-bit non-cryptographic hash: it tells unchanged chunks apart with a collision chance
    of about 2**-128 per pair for accidental changes; not a defence against a deliberate
    collision."""

def select_backend(choice: _BackendChoice = "auto") -> tuple[_BackendName, str | None]:
    """``(backend, fallback_reason)`` that ``choice`` resolves to here (honours ``FASTPERSIST_BACKEND``)."""

def probe_uring(simulate_errno: int | None = None) -> str | None:
    """Probes io_uring now (uncached): ``None`` if usable, else why not and how to fix it."""

def direct_io_supported(directory: _StrPath) -> bool:
    """Whether files in ``directory`` can be opened with O_DIRECT."""

def is_memory_fs(directory: _StrPath) -> bool:
    """Whether ``directory`` lies on a memory filesystem (tmpfs, ramfs): saves there are written
    through mappings of the files, reusing a recycled file's pages."""

def writes_in_memory(paths: Sequence[_StrPath], backend: str, direct_io: str) -> bool:
    """Whether a job with ``backend=`` and ``direct_io=`` writes the files at ``paths`` in memory:
    each on a memory filesystem (a regular file or absent), O_DIRECT not required, not the null
    sink. Such files are written through mappings of them, or, a device save's one file, staged
    into its own mapping (:meth:`Arena.over_file`). The engine's one rule for it."""

def check_chunks(
    path: _StrPath, data: _Buffer, offset_bytes: int, chunk_bytes: int, chunk_crc32c: Sequence[int]
) -> None:
    """Checks `data`, the bytes at chunk-aligned `offset_bytes` of the part file `path`, against
    `chunk_crc32c` (every chunk of that file): ``ChecksumMismatchError`` naming the first chunk
    that differs (``ValueError`` for bytes past the recorded chunks or an unaligned offset)."""

def crc32c(data: _Buffer) -> int:
    """crc32c (Castagnoli) of a buffer."""

def fsync_path(path: _StrPath) -> None:
    """fsyncs a file."""

def fsync_dir(path: _StrPath) -> None:
    """fsyncs a directory (makes new entries and renames in it durable)."""

def replace_atomically(src: _StrPath, dst: _StrPath) -> bool:
    """Atomically puts ``src`` at ``dst``, exchanging with an existing ``dst``.

    Returns whether an exchange happened (the old ``dst`` is then at ``src``).
    """

def flatten_walk(walker: object, state: object, path: str, env: dict[str, Any]) -> Any:
    """Walks ``state`` for ``walker`` (a ``fastpersist.format.flatten._Walker``) and returns the
    root node of its tree spec; records, leaves and blobs are appended to the walker's lists.

    The common nodes (exact dicts, OrderedDicts, lists, tuples; str, bool, None, int and float
    leaves; plain contiguous CPU tensors that start their storage) are walked here, every other
    node by ``walker.node(x, path, depth)``: the result is the Python walk's.
    ``env`` is ``fastpersist.format.nativewalk.ENV``.
    """

@final
class MemoryFileAhead:
    """A file on a memory filesystem made ready for the save that will overwrite it with
    `len_bytes` bytes (set to that length now): each ``advance`` allocates its next pages, else
    maps it, else populates the mapping's next page tables, else keeps the mapping for the save,
    at most `max_bytes` at a time with the GIL released; True once ready. Nothing changes a
    byte of the file. `fd` is duplicated (the caller closes its own); `name` is for messages."""

    def __new__(cls, fd: int, len_bytes: int, name: str | os.PathLike[str]) -> MemoryFileAhead: ...
    def advance(self, max_bytes: int) -> bool: ...
    @property
    def allocated_bytes(self) -> int: ...
