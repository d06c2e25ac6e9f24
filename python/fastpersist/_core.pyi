"""Type stub of ``fastpersist._core``: the PyO3 bindings to the Rust engine.

Hand-written; checked against the compiled module by
``python -m mypy.stubtest fastpersist._core --allowlist .mypy-stubtest-allowlist``.

Every function that touches a file or a large buffer releases the GIL while it works.
Operating-system failures raise real ``OSError`` subclasses with ``errno`` and ``filename`` set;
engine failures raise the classes of :mod:`fastpersist.errors`, and an exception that a callback
(``on_staged``, ``device_copy``) raised inside a job is raised again as itself.
"""

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypedDict, final, type_check_only

import numpy as np
from typing_extensions import Buffer

__all__ = [
    "DIRECT_ALIGN_BYTES",
    "EXTENT_ALIGN_BYTES",
    "MAX_CHUNK_BYTES",
    "MAX_QUEUE_DEPTH",
    "Plan",
    "Pool",
    "WriteHandle",
    "__version__",
    "check_chunk_bytes",
    "chunk_count",
    "chunk_runs",
    "chunk_spans",
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
    "read_ranges_into",
    "PagedBuffer",
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
    def call_before_free(self, callback: Callable[[], object]) -> None:
        """Calls ``callback()`` when the pool goes, before its memory is freed (an exception is
        reported as unraisable). It must not refer to the pool."""

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

def start_write(
    plan: Plan,
    writer: int,
    paths: Sequence[_StrPath],
    sources: Sequence[_Buffer | None],
    pool: Pool,
    *,
    backend: _WriteBackendChoice = "auto",
    direct_io: _DirectIO = "auto",
    queue_depth: int = 8,
    checksum: bool = True,
    durable: bool = True,
    background: bool = False,
    watched: Sequence[bool] | None = None,
    on_staged: Callable[[list[int]], bool] | None = None,
    copy_max_extent_bytes: int = 0,
    copy_budget_bytes: int = 0,
    device_copy: Callable[[int, int, memoryview, int, int], None] | None = None,
    device_wait: Callable[[], None] | None = None,
    also_writers: Sequence[int] | None = None,
    crc32_fields: Sequence[tuple[int, int, Sequence[int]]] | None = None,
) -> WriteHandle:
    """Writes ``writer``'s parts of ``plan``, then each of ``also_writers``' parts, to ``paths``
    (one per part, in that order) from ``sources``.

    ``sources`` holds one C-contiguous buffer per extent of ``plan``; they are held (and must
    not be modified) until the handle reports them staged.

    With ``background=False`` the write runs on the calling thread (GIL released) and the handle
    returned is already finished.

    The mutation guard: ``watched[i]`` says extent ``i``'s source may be modified while the job
    runs. Watched extents of at most ``copy_max_extent_bytes`` are copied (smallest first, up to
    ``copy_budget_bytes``) before this returns; ``on_staged(extents)`` is called from the job's
    thread once each other watched extent is staged whole, and a false result fails the job.

    A source given as ``None`` lives in device memory: ``device_copy(extent, offset_bytes, slot,
    start, end)`` copies, or queues the copy of, that extent's bytes from ``offset_bytes`` into
    ``slot[start:end]`` (a memoryview over a whole staging slot, valid only during the call).
    ``device_wait()`` returns once every copy asked for has completed; the job calls it before
    it reads a slot it asked copies into (the next chunk's copies are asked for before the
    current one is checksummed). Without ``device_wait`` a copy must be done when
    ``device_copy`` returns.

    ``crc32_fields``: ``(start_bytes, len_bytes, [write_at_bytes, ...])`` per range of the
    stream whose CRC-32 (IEEE, ``zlib.crc32``) is written little-endian at each offset while
    the range streams through staging (the record CRCs of a zip archive). Ranges sorted and
    disjoint, each offset after its range's end; the plan must have a single part.

    ``backend="null"`` (benchmarks only) completes every write at once and moves no byte: the
    files stay empty.
    """

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

def select_backend(choice: _BackendChoice = "auto") -> tuple[_BackendName, str | None]:
    """``(backend, fallback_reason)`` that ``choice`` resolves to here (honours ``FASTPERSIST_BACKEND``)."""

def probe_uring(simulate_errno: int | None = None) -> str | None:
    """Probes io_uring now (uncached): ``None`` if usable, else why not and how to fix it."""

def direct_io_supported(directory: _StrPath) -> bool:
    """Whether files in ``directory`` can be opened with O_DIRECT."""

def is_memory_fs(directory: _StrPath) -> bool:
    """Whether ``directory`` lies on a memory filesystem (tmpfs, ramfs): saves there are written
    through mappings of the files, reusing a recycled file's pages."""

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
