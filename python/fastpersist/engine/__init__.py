"""The front door to the Rust engine (``fastpersist._core``): every write the library makes is
a :class:`~fastpersist.engine.writes.WriteRequest` started here or, for bytes that come from
elsewhere (a level's copy, a download, a peer's share), a :class:`~fastpersist.engine.copies.PartFile`;
every read of part files is a :func:`~fastpersist.engine.reads.read_ranges` call. The memory the
engine's buffers keep between saves and loads is registered in :mod:`~fastpersist.engine.kept_memory`."""

from .copies import PartFile, check_part_file
from .reads import ReadRange, read_file_range, read_ranges
from .writes import Crc32Field, Guard, JobHooks, WriteOptions, WriteRequest, start_write

__all__ = [
    "Crc32Field",
    "Guard",
    "JobHooks",
    "PartFile",
    "ReadRange",
    "WriteOptions",
    "WriteRequest",
    "check_part_file",
    "read_file_range",
    "read_ranges",
    "start_write",
]
