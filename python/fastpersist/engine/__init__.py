"""The front door to the Rust engine (``fastpersist._core``): every write the library makes is
a :class:`~fastpersist.engine.write.WriteRequest` started here."""

from .write import WriteRequest, knobs, start_write

__all__ = ["WriteRequest", "knobs", "start_write"]
