"""A write of the engine: one typed request, started in one place.

Every save path (a checkpoint's job, ``fp.torch_save``, the DCP writer, the tuner) builds a
:class:`WriteRequest` and calls :func:`start_write`. The request is nested as the core's job is:
:class:`WriteOptions` (how it writes) and :class:`JobHooks` (the mutation :class:`Guard`, the
device, the CRC-32 fields, the write gate). The fields are documented once, in
``fastpersist/_core.pyi``, and ``rust/fastpersist-py/src/write.rs`` reads them by name.

Example:
    >>> import os, tempfile
    >>> from fastpersist import _core
    >>> path = os.path.join(tempfile.mkdtemp(), "part")
    >>> plan = _core.Plan([5], 1, 1, 1 << 20)
    >>> pool = _core.Pool(1 << 20, 2 << 20)
    >>> start_write(WriteRequest(plan=plan, paths=[path], sources=[b"hello"], pool=pool)).wait()["bytes_written"]
    5
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

import fastpersist._core as _core

from ..config import Config

__all__ = ["Crc32Field", "DeviceHook", "Guard", "JobHooks", "WriteOptions", "WriteRequest", "start_write"]

log = logging.getLogger("fastpersist")

#: Whether a write has said why its backend fell back (once per process).
_warned_fallback = False


class DeviceHook(Protocol):
    """What a write with device-resident sources is given (fastpersist.gpu.device_side.DeviceStaging)."""

    @property
    def lease(self) -> _core.ArenaLease: ...

    def copy(self, pieces: list[tuple[int, int, int, int]]) -> None: ...

    def wait(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class WriteOptions:
    """How a job writes (the core's ``job::WriteOptions``): see ``WriteOptions`` in ``_core.pyi``."""

    backend: Literal["auto", "io_uring", "threads", "null"] = "auto"
    direct_io: Literal["auto", "require", "off"] = "auto"
    queue_depth: int = 8
    checksum: bool = True
    durable: bool = True
    staging_threads: int = 1

    @classmethod
    def of(
        cls,
        config: Config,
        *,
        backend: Literal["auto", "io_uring", "threads", "null"] | None = None,
        checksum: bool | None = None,
    ) -> WriteOptions:
        """The options a (resolved) config sets. `backend` overrides the config's (the null sink
        of ``fastpersist bench``); `checksum` too (a torch archive's integrity is its CRC-32s)."""
        return cls(
            backend=backend or config.backend,
            direct_io=config.direct_io,
            queue_depth=config.resolved_queue_depth,
            checksum=config.checksum == "crc32c" if checksum is None else checksum,
            durable=config.durable,
            staging_threads=config.resolved_staging_threads,
        )


@dataclass(frozen=True, kw_only=True)
class Guard:
    """The mutation guard (the core's ``job::Guard``): see ``Guard`` in ``_core.pyi``."""

    watched: Sequence[bool]
    on_staged: Callable[[list[int]], bool]
    copy_early: Sequence[int] = ()


class Crc32Field(NamedTuple):
    """A range of the stream whose CRC-32 the job writes into the stream (a zip record's, at each
    of `write_at_bytes`): see ``crc32_fields`` in ``_core.pyi``. A tuple, as the binding reads it."""

    start_bytes: int
    len_bytes: int
    write_at_bytes: Sequence[int]


@dataclass(frozen=True, kw_only=True)
class JobHooks:
    """What a job calls out to or is held by (the core's ``job::JobHooks``): see ``JobHooks`` in
    ``_core.pyi``."""

    guard: Guard | None = None
    device: DeviceHook | None = None
    crc32_fields: Sequence[Crc32Field] = ()
    write_gate: _core.WriteGate | None = None


@dataclass(frozen=True, kw_only=True)
class WriteRequest:
    """The engine's write: see ``WriteRequest`` in ``fastpersist/_core.pyi`` for every field."""

    plan: _core.Plan
    paths: Sequence[str | os.PathLike[str]]
    sources: Sequence[object | None]
    pool: _core.Pool
    writer: int = 0
    also_writers: Sequence[int] = ()
    background: bool = False
    options: WriteOptions = WriteOptions()
    hooks: JobHooks = JobHooks()


def start_write(request: WriteRequest) -> _core.WriteHandle:
    """Starts `request` in the engine; returns its handle (finished already unless
    ``request.background``). The first write whose ``"auto"`` backend fell back from io_uring
    (blocked here) says why, once per process: a WARNING on the ``fastpersist`` logger and a
    ``RuntimeWarning``."""
    global _warned_fallback
    handle = _core.start_write(request)
    reason = handle.fallback_reason
    if reason and not _warned_fallback:
        _warned_fallback = True
        log.warning("%s", reason)
        warnings.warn(reason, RuntimeWarning, stacklevel=3)
    return handle
