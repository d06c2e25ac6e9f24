"""``torch.save``'s arguments as ``fp.torch_save`` takes them, which route a call takes, and the
route through ``torch.save`` itself.

``fp.torch_save`` passes on exactly the arguments its caller gave (a left-out one stays left
out, so torch's defaults apply): :data:`TORCH_DEFAULT` marks the ones not given. It hands them
to torch's own function (``torch.serialization.save`` as this module found it), never to
whatever ``torch.save`` is bound to at the time: a program that installs the drop-in with
``torch.save = fp.torch_save``, or a wrapper around it, would otherwise call itself forever.

A path with the zip format and the standard ``pickle`` takes the engine's path
(:mod:`.torchfile`); :func:`torch_save_route` says why anything else goes to torch's own save
unchanged, and :func:`save_elsewhere` makes that call (a path fsynced afterwards when the
config is durable).

Example:
    >>> torch_save_route("/tmp/x.pt", TorchSaveArgs.of(TORCH_DEFAULT, TORCH_DEFAULT, False, TORCH_DEFAULT))
    '_use_new_zipfile_serialization=False asks for the legacy format'
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import IO, Any, cast

import torch

import fastpersist._core as _core

from ..config import Config
from ..futures import SaveResult

__all__ = [
    "TORCH_DEFAULT",
    "TORCH_OWN_SAVE",
    "TorchSaveArgs",
    "save_elsewhere",
    "save_with_torch",
    "torch_save_result",
    "torch_save_route",
]

log = logging.getLogger("fastpersist")


class _TorchDefault:
    """The value of a ``torch.save`` argument the caller did not give: torch's own default applies."""

    def __repr__(self) -> str:
        return "<torch.save's default>"


#: The default of every ``torch.save`` argument of :func:`torch_save`: not passed on when left.
TORCH_DEFAULT: Any = _TorchDefault()

#: torch's own ``save``, taken before anyone could bind ``torch.save`` to ``fp.torch_save``.
TORCH_OWN_SAVE = torch.serialization.save


@dataclass(frozen=True)
class TorchSaveArgs:
    """``torch.save``'s arguments past ``obj`` and ``f`` that the caller gave, by torch's
    names: only those are passed on when torch's own save writes."""

    given: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, pickle_module: Any, pickle_protocol: Any, use_new_zipfile: Any, no_byteorder: Any) -> TorchSaveArgs:
        """``torch.save``'s arguments as :func:`torch_save` got them: those that are not
        :data:`TORCH_DEFAULT`, under torch's names."""
        names = ("pickle_module", "pickle_protocol", "_use_new_zipfile_serialization", "_disable_byteorder_record")
        values = (pickle_module, pickle_protocol, use_new_zipfile, no_byteorder)
        return cls({name: value for name, value in zip(names, values, strict=True) if value is not TORCH_DEFAULT})

    @property
    def pickle_module(self) -> Any:
        return self.given.get("pickle_module", pickle)

    @property
    def pickle_protocol(self) -> int:
        return cast(int, self.given.get("pickle_protocol", torch.serialization.DEFAULT_PROTOCOL))

    @property
    def use_new_zipfile_serialization(self) -> bool:
        return cast(bool, self.given.get("_use_new_zipfile_serialization", True))

    @property
    def disable_byteorder_record(self) -> bool:
        return cast(bool, self.given.get("_disable_byteorder_record", False))

    def save(self, obj: object, f: str | os.PathLike[str] | IO[bytes]) -> None:
        """torch's own ``save(obj, f)`` with exactly the arguments given (:data:`TORCH_OWN_SAVE`)."""
        TORCH_OWN_SAVE(obj, f, **self.given)


def torch_save_route(f: object, args: TorchSaveArgs) -> str | None:
    """Why `f` and `args` go to ``torch.save`` itself, or None for the fast path."""
    if not isinstance(f, (str, os.PathLike)):
        return "f is not a path (a file object or something else torch.save judges): torch.save writes it"
    if not args.use_new_zipfile_serialization:
        return "_use_new_zipfile_serialization=False asks for the legacy format"
    if args.pickle_module is not pickle:
        return f"a custom pickle_module ({getattr(args.pickle_module, '__name__', args.pickle_module)!r})"
    path = os.fspath(f)
    if not isinstance(path, str) or not path:
        return "not a usable str path: torch.save reports it"
    real = os.path.realpath(path)  # a symlink is written through, as open() writes it
    if not os.path.isdir(os.path.dirname(real)) or os.path.isdir(real):
        return "the parent directory is missing or the path is a directory: torch.save reports it"
    if os.path.exists(real) and not os.path.isfile(real):
        return "not a regular file (a device, a FIFO): torch.save writes into it, nothing is renamed over it"
    return None


def save_with_torch(obj: object, path: str, args: TorchSaveArgs, durable: bool) -> None:
    """``torch.save`` to `path`, made durable (fsync of the file and its directory) when asked."""
    args.save(obj, path)
    if durable and os.path.isfile(path):  # a device or FIFO has nothing to fsync
        _core.fsync_path(path)
        _core.fsync_dir(os.path.dirname(os.path.abspath(path)))


def _stream_position(f: object) -> int | None:
    """Where an ``io`` stream stands; None for anything else. Of a duck-typed file object only
    ``write`` and ``flush`` are called, as ``torch.save`` calls only those (torch's own
    ``test_serialization_filelike_api_requirements`` checks that set)."""
    if not isinstance(f, io.IOBase):
        return None
    try:
        return int(f.tell())
    except (OSError, ValueError):
        return None


def save_elsewhere(obj: object, f: Any, args: TorchSaveArgs, config: Config | None, started: float) -> SaveResult:
    """What ``torch.save`` itself writes: file objects as they are, paths made durable."""
    if not isinstance(f, (str, os.PathLike)):
        before = _stream_position(f)
        args.save(obj, f)
        after = _stream_position(f)
        nbytes = after - before if before is not None and after is not None else 0
        return torch_save_result(repr(f), nbytes, started, "torch.save")
    path = os.fspath(f)
    save_with_torch(obj, path, args, (config or Config()).durable)  # torch.save raises on a path it refuses
    nbytes = os.path.getsize(path) if os.path.isfile(path) else 0
    return torch_save_result(os.path.abspath(path), nbytes, started, "torch.save")


def torch_save_result(
    path: str, nbytes: int, started: float, backend: str, staged_seconds: float | None = None
) -> SaveResult:
    """The :class:`SaveResult` of a ``torch_save`` of `path` that began at `started`
    (``time.perf_counter()``), logged at INFO; `staged_seconds`: when its sources were free
    (None: at the end)."""
    seconds = time.perf_counter() - started
    log.info(
        "torch_save %s: %d bytes in %.3f s (%.2f GB/s, backend %s)",
        path,
        nbytes,
        seconds,
        nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        backend,
    )
    return SaveResult(
        path=path,
        nbytes=nbytes,
        seconds=seconds,
        staged_seconds=seconds if staged_seconds is None else staged_seconds,
        gb_per_s=nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        backend=backend,
        files=[path],
    )
