"""The front door to the Rust engine (``fastpersist._core``): every write the library makes is
a :class:`~fastpersist.engine.writes.WriteRequest` started here, and every read of part files is
a :func:`~fastpersist.engine.reads.read_ranges` call."""

from .reads import ReadRange, first_bad_chunk, read_file_range, read_ranges
from .writes import WriteRequest, knobs, start_write

__all__ = ["ReadRange", "WriteRequest", "first_bad_chunk", "knobs", "read_file_range", "read_ranges", "start_write"]
