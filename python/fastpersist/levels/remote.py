"""The remote level on a directory (a shared filesystem mount): what a drain writes there, how
it commits, what it keeps.

A remote step directory has the layout of a committed checkpoint (docs/format.md), so
``fp.load(remote_dir/step-N)`` reads it like any other: its data files (a sharded step: its
shard directories) and, written last, its manifest, whose presence is the commit. Each rank
that owns a share copies that share's files from its node's committed local copy
(:func:`copy_share`: every chunk's crc32c checked against the manifest on the way, so a damaged
local copy is never propagated, fsynced) and leaves a marker (``.fpdrained-RRRRR.json``); rank
0 waits for every owner's marker, writes the manifest, then the remote index
(``latest.json``), then retires the remote steps beyond ``remote_keep``: the manifest goes
first (the step is no longer committed), then the rest. A committed remote step is never
written again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

from .. import _core
from ..errors import CorruptCheckpointError, FastPersistError
from ..format.layout import (
    INDEX_NAME,
    MANIFEST_NAME,
    drained_marker_name,
    parse_step_dir,
    shard_name,
    step_dir_name,
    write_small_file,
)
from ..format.manifest import Manifest, read_manifest
from ..format.ownership import REMOVING, remove_owned_dir
from .holdings import shares_of

__all__ = ["COPY_PIECE_BYTES", "RemoteDir", "ShareCopy", "copy_file", "open_remote", "owned_files"]

log = logging.getLogger("fastpersist")

#: Bytes copied at a time (the throttle sleeps between pieces).
COPY_PIECE_BYTES = 8 << 20


@dataclass(frozen=True)
class ShareCopy:
    """One file to copy: its name relative to the step directory and its chunk checksums."""

    name: str
    len_bytes: int
    chunk_crc32c: list[int]
    chunk_bytes: int


def owned_files(step_dir: str, m: Manifest, rank: int, group_size: int) -> list[ShareCopy]:
    """The files of `step_dir` that `rank` drains: its own shares' files (a step saved with
    replicas), else everything on rank 0 (one process, or a plain group save)."""
    shares = shares_of(m)
    if m.shards:
        indices = (
            [s.index for s in shares if s.owner == rank]
            if shares is not None
            else (list(range(len(m.shards))) if rank == 0 else [])
        )
        out = []
        for index in indices:
            shard_dir = os.path.join(step_dir, shard_name(index))
            sm = read_manifest(shard_dir)
            prefix = shard_name(index) + "/"
            out += [ShareCopy(prefix + f.name, f.len_bytes, f.chunk_crc32c, sm.chunk_bytes) for f in sm.files]
            size = os.path.getsize(os.path.join(shard_dir, MANIFEST_NAME))
            out.append(ShareCopy(prefix + MANIFEST_NAME, size, [], sm.chunk_bytes))
        return out
    if shares is not None:
        writers = {s.index for s in shares if s.owner == rank}
    else:
        writers = {f.writer for f in m.files} if rank == 0 else set()
    return [ShareCopy(f.name, f.len_bytes, f.chunk_crc32c, m.chunk_bytes) for f in m.files if f.writer in writers]


def copy_file(src: str, dst: str, f: ShareCopy, throttle: Callable[[int], None]) -> None:
    """Copies `src` to `dst` (created or truncated), checking each chunk's crc32c against the
    manifest's as it goes and fsyncing; `throttle(n)` is called after each piece of n bytes."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with open(src, "rb", buffering=0) as fin, open(dst, "wb", buffering=0) as fout:
        offset = 0
        piece = max(f.chunk_bytes, COPY_PIECE_BYTES // f.chunk_bytes * f.chunk_bytes)
        while offset < f.len_bytes:
            data = fin.read(min(piece, f.len_bytes - offset))
            if not data:
                raise CorruptCheckpointError(f"{src}: ends at {offset} bytes, the manifest says {f.len_bytes}")
            if f.chunk_crc32c:
                first = offset // f.chunk_bytes
                for i, (start, n) in enumerate(_core.chunk_spans(len(data), f.chunk_bytes)):
                    expected, found = f.chunk_crc32c[first + i], _core.crc32c(data[start : start + n])
                    if found != expected:
                        raise CorruptCheckpointError(
                            f"{src}: bytes [{offset + start}, {offset + start + n}) have crc32c {found:#010x}, "
                            f"the manifest says {expected:#010x}; the local copy is damaged and is not drained"
                        )
            view = memoryview(data)
            while view:
                view = view[fout.write(view) :]
            offset += len(data)
            throttle(len(data))
        os.fsync(fout.fileno())


def open_remote(target: str | os.PathLike[str]) -> RemoteDir:
    """The remote level `target` names: a directory (``s3://`` URLs are not supported yet)."""
    text = os.fspath(target)
    if "://" in text:
        raise ValueError(f"remote={text!r}: only a directory (a shared filesystem mount) is supported yet")
    return RemoteDir(text)


class RemoteDir:
    """A remote level on a directory: its committed steps, their drain, commit and retention."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)

    def path(self, step: int) -> str:
        return os.path.join(self.root, step_dir_name(step))

    def steps(self) -> list[int]:
        """Committed remote steps (a manifest), oldest first."""
        found = []
        for name in os.listdir(self.root):
            step = parse_step_dir(name)
            if step is not None and os.path.exists(os.path.join(self.root, name, MANIFEST_NAME)):
                found.append(step)
        return sorted(found)

    def index_step(self) -> int | None:
        try:
            with open(os.path.join(self.root, INDEX_NAME), "rb") as f:
                step = json.loads(f.read(1 << 16)).get("step")
        except (OSError, ValueError, AttributeError):
            return None
        return step if type(step) is int else None

    def committed_id(self, step: int) -> str | None:
        try:
            return read_manifest(self.path(step)).checkpoint_id
        except (FastPersistError, OSError):
            return None

    def drain_share(
        self, step: int, local_dir: str, m: Manifest, rank: int, size: int, throttle: Callable[[int], None]
    ) -> int:
        """Copies `rank`'s files of the committed local step; leaves its marker; returns the bytes."""
        remote_dir = self.path(step)
        if self.committed_id(step) is not None:
            raise FileExistsError(f"{remote_dir} is committed already; a committed remote step is never rewritten")
        os.makedirs(remote_dir, exist_ok=True)
        nbytes = 0
        for f in owned_files(local_dir, m, rank, size):
            copy_file(os.path.join(local_dir, f.name), os.path.join(remote_dir, f.name), f, throttle)
            nbytes += f.len_bytes
        _core.fsync_dir(remote_dir)
        marker = json.dumps({"rank": rank, "checkpoint_id": m.checkpoint_id, "bytes": nbytes}).encode()
        write_small_file(os.path.join(remote_dir, drained_marker_name(rank)), marker, durable=True)
        return nbytes

    def _drained(self, step: int, rank: int, checkpoint_id: str) -> bool:
        try:
            with open(os.path.join(self.path(step), drained_marker_name(rank)), "rb") as f:
                return bool(json.loads(f.read(1 << 16)).get("checkpoint_id") == checkpoint_id)
        except (OSError, ValueError, AttributeError):
            return False

    def commit(self, step: int, local_dir: str, m: Manifest, owners: list[int], timeout_s: float) -> None:
        """Rank 0: waits for every owner's marker, then writes the manifest (the commit) and the index."""
        deadline = time.monotonic() + timeout_s
        while not all(self._drained(step, r, m.checkpoint_id) for r in owners):
            if time.monotonic() > deadline:
                missing = [r for r in owners if not self._drained(step, r, m.checkpoint_id)]
                raise TimeoutError(
                    f"{self.path(step)}: ranks {missing} did not drain their shares within {timeout_s} s"
                )
            time.sleep(0.05)
        with open(os.path.join(local_dir, MANIFEST_NAME), "rb") as f:
            raw = f.read()
        remote_dir = self.path(step)
        write_small_file(os.path.join(remote_dir, MANIFEST_NAME), raw, durable=True)
        for r in owners:
            os.remove(os.path.join(remote_dir, drained_marker_name(r)))
        doc = {"step": step, "path": step_dir_name(step), "checkpoint_id": m.checkpoint_id}
        write_small_file(os.path.join(self.root, INDEX_NAME), (json.dumps(doc) + "\n").encode(), durable=True)

    def wait_committed(self, step: int, checkpoint_id: str, timeout_s: float) -> None:
        """Any rank: waits until rank 0 has committed `step` with `checkpoint_id`."""
        deadline = time.monotonic() + timeout_s
        while self.committed_id(step) != checkpoint_id:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path(step)} was not committed within {timeout_s} s")
            time.sleep(0.05)

    def retire(self, newest: int, keep: int) -> list[int]:
        """Rank 0: removes committed steps older than `newest` beyond `keep`, and uncommitted
        leftovers older than it: the manifest first, so a half-removed step is never committed."""
        steps = self.steps()
        older = [s for s in steps if s < newest]
        gone = older[: max(0, len(older) - (keep - 1))]
        leftovers = [
            s
            for name in os.listdir(self.root)
            if (s := parse_step_dir(name)) is not None and s < newest and s not in steps
        ]
        for step in gone + leftovers:
            try:
                remove_owned_dir(self.path(step))  # renamed first: a half-removed step is no step
            except OSError as e:
                log.warning("could not remove the remote step %s: %s", self.path(step), e)
        for name in os.listdir(self.root):
            if REMOVING.match(name):  # a removal a crash cut short
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        return gone
