"""The remote level: what a drain puts in the store (:mod:`fastpersist.levels.stores`), how it
commits, what it keeps, and how a step comes back from it.

A remote step has the layout of a committed checkpoint (docs/format.md): its data files (a
sharded step: its shard directories) and, written last, its manifest, whose presence is the
commit. Each rank that owns a share uploads that share's files from its node's committed local
copy (every chunk's crc32c checked on the way) and leaves a marker (``.fpdrained-RRRRR.json``);
rank 0 waits for every owner's marker, checks that every object is there at its recorded size
(a stat or a HEAD each), writes the manifest, then the remote index
(``latest.json``), then retires the remote steps beyond ``remote_keep`` (the manifest goes
first). A committed remote step is never written again. A restore downloads a step into the
local root, checked chunk by chunk, and commits it there (the local level is refilled), so it
is then loaded like any local step.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable

from ..errors import CorruptCheckpointError, FastPersistError
from ..format.layout import INDEX_NAME, MANIFEST_NAME, drained_marker_name, parse_step_dir, shard_name, step_dir_name
from ..format.manifest import Manifest, parse, read_manifest
from .holdings import shares_of
from .stores import FileCopy, Store, open_store

__all__ = ["Remote", "files_named", "of_writers", "owned_files", "owned_shares", "step_files"]

log = logging.getLogger("fastpersist")

#: Polling the store for the other ranks' markers and rank 0's commit: the first pause, doubled
#: up to the last (a store is asked about once a second per rank once a drain is slow).
POLL_FIRST_S = 0.02
POLL_MAX_S = 1.0


def step_files(
    m: Manifest, shard_manifests: dict[int, tuple[Manifest, int]], shards: list[int] | None
) -> list[FileCopy]:
    """The files of a step with manifest `m` (sharded: of the `shards` given, from their
    manifests and manifest sizes in `shard_manifests`; None: every writer's / every shard)."""
    if m.shards:
        out = []
        for index in shards if shards is not None else range(len(m.shards)):
            sm, size = shard_manifests[index]
            prefix = shard_name(index) + "/"
            out += [FileCopy(prefix + f.name, f.len_bytes, f.chunk_crc32c, sm.chunk_bytes) for f in sm.files]
            out.append(FileCopy(prefix + MANIFEST_NAME, size, [], sm.chunk_bytes))
        return out
    return [FileCopy(f.name, f.len_bytes, f.chunk_crc32c, m.chunk_bytes) for f in m.files]


def owned_shares(m: Manifest, rank: int) -> list[int]:
    """The share indices `rank` drains: its own (a step with replicas), else all on rank 0."""
    shares = shares_of(m)
    if shares is not None:
        return [s.index for s in shares if s.owner == rank]
    if rank != 0:
        return []
    # Every writer that wrote a file: with fewer chunks than writers, some wrote none.
    return list(range(len(m.shards))) if m.shards else sorted({f.writer for f in m.files})


def owned_files(step_dir: str, m: Manifest, rank: int) -> list[FileCopy]:
    """The files of the local step at `step_dir` that `rank` drains."""
    owned = owned_shares(m, rank)
    if m.shards:
        manifests = {}
        for index in owned:
            shard_dir = os.path.join(step_dir, shard_name(index))
            manifests[index] = (read_manifest(shard_dir), os.path.getsize(os.path.join(shard_dir, MANIFEST_NAME)))
        return step_files(m, manifests, owned)
    return of_writers(step_files(m, {}, None), m, owned)


def of_writers(files: list[FileCopy], m: Manifest, writers: list[int]) -> list[FileCopy]:
    """The `files` of a replicated step (manifest `m`) that the given writers wrote."""
    wanted = set(writers)
    names = {f.name for f in m.files if f.writer in wanted}
    return [f for f in files if f.name in names]


def files_named(store: Store, name: str, m: Manifest, shards: list[int] | None = None) -> list[FileCopy]:
    """The files of the checkpoint `name` in `store` whose manifest is `m` (sharded: of `shards`,
    default all; their own manifests are read from the store)."""
    manifests: dict[int, tuple[Manifest, int]] = {}
    for index in (shards if shards is not None else range(len(m.shards))) if m.shards else []:
        key = f"{name}/{shard_name(index)}/{MANIFEST_NAME}"
        raw = store.get_bytes(key)
        if raw is None:
            raise FileNotFoundError(f"{store.where(key)} is missing")
        manifests[index] = (parse(raw, where=store.where(key)), len(raw))
    return step_files(m, manifests, shards)


class Remote:
    """The remote level on one store: its committed steps, their drain, commit, retention and download."""

    def __init__(self, target: str | os.PathLike[str]) -> None:
        self.store: Store = open_store(target)
        self.root = self.store.url

    def path(self, step: int) -> str:
        return self.store.where(step_dir_name(step))

    def _key(self, step: int, name: str) -> str:
        return f"{step_dir_name(step)}/{name}"

    def manifest(self, step: int) -> tuple[bytes, Manifest] | None:
        """The committed manifest of `step` (raw and parsed), or None if the step is not committed."""
        raw = self.store.get_bytes(self._key(step, MANIFEST_NAME))
        if raw is None:
            return None
        return raw, parse(raw, where=self.store.where(self._key(step, MANIFEST_NAME)))

    def committed_id(self, step: int) -> str | None:
        try:
            found = self.manifest(step)
        except (FastPersistError, OSError):
            return None
        return found[1].checkpoint_id if found is not None else None

    def steps(self) -> list[int]:
        """Committed remote steps, oldest first."""
        names = [s for n in self.store.children() if (s := parse_step_dir(n)) is not None]
        return sorted(s for s in names if self.store.get_bytes(self._key(s, MANIFEST_NAME)) is not None)

    def index_step(self) -> int | None:
        raw = self.store.get_bytes(INDEX_NAME)
        try:
            step = json.loads(raw or b"null").get("step")
        except (ValueError, AttributeError):
            return None
        return step if type(step) is int else None

    def drain_share(self, step: int, local_dir: str, m: Manifest, rank: int, throttle: Callable[[int], None]) -> int:
        """Uploads `rank`'s files of the committed local step; leaves its marker; returns the bytes."""
        committed = self.committed_id(step)
        if committed == m.checkpoint_id:  # a retry after the commit landed: this rank's share is in it
            return 0
        if committed is not None:
            raise FileExistsError(f"{self.path(step)} is committed already; a committed remote step is never rewritten")
        nbytes = 0
        for f in owned_files(local_dir, m, rank):
            self.store.upload(self._key(step, f.name), os.path.join(local_dir, f.name), f, throttle)
            nbytes += f.len_bytes
        marker = json.dumps({"rank": rank, "checkpoint_id": m.checkpoint_id, "bytes": nbytes}).encode()
        # Not forced to disk: the files above are (upload fsyncs them), and the manifest commits.
        self.store.put_bytes(self._key(step, drained_marker_name(rank)), marker, durable=False)
        return nbytes

    def _drained(self, step: int, rank: int, checkpoint_id: str) -> bool:
        raw = self.store.get_bytes(self._key(step, drained_marker_name(rank)))
        try:
            return raw is not None and json.loads(raw).get("checkpoint_id") == checkpoint_id
        except (ValueError, AttributeError):
            return False

    def owners(self, m: Manifest) -> list[int]:
        shares = shares_of(m)
        return sorted({s.owner for s in shares}) if shares is not None else [0]

    def commit(self, step: int, local_dir: str, m: Manifest, timeout_s: float) -> None:
        """Rank 0: waits for every owner's marker, checks that every object is there at its
        recorded size, then writes the manifest (the commit) and the index."""
        owners = self.owners(m)
        deadline = time.monotonic() + timeout_s
        pause = POLL_FIRST_S
        while missing := [r for r in owners if not self._drained(step, r, m.checkpoint_id)]:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.path(step)}: ranks {missing} did not drain their shares within {timeout_s} s"
                )
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)
        if self.committed_id(step) != m.checkpoint_id:  # a retry after the commit leaves it as it is
            self._check_sizes(step, m)
            with open(os.path.join(local_dir, MANIFEST_NAME), "rb") as f:
                self.store.put_bytes(self._key(step, MANIFEST_NAME), f.read())
        doc = {"step": step, "path": step_dir_name(step), "checkpoint_id": m.checkpoint_id}
        self.store.put_bytes(INDEX_NAME, (json.dumps(doc) + "\n").encode())

    def _check_sizes(self, step: int, m: Manifest) -> None:
        """Raises unless every object of the step is in the store at its recorded size (a marker
        vouches for its rank's uploads, but a store can lose or cut an object after it)."""
        wrong = []
        for f in self.files(step, m):
            key = self._key(step, f.name)
            found = self.store.size(key)
            if found != f.len_bytes:
                what = "missing" if found is None else f"{found} bytes"
                wrong.append(f"{self.store.where(key)} ({what}, expected {f.len_bytes})")
        if wrong:
            raise CorruptCheckpointError(
                f"{self.path(step)} was not committed: {len(wrong)} objects are not as drained: {'; '.join(wrong[:4])}"
            )

    def wait_committed(self, step: int, checkpoint_id: str, timeout_s: float) -> None:
        """Any rank: waits until rank 0 has committed `step` with `checkpoint_id`."""
        deadline = time.monotonic() + timeout_s
        pause = POLL_FIRST_S
        while self.committed_id(step) != checkpoint_id:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path(step)} was not committed within {timeout_s} s")
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)

    def retire(self, newest: int, keep: int) -> list[int]:
        """Rank 0: removes committed steps older than `newest` beyond `keep`, and older uncommitted leftovers."""
        names = {s: n for n in self.store.children() if (s := parse_step_dir(n)) is not None}
        committed = self.steps()
        older = [s for s in committed if s < newest]
        gone = older[: max(0, len(older) - (keep - 1))]
        leftovers = [s for s in names if s < newest and s not in committed]
        for step in gone + leftovers:
            try:
                self.store.remove_step(names[step], MANIFEST_NAME)
            except OSError as e:
                log.warning("could not remove the remote step %s: %s", self.path(step), e)
        return gone

    def files(self, step: int, m: Manifest, shards: list[int] | None = None) -> list[FileCopy]:
        """The files of the remote step (sharded: of `shards`, default all), their manifests read."""
        return files_named(self.store, step_dir_name(step), m, shards)

    def download(self, step: int, dest_dir: str, files: list[FileCopy]) -> int:
        """Downloads `files` of the remote step into `dest_dir`, every chunk checked; returns the bytes."""
        nbytes = 0
        for f in files:
            self.store.download(self._key(step, f.name), os.path.join(dest_dir, f.name), f)
            nbytes += f.len_bytes
        return nbytes

    def verify(self, step: int) -> int:
        """Reads every chunk of the remote step and checks it (nothing kept); returns the bytes."""
        found = self.manifest(step)
        if found is None:
            raise FileNotFoundError(f"{self.path(step)} is not committed")
        nbytes = 0
        for f in self.files(step, found[1]):
            for lo, hi, _ in self.store.read_pieces(self._key(step, f.name), f):
                nbytes += hi - lo
        return nbytes
