"""Restoring a step saved with partner copies, from the fastest copy that verifies.

Every rank of the group takes part (each rank calls ``ck.latest()`` / ``ck.load()``):

1. each rank lists the committed steps of its node's root (up to the step its index names) and
   which shares each holds (:func:`fastpersist.levels.partner_holdings.held_shares`: present, of their
   recorded sizes); the ranks exchange these reports;
2. the candidates are the steps whose nodes, between them, hold every share under one
   checkpoint id (a node that came back empty holds nothing, and is no obstacle), newest
   first, up to the highest step any node's index names;
3. each share is given to one *reader*: its owner when the owner's node holds it (a local
   read), else the holder rank with the least work so far. The readers read with every chunk's
   crc32c checked; a copy that fails is marked bad on its node and its share goes to the next
   holder, round by round. A step with a share no holder can provide is skipped for the next
   older candidate (the Megatron #5281 lesson: a copy is used only once it verifies);
4. replicated state: each share's bytes are broadcast from its reader to every rank (the reads
   of the next piece overlapping the broadcasts); sharded state: each shard's manifest and
   bytes go from its reader to its owner.

Every rank therefore ends with the same step, bit-identical to what was saved. All collectives
run on the control group under ``Config.timeout_s``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

import fastpersist._core as _core

from ..distributed.control import ControlGroup, collective, describe
from ..errors import FastPersistError, GroupLoadError
from ..format.layout import MANIFEST_NAME, parse_step_dir, shard_name
from ..format.manifest import Manifest, parse, read_manifest, read_manifest_bytes
from ..loading.examine import verify_checkpoint, verify_file
from ..loading.pipeline import LoadOptions, state_from_stream
from ..loading.reading import direct_padded, read_stream, read_window
from ..loading.shared_read import read_and_broadcast, read_pieces
from .partner_holdings import held_shares, shares_of

__all__ = ["Candidate", "NodeReport", "StepReport", "candidates", "node_report", "restore_step", "verified_step"]

log = logging.getLogger("fastpersist")


@dataclass(frozen=True)
class StepReport:
    """One committed step of a node's root: its id, its share count and the shares present."""

    step: int
    checkpoint_id: str
    share_count: int
    held: tuple[int, ...]
    owners: tuple[int, ...] = ()


@dataclass(frozen=True)
class NodeReport:
    """What one rank sees in its node's root."""

    rank: int
    index_step: int | None
    steps: list[StepReport] = field(default_factory=list)


@dataclass
class Candidate:
    """A step whose nodes hold every share: the ranks that hold each share, owner's first."""

    step: int
    checkpoint_id: str
    owners: dict[int, int]
    holders: dict[int, list[int]]
    bad: set[tuple[int, int]] = field(default_factory=set)  # (share, rank) copies that failed


class NoCopyLeft(FastPersistError):
    """A share of the step has no holder left whose copy verifies."""


def node_report(rank: int, root: str, index_step: int | None) -> NodeReport:
    """This rank's view of its node's root."""
    steps = []
    for name in sorted(os.listdir(root)):
        step = parse_step_dir(name)
        if step is None or (index_step is not None and step > index_step):
            continue
        path = os.path.join(root, name)
        try:
            m = read_manifest(path)
        except (FastPersistError, OSError):
            continue
        shares = shares_of(m)
        if shares is None:
            continue
        owners = tuple(s.owner for s in shares)
        steps.append(StepReport(step, m.checkpoint_id, len(shares), tuple(held_shares(path, m)), owners))
    return NodeReport(rank, index_step, steps)


def candidates(reports: list[NodeReport]) -> list[Candidate]:
    """The steps every share of which some rank holds, newest first (see the module docstring)."""
    indexed = [r.index_step for r in reports if r.index_step is not None]
    cap = max(indexed) if indexed else None
    found: dict[tuple[int, str], tuple[StepReport, dict[int, list[int]]]] = {}
    for report in reports:
        for s in report.steps:
            if cap is not None and s.step > cap:
                continue
            _, holders = found.setdefault((s.step, s.checkpoint_id), (s, {}))
            for share in s.held:
                holders.setdefault(share, []).append(report.rank)
    out = []
    for (step, checkpoint_id), (first, holders) in sorted(found.items(), key=lambda kv: -kv[0][0]):
        if set(holders) >= set(range(first.share_count)):
            owners = dict(enumerate(first.owners)) if first.owners else {i: i for i in range(first.share_count)}
            for share, ranks in holders.items():
                owner = owners.get(share, -1)
                ranks.sort(key=lambda r: (r != owner, r))
            out.append(Candidate(step, checkpoint_id, owners, holders))
    return out


def _readers(c: Candidate, weights: dict[int, int], node_of: Callable[[int], int]) -> dict[int, int]:
    """Share -> reader: the owner if it holds a good copy, else the least-loaded good holder."""
    load: dict[int, int] = {}
    out = {}
    bad_nodes = {(share, node_of(rank)) for share, rank in c.bad}
    for share in sorted(c.holders, key=lambda s: -weights.get(s, 1)):
        good = [r for r in c.holders[share] if (share, node_of(r)) not in bad_nodes]
        if not good:
            raise NoCopyLeft(f"step {c.step}: no node holds a copy of share {share} that verifies")
        owner = c.owners.get(share)
        reader = owner if owner in good else min(good, key=lambda r: (load.get(r, 0), r))
        load[reader] = load.get(reader, 0) + weights.get(share, 1)
        out[share] = reader
    return out


class _Restore:
    """One attempt at one candidate step, on one rank."""

    def __init__(self, control: ControlGroup, root: str, step_dir: str, c: Candidate) -> None:
        self.control, self.root, self.step_dir, self.c = control, root, step_dir, c
        self.nodes = control.nodes

    def node_of(self, rank: int) -> int:
        return self.nodes.index(self.nodes[rank])

    def collective(self, what: str, op: Callable[[], Any]) -> Any:
        return collective(self.control, f"{what} for step {self.c.step} under {self.root}", op, GroupLoadError)

    def manifest(self) -> Manifest:
        """The step's manifest on every rank: read by the lowest holder, broadcast to the others."""
        src = min(r for ranks in self.c.holders.values() for r in ranks)
        raw = b""
        if self.control.rank == src:
            raw = read_manifest_bytes(self.step_dir)
        raw = self.collective("share the manifest", lambda: self.control.broadcast(raw, src))
        m = parse(raw, where=f"{self.step_dir}/{MANIFEST_NAME} (from rank {src})")
        if m.checkpoint_id != self.c.checkpoint_id:
            raise GroupLoadError(f"{self.step_dir}: rank {src}'s manifest names another checkpoint")
        return m

    def rounds(
        self, weights: dict[int, int], attempt: Callable[[dict[int, int], set[int]], dict[int, str]]
    ) -> dict[int, int]:
        """Runs `attempt(readers, todo)` until every share is done; returns the final readers.

        `attempt` returns {share: error} for the shares this rank failed; those copies are marked
        bad and the shares go to the next holders. Raises NoCopyLeft when a share has none."""
        todo = set(self.c.holders)
        readers = _readers(self.c, weights, self.node_of)
        while True:
            failed = attempt(readers, todo)
            gathered = self.collective("exchange read results", partial(self.control.all_gather, failed))
            todo = set()
            for rank, errors in enumerate(gathered):
                for share, error in errors.items():
                    log.warning(
                        "step %d: rank %d's copy of share %d does not verify (%s); trying the next copy",
                        self.c.step,
                        rank,
                        share,
                        error,
                    )
                    self.c.bad.add((share, rank))
                    todo.add(share)
            if not todo:
                return readers
            readers = _readers(self.c, weights, self.node_of)


def _verify_share(step_dir: str, m: Manifest, share: int) -> None:
    if m.shards:
        verify_checkpoint(os.path.join(step_dir, shard_name(share)))
        return
    for f in m.files:
        if f.writer == share:
            verify_file(step_dir, m, f, None)


def _fingerprint(step_dir: str, m: Manifest, share: int) -> tuple[Any, ...]:
    """The checkpoint id and (size, mtime, inode) of each file of `share`: a copy verified once
    need not be read again while these are unchanged."""
    where = os.path.join(step_dir, shard_name(share)) if m.shards else step_dir
    names = [f.name for f in (read_manifest(where).files if m.shards else m.files) if m.shards or f.writer == share]
    stats = [os.stat(os.path.join(where, n)) for n in [*names, MANIFEST_NAME]]
    return (m.checkpoint_id, tuple((st.st_size, st.st_mtime_ns, st.st_ino) for st in stats))


def _verify_attempt(
    step_dir: str,
    m: Manifest,
    rank: int,
    verified: dict[tuple[str, int], tuple[Any, ...]],
    readers: dict[int, int],
    todo: set[int],
) -> dict[int, str]:
    failed = {}
    for share in todo:
        if readers[share] != rank:
            continue
        try:
            fingerprint = _fingerprint(step_dir, m, share)
            if verified.get((step_dir, share)) != fingerprint:
                _verify_share(step_dir, m, share)
                verified[(step_dir, share)] = fingerprint
        except (FastPersistError, OSError) as e:
            failed[share] = describe(e)
    return failed


def verified_step(
    control: ControlGroup,
    root: str,
    step_path: Callable[[int], str],
    reports: list[NodeReport],
    verified: dict[tuple[str, int], tuple[Any, ...]],
) -> int | None:
    """The newest candidate step whose every share has a copy that verifies (checked by its
    readers; `verified` caches the copies this rank checked, by fingerprint)."""
    for c in candidates(reports):
        r = _Restore(control, root, step_path(c.step), c)
        try:
            m = r.manifest()
            attempt = partial(_verify_attempt, r.step_dir, m, control.rank, verified)
            r.rounds({}, attempt)
            return c.step
        except NoCopyLeft as e:
            log.warning("%s; trying the previous step", e)
    return None


def restore_step(
    control: ControlGroup,
    root: str,
    step_path: Callable[[int], str],
    reports: list[NodeReport],
    options: LoadOptions,
    step: int | None = None,
    out: object = None,
) -> tuple[int, Any]:
    """Loads the newest candidate step (or `step`) on every rank; returns (step, state); with
    `out`, its tensors are filled in place once the rank's whole share is read and verified."""
    tried = []
    for c in candidates(reports):
        if step is not None and c.step != step:
            continue
        r = _Restore(control, root, step_path(c.step), c)
        try:
            m = r.manifest()
            state = _load_sharded(r, m, options, out) if m.shards else _load_replicated(r, m, options, out)
            return c.step, state
        except NoCopyLeft as e:
            tried.append(str(e))
            log.warning("%s; trying the previous step", e)
    where = f"step {step}" if step is not None else "any step"
    raise FileNotFoundError(
        f"no rank group can restore {where} under {root}: {'; '.join(tried) or 'no step holds every share'}"
    )


def _load_replicated(r: _Restore, m: Manifest, options: LoadOptions, out: object) -> Any:
    stream = _core.PagedBuffer(direct_padded(m.total_bytes))
    by_share: dict[int, list[tuple[int, int]]] = {}
    for f in m.files:
        lo, hi = f.stream_offset_bytes, f.stream_offset_bytes + f.len_bytes
        by_share.setdefault(f.writer, []).extend(read_pieces(lo, hi, m.chunk_bytes))
    weights = {share: sum(b - a for a, b in pieces) for share, pieces in by_share.items()}

    def attempt(readers: dict[int, int], todo: set[int]) -> dict[int, str]:
        runs: list[list[tuple[int, int]]] = [[] for _ in range(r.control.size)]
        piece_share: dict[tuple[int, int], int] = {}
        for share in sorted(todo):
            runs[readers[share]].extend(by_share.get(share, []))
            for piece in by_share.get(share, []):
                piece_share[piece] = share
        failed: dict[int, str] = {}

        def read(lo: int, hi: int) -> None:
            share = piece_share[(lo, hi)]
            if share in failed:
                return
            try:
                read_window(r.step_dir, m, lo, hi, stream.span(lo, direct_padded(hi - lo)), True, options.config)
            except (FastPersistError, OSError) as e:
                failed[share] = describe(e)

        error = read_and_broadcast(r.control, r.step_dir, runs, stream, read)
        if error is not None:
            raise error
        return failed

    r.rounds(weights, attempt)
    return state_from_stream(r.step_dir, m, stream, options, out)


def _load_sharded(r: _Restore, m: Manifest, options: LoadOptions, out: object) -> Any:
    control = r.control
    if len(m.shards) != control.size:
        raise ValueError(f"{r.step_dir} has {len(m.shards)} shards but the group has {control.size} ranks")
    mine: dict[int, tuple[bytes, Manifest, _core.PagedBuffer]] = {}

    def attempt(readers: dict[int, int], todo: set[int]) -> dict[int, str]:
        failed = {}
        for share in sorted(todo):
            if readers[share] != control.rank:
                continue
            shard_dir = os.path.join(r.step_dir, shard_name(share))
            try:
                raw = read_manifest_bytes(shard_dir)
                sm = parse(raw, where=f"{shard_dir}/{MANIFEST_NAME}")
                mine[share] = (raw, sm, read_stream(shard_dir, sm, True, options.config))
            except (FastPersistError, OSError) as e:
                failed[share] = describe(e)
        return failed

    readers = r.rounds({}, attempt)
    sizes = r.collective(
        "exchange shard sizes",
        lambda: control.all_gather(
            {s: (len(v[0]), v[1].total_bytes) for s, v in mine.items() if readers[s] == control.rank}
        ),
    )
    me = control.rank
    reader = readers[me]
    if reader == me:
        raw, sm, stream = mine[me]
    else:
        raw_len, total = sizes[reader][me]
        raw_t = torch.empty(raw_len, dtype=torch.uint8)
        stream = _core.PagedBuffer(max(direct_padded(total), _core.DIRECT_ALIGN_BYTES))
        stream_t = torch.frombuffer(stream, dtype=torch.uint8)[:total] if total else torch.empty(0, dtype=torch.uint8)
    works = []

    def exchange() -> None:
        for share, v in mine.items():
            if share != me and readers[share] == me:
                works.append(
                    dist.isend(torch.frombuffer(bytearray(v[0]), dtype=torch.uint8), group=control.pg, group_dst=share)
                )
                if v[1].total_bytes:
                    works.append(
                        dist.isend(
                            torch.frombuffer(v[2], dtype=torch.uint8)[: v[1].total_bytes],
                            group=control.pg,
                            group_dst=share,
                        )
                    )
        if reader != me:
            works.append(dist.irecv(raw_t, group=control.pg, group_src=reader))
            if stream_t.numel():
                works.append(dist.irecv(stream_t, group=control.pg, group_src=reader))
        try:
            for w in works:
                if w is not None:
                    control.wait(w)
        except BaseException:
            works.clear()  # pending works hold the group open: the peers must see it close (control.py)
            raise

    r.collective("send each shard to its rank", exchange)
    if reader != me:
        raw = raw_t.numpy().tobytes()
        sm = parse(raw, where=f"{r.step_dir}/{shard_name(me)}/{MANIFEST_NAME} (from rank {reader})")
        if sm.total_bytes != total:
            raise GroupLoadError(f"rank {reader} sent a shard of {total} bytes whose manifest says {sm.total_bytes}")
    return state_from_stream(os.path.join(r.step_dir, shard_name(me)), sm, stream, options, out)
