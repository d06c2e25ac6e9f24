"""The tuning cache: the best write and read settings measured per device, as JSON.

Where: ``$FASTPERSIST_TUNE_CACHE`` (a file path) if set, else
``$XDG_CACHE_HOME/fastpersist/tune.json``, else ``~/.cache/fastpersist/tune.json``.

The file holds ``{"version": 1, "devices": {"MAJ:MIN": entry}}``; an entry records the device's
identity (:class:`~fastpersist.tuning.identity.DeviceIdentity`), when it was tuned, the best
settings and every figure measured. Reading is forgiving (a save never fails because of the
cache: a missing, unreadable or malformed file means "not tuned"); writing is strict (``tune``
fails with a message naming the file and the fix).

Example:
    >>> entry = TuneEntry(device={"key": "254:0"}, tuned_at="2026-12-02T15:00:00+00:00",
    ...                   write=Best(64 << 20, 4, 3.1), read=Best(64 << 20, 8, 3.4))
    >>> entry.write.chunk_bytes >> 20, entry.read.queue_depth
    (64, 8)
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import fastpersist._core as _core

from ..format.layout import read_small_file, tmp_file_for, write_small_file
from .identity import DeviceIdentity

__all__ = [
    "CACHE_ENV",
    "MAX_AGE_DAYS",
    "Best",
    "Figure",
    "TuneEntry",
    "cache_path",
    "check_writable",
    "lookup",
    "store",
]

log = logging.getLogger("fastpersist")

#: Environment variable naming the cache file (tests point it at a temporary file).
CACHE_ENV = "FASTPERSIST_TUNE_CACHE"
#: Entries older than this are ignored: firmware, filesystems and neighbours change.
MAX_AGE_DAYS = 180
_VERSION = 1


@dataclass(frozen=True)
class Best:
    """The chosen setting for one direction and what it measured."""

    chunk_bytes: int
    queue_depth: int
    gb_per_s: float


@dataclass(frozen=True)
class Figure:
    """One measured setting: ``op`` is ``"write"`` or ``"read"``; `writers` concurrent streams
    (each at `chunk_bytes` x `queue_depth`, `bytes` in all) shared the drive."""

    op: str
    chunk_bytes: int
    queue_depth: int
    gb_per_s: float
    bytes: int
    writers: int = 1


@dataclass(frozen=True)
class TuneEntry:
    """What ``fastpersist tune`` found for one device."""

    device: dict[str, Any]
    tuned_at: str
    write: Best
    read: Best | None = None
    figures: list[Figure] = field(default_factory=list)
    pool_bytes: int = 0
    seconds: float = 0.0
    #: How many concurrent writers (ranks, or stripes on this drive) wrote fastest; None if not measured.
    writers_per_drive: int | None = None

    @property
    def date(self) -> str:
        """The day it was tuned (``YYYY-MM-DD``)."""
        return self.tuned_at[:10]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> TuneEntry:
        """Parses an entry; raises ``ValueError``/``TypeError``/``KeyError`` when malformed."""
        read = doc.get("read")
        entry = cls(
            device=dict(doc["device"]),
            tuned_at=str(doc["tuned_at"]),
            write=_best(doc["write"]),
            read=_best(read) if read is not None else None,
            figures=[Figure(**f) for f in doc.get("figures", [])],
            pool_bytes=int(doc.get("pool_bytes", 0)),
            seconds=float(doc.get("seconds", 0.0)),
            writers_per_drive=int(doc["writers_per_drive"]) if doc.get("writers_per_drive") is not None else None,
        )
        datetime.datetime.fromisoformat(entry.tuned_at)  # a malformed date is a malformed entry
        return entry


def _best(doc: dict[str, Any]) -> Best:
    """A setting as the engine takes it; ``ValueError``/``TypeError`` naming the field otherwise
    (a hand-edited or foreign cache must read as "not tuned", never fail a save later)."""
    if not isinstance(doc, dict):
        raise TypeError(f"a setting is an object with chunk_bytes, queue_depth and gb_per_s, not {doc!r}")
    chunk, depth, speed = doc["chunk_bytes"], doc["queue_depth"], doc["gb_per_s"]
    if type(chunk) is not int or not 0 < chunk <= _core.MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes={chunk!r} is not an integer in 1..{_core.MAX_CHUNK_BYTES}")
    try:
        _core.check_chunk_bytes(chunk)  # the engine's own rule (a multiple of its alignment)
    except ValueError as e:
        raise ValueError(f"chunk_bytes={chunk!r}: {e}") from None
    if type(depth) is not int or not 1 <= depth <= _core.MAX_QUEUE_DEPTH:
        raise ValueError(f"queue_depth={depth!r} is not an integer in 1..{_core.MAX_QUEUE_DEPTH}")
    if type(speed) not in (int, float) or not math.isfinite(speed) or speed < 0:
        raise ValueError(f"gb_per_s={speed!r} is not a finite non-negative number")
    return Best(chunk, depth, float(speed))


def cache_path() -> str:
    """The cache file this process reads and ``tune`` writes."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return override
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fastpersist", "tune.json")


def _read_devices(path: str) -> dict[str, Any]:
    """The ``devices`` table of the cache file; empty when missing, unreadable or malformed."""
    try:
        doc = json.loads(read_small_file(path, limit_bytes=1 << 24, follow_links=True))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        _note_once(path, "", f"the file is unreadable ({e}); it is ignored", logging.WARNING)
        return {}
    if not isinstance(doc, dict) or doc.get("version") != _VERSION or not isinstance(doc.get("devices"), dict):
        _note_once(path, "", f"unknown layout (not a version {_VERSION} cache); it is ignored", logging.WARNING)
        return {}
    devices: dict[str, Any] = doc["devices"]
    return devices


_noted: set[tuple[str, str, str]] = set()


def _note_once(path: str, key: str, why: str, level: int = logging.INFO) -> None:
    """Logs why the file (`key` empty) or its entry for device `key` was ignored, once per
    process (saves run this on every call). A broken file or entry is a WARNING: someone must
    fix or delete it; a stale entry or another device's is expected, and INFO."""
    if (path, key, why) not in _noted:
        _noted.add((path, key, why))
        what = f"entry for {key} ignored: {why}" if key else why
        log.log(level, "tuning cache %s: %s; using the default settings", path, what)


def lookup(identity: DeviceIdentity, *, now: datetime.datetime | None = None) -> TuneEntry | None:
    """The cached entry for this device, or None (not tuned, another device, too old, malformed)."""
    path = cache_path()
    raw = _read_devices(path).get(identity.key)
    if raw is None:
        log.debug("tuning cache %s: no entry for %s", path, identity.describe())
        return None
    try:
        if not isinstance(raw, dict):
            raise TypeError(f"an entry is an object, not {type(raw).__name__}")
        entry = TuneEntry.from_json(raw)
    except KeyError as e:
        _note_once(path, identity.key, f"malformed (no {e})", logging.WARNING)
        return None
    except (TypeError, ValueError) as e:
        _note_once(path, identity.key, f"malformed ({e})", logging.WARNING)
        return None
    if not identity.matches(entry.device):
        _note_once(path, identity.key, f"it was measured on another device ({entry.device}, now {identity.to_json()})")
        return None
    tuned = datetime.datetime.fromisoformat(entry.tuned_at)
    if tuned.tzinfo is None:
        tuned = tuned.replace(tzinfo=datetime.UTC)
    age_days = ((now or datetime.datetime.now(datetime.UTC)) - tuned).total_seconds() / 86400
    if age_days > MAX_AGE_DAYS:
        _note_once(
            path, identity.key, f"tuned {age_days:.0f} days ago (more than {MAX_AGE_DAYS}); run fastpersist tune"
        )
        return None
    return entry


def _cache_folder(path: str) -> str:
    """The cache file's folder, made if missing; OSError names the file and the fix."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise _unwritable(path, e) from e
    return folder


def _unwritable(path: str, e: OSError) -> OSError:
    why = f"cannot write the tuning cache {path}: {e.strerror}; set {CACHE_ENV} to a writable file"
    return OSError(e.errno, why, path)


def check_writable() -> str:
    """Raises ``OSError`` (naming the file and the fix) unless the cache file can be written;
    returns its path. ``tune`` asks before it measures."""
    path = cache_path()
    _cache_folder(path)
    probe = tmp_file_for(path)  # the name every temporary file of fastpersist has
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    except OSError as e:
        raise _unwritable(path, e) from e
    os.unlink(probe)
    if os.path.exists(path) and not os.access(path, os.W_OK):  # replacing it needs only the folder
        log.debug("tuning cache %s is read-only; it is replaced, not modified", path)
    return path


def store(entry: TuneEntry) -> str:
    """Adds or replaces `entry` (keyed by its device) in the cache file, atomically; returns the
    file's path. Raises ``OSError`` naming the file when it cannot be written."""
    path = cache_path()
    devices = _read_devices(path)
    devices[str(entry.device["key"])] = entry.to_json()
    _cache_folder(path)
    try:
        text = json.dumps({"version": _VERSION, "devices": devices}, indent=1, sort_keys=True)
        write_small_file(path, text.encode(), durable=False)
    except OSError as e:
        raise _unwritable(path, e) from e
    return path
