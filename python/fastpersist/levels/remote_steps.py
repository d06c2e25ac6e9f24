"""The remote level: what a drain puts in the store (:mod:`fastpersist.levels.remote_stores`), how it
commits, what it keeps, and how a step comes back from it.

A remote step has the layout of a committed checkpoint (docs/format.md): its data files (a
sharded step: its shard directories) and, written last, its manifest, whose presence is the
commit. Each rank that owns a share uploads that share's files from its node's committed local
copy (every chunk's crc32c checked on the way) and leaves a marker (``.fpdrained-RRRRR.json``);
rank 0, once every owner's upload succeeded, checks that every object is there at its recorded
size (a stat or a HEAD each), writes the manifest, then the remote index (``latest.json``: the
step, its run and the run's lineage, :mod:`fastpersist.levels.run_identity`), then retires the
remote steps older than the step that the lineage does not keep (the manifest goes first). A
committed remote step is never written again; a step number held by another checkpoint (a step
a rollback abandoned, another run's) is removed before a drain takes the number. A restore
downloads a step into the local root, checked chunk by chunk, and commits it there (the local
level is refilled), so it is then loaded like any local step.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable

from ..errors import CorruptCheckpointError, FastPersistError
from ..format.layout import (
    INDEX_NAME,
    MANIFEST_NAME,
    drained_marker_name,
    linked_data_file_name,
    parse_step_dir,
    shard_name,
    step_dir_name,
)
from ..format.manifest import Manifest, parse, read_manifest, read_manifest_bytes
from .partner_holdings import shares_of
from .remote_stores import FileCopy, Store, open_store
from .run_identity import RemoteIndex, lineage_for, remote_retention

__all__ = ["RemoteSteps", "files_named", "of_writers", "owned_files", "owned_shares", "step_files"]

log = logging.getLogger("fastpersist")

#: Polling the store for the owners' markers (each owner's upload already reported done): the
#: first pause, doubled up to the last.
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


class RemoteSteps:
    """The remote level on one store: its committed steps, their drain, commit, retention and download.

    `store` is patient (an object store client retries for minutes: drains, downloads);
    `probe` answers the few small reads a restore makes first (the index, the listing, the
    manifests) within a bounded time, so an unreachable store costs a restore seconds, not
    minutes (:data:`fastpersist.levels.remote_stores.PROBE_TIMEOUT_S`)."""

    def __init__(self, target: str | os.PathLike[str]) -> None:
        self.store: Store = open_store(target)
        self.probe: Store = open_store(target, bounded=True)
        self.root = self.store.url

    def path(self, step: int) -> str:
        return self.store.where(step_dir_name(step))

    def _key(self, step: int, name: str) -> str:
        return f"{step_dir_name(step)}/{name}"

    def manifest(self, step: int, store: Store | None = None) -> tuple[bytes, Manifest] | None:
        """The committed manifest of `step` (raw and parsed), or None if the step is not committed."""
        store = store or self.store
        raw = store.get_bytes(self._key(step, MANIFEST_NAME))
        if raw is None:
            return None
        return raw, parse(raw, where=store.where(self._key(step, MANIFEST_NAME)))

    def committed_id(self, step: int, store: Store | None = None) -> str | None:
        """The checkpoint id of the committed remote `step`, or None (not committed, or unreadable)."""
        try:
            found = self.manifest(step, store)
        except (FastPersistError, OSError):
            return None
        return found[1].checkpoint_id if found is not None else None

    def steps(self, store: Store | None = None) -> list[int]:
        """Committed remote steps, oldest first."""
        store = store or self.store
        names = [s for n in store.children() if (s := parse_step_dir(n)) is not None]
        return sorted(s for s in names if store.get_bytes(self._key(s, MANIFEST_NAME)) is not None)

    def committed_ids(self, store: Store | None = None) -> dict[int, str]:
        """Every committed remote step and its checkpoint id (unreadable manifests left out)."""
        found = {}
        for step in self.steps(store):
            cid = self.committed_id(step, store)
            if cid is not None:
                found[step] = cid
        return found

    def index(self, store: Store | None = None) -> RemoteIndex | None:
        """The remote index (step, run, lineage), or None if there is none."""
        return RemoteIndex.parse((store or self.store).get_bytes(INDEX_NAME))

    def clear_for(self, step: int, checkpoint_id: str) -> str | None:
        """Rank 0, before the drain of `step` (`checkpoint_id`): removes a committed remote step of
        that number that is another checkpoint (a step a rollback abandoned, or another run's), so
        that the drain takes its place; returns the removed step's checkpoint id, or None."""
        committed = self.committed_id(step)
        if committed is None or committed == checkpoint_id:
            return None
        self.store.remove_step(step_dir_name(step), MANIFEST_NAME)
        return committed

    def drain_share(self, step: int, local_dir: str, m: Manifest, rank: int, throttle: Callable[[int], None]) -> int:
        """Uploads `rank`'s files of the committed local step; leaves its marker; returns the bytes."""
        committed = self.committed_id(step)
        if committed == m.checkpoint_id:  # a retry after the commit landed: this rank's share is in it
            return 0
        if committed is not None:
            raise FileExistsError(f"{self.path(step)} is committed already; a committed remote step is never rewritten")
        nbytes = 0
        held = self._held_files(m)
        for f in owned_files(local_dir, m, rank):
            there = held.get((linked_data_file_name(f.name, m.checkpoint_id), f.len_bytes, tuple(f.chunk_crc32c)))
            if there is not None:  # an incremental step's linked file: the store has its bytes
                self.store.copy(there, self._key(step, f.name), f, throttle)
                continue
            self.store.upload(self._key(step, f.name), os.path.join(local_dir, f.name), f, throttle)
            nbytes += f.len_bytes
        marker = json.dumps({"rank": rank, "checkpoint_id": m.checkpoint_id, "bytes": nbytes}).encode()
        # Not forced to disk: the files above are (upload fsyncs them), and the manifest commits.
        self.store.put_bytes(self._key(step, drained_marker_name(rank)), marker, durable=False)
        return nbytes

    def _held_files(self, m: Manifest) -> dict[tuple[str, int, tuple[int, ...]], str]:
        """The data files that committed remote steps hold, by the save that wrote them and its name
        for them (:func:`linked_data_file_name`), length and chunk checksums: where a file that step
        `m` links from an earlier step already is. Only for a step that links (format 2.0)."""
        if not m.refers:
            return {}
        held = {}
        for step in self.steps():
            found = self.manifest(step)
            if found is None or found[1].shards:
                continue
            for f in found[1].files:
                written_as = linked_data_file_name(f.name, found[1].checkpoint_id)  # the save that wrote it, its name
                held[(written_as, f.len_bytes, tuple(f.chunk_crc32c))] = self._key(step, f.name)
        return held

    def _drained(self, step: int, rank: int, checkpoint_id: str) -> bool:
        raw = self.store.get_bytes(self._key(step, drained_marker_name(rank)))
        try:
            return raw is not None and json.loads(raw).get("checkpoint_id") == checkpoint_id
        except (ValueError, AttributeError):
            return False

    def owners(self, m: Manifest) -> list[int]:
        shares = shares_of(m)
        return sorted({s.owner for s in shares}) if shares is not None else [0]

    def commit(
        self, step: int, local_dir: str, m: Manifest, timeout_s: float, *, run: str | None, keep: int
    ) -> dict[int, str]:
        """Rank 0: waits for every owner's marker, checks that every object is there at its
        recorded size, then writes the manifest (the commit) and the index, naming `run` and the
        lineage's newest `keep` steps; returns that lineage (step -> checkpoint id)."""
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
            self.store.put_bytes(self._key(step, MANIFEST_NAME), read_manifest_bytes(local_dir))
        committed = self.committed_ids()
        lineage = lineage_for(self.index(), run, step, m.checkpoint_id, committed)
        kept, _ = remote_retention(lineage, list(committed), step, keep)
        doc = RemoteIndex(step, m.checkpoint_id, run, kept).to_json()
        self.store.put_bytes(INDEX_NAME, (json.dumps(doc) + "\n").encode())
        return kept

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

    def retire(self, newest: int, kept: dict[int, str]) -> list[int]:
        """Rank 0, once `newest` is committed and the index names its `kept` lineage: removes the
        committed steps older than `newest` that the lineage does not keep, and older uncommitted
        leftovers; returns the committed steps removed. Steps above `newest` stay."""
        names = {s: n for n in self.store.children() if (s := parse_step_dir(n)) is not None}
        committed = self.steps()
        _, gone = remote_retention(kept, committed, newest, len(kept))
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
