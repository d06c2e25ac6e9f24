"""A group save for the partner level (docs/architecture.md, "Checkpoint levels"): every node commits its own step
directory, holding its ranks' shares and copies of its partners' shares.

Unlike a plain group save (:mod:`fastpersist.saving.group`, one directory that every rank
writes into), each node's lowest rank (its leader) makes the temporary directory under that
node's `root` and commits it there, so losing one node loses no step. The protocol, every
collective over the control group under ``Config.timeout_s``:

A. rank 0 draws the save's id; each leader checks its target and makes its node's temporary
   directory; the ranks exchange a status, and all raise if any node could not start;
B. every rank writes its share into its node's temporary directory (sharded: its shard
   directory with its manifest); the ranks exchange their files and checksums;
C. each share's files go to its partners (:mod:`fastpersist.distributed.placement`) over gloo,
   read back with their checksums checked and checked again on arrival
   (:mod:`fastpersist.distributed.transfer`); the ranks exchange a status. If any copy failed (a
   partner killed, ENOSPC), nothing is committed anywhere and every rank raises: a step
   counts only once every share has its copies. With replicated state every rank holds the
   same bytes, so in step B each partner already wrote its copies from its own state, in the
   same engine job as its own share (no read-back, nothing on the wire); a copy is kept only
   if its files and chunk checksums equal the owner's, else it is replaced by a transfer (ranks
   whose "replicated" state differs cost time, never correctness);
D. each leader writes the manifest (the same on every node, naming the placement in
   ``extra["levels"]``) and commits its node's directory atomically; the ranks exchange the
   outcome, and all raise if a node could not commit (the nodes that did keep the step; a
   restore uses it only if the nodes that hold it cover every share).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
import uuid
from dataclasses import replace
from typing import Any

import fastpersist._core as _core

from ..config import Config
from ..distributed.control import control_for, failures_in, outcome, writer_map
from ..distributed.placement import Placement
from ..distributed.transfer import ShareFile, Transfer, send_and_receive
from ..errors import GroupSaveError
from ..format.layout import MANIFEST_NAME, shard_name, tmp_dir_for
from ..format.ownership import DirLock, make_locked_dir
from ..futures import SaveResult
from .group import GroupSaveJob, RankStatus, StartMessage
from .share_layout import Layout
from .target import check_name_fits, check_target

__all__ = ["PartnerSaveJob", "share_files"]

log = logging.getLogger("fastpersist")


def share_files(status: RankStatus, sharded: bool) -> list[ShareFile]:
    """The files of one rank's share, named relative to the step directory."""
    prefix = shard_name(status.rank) + "/" if sharded else ""
    files = [ShareFile(prefix + f["name"], f["len_bytes"], list(f["chunk_crc32c"])) for f in status.files]
    if sharded:
        files.append(ShareFile(prefix + MANIFEST_NAME, status.manifest_bytes))
    return files


class PartnerSaveJob(GroupSaveJob):
    """One rank's side of a save whose every share is also kept on `replicas` other nodes."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: Config,
        group: Any,
        *,
        sharded: bool,
        replicas: int,
        pool: _core.Pool | None = None,
        early_copy: bool = True,
    ) -> None:
        if config.stripes:
            raise ValueError(
                "the Partner level does not support Config.stripes yet: each node keeps its shares under its root"
            )
        super().__init__(path, config, group, sharded=sharded, pool=pool, early_copy=early_copy)
        self.replicas = replicas

    def start(self, state: object, *, background: bool = True) -> PartnerSaveJob:
        self.control = control_for(self.group, self.config.timeout_s)
        self.rank = self.control.rank
        self.placement = Placement(self.control.nodes)
        self.placement.check_replicas(self.replicas)
        message = StartMessage(checkpoint_id=uuid.uuid4().hex) if self.rank == 0 else None
        message = self._collective("start the save", lambda: self.control.broadcast(message))
        assert message is not None
        tmp = tmp_dir_for(self.path, message.checkpoint_id)
        tmp_lock, own_error = self._make_node_dir(tmp)
        started = self._collective(
            "learn whether every node could start", lambda: self.control.all_gather(outcome(own_error))
        )
        failed = failures_in(started)
        if failed:
            if tmp_lock is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp_lock.release()
            if own_error is not None:
                raise own_error
            r, e = failed[0]
            raise GroupSaveError(
                f"rank {r} (node {self.placement.rank_nodes[r]}) could not start the save of its node's copy of "
                f"{self.path}: {e}"
            )
        self.layout = self.layout_for(message.checkpoint_id, tmp, owner=self.placement.is_leader(self.rank))
        return self._start_share(state, tmp_lock, background=background)

    def layout_for(self, checkpoint_id: str, tmp: str, *, owner: bool) -> Layout:
        """The group layout; with replicated state this rank also writes the shares it keeps copies of."""
        layout = super().layout_for(checkpoint_id, tmp, owner=owner)
        if self.sharded:
            return layout
        writers = writer_map(self.control.nodes, self.config.writers)
        kept = tuple(writers[r] for r in self.placement.sources(self.rank, self.replicas) if r in writers)
        return replace(layout, also_writers=kept)

    def _split_copies(self, status: RankStatus) -> RankStatus:
        """Moves the files written as copies of other writers' shares out of `status.files`."""
        if self.sharded or not status.files:
            return status
        own = [f for f in status.files if f["writer"] == self.writer]
        copies = [f for f in status.files if f["writer"] != self.writer]
        return replace(status, files=own, copies=copies)

    @staticmethod
    def _copy_matches(owner: RankStatus, keeper: RankStatus) -> bool:
        """Whether `keeper` wrote `owner`'s files with the same lengths and chunk checksums."""

        def key(f: dict[str, Any]) -> tuple[str, int, tuple[int, ...]]:
            return (f["name"], f["len_bytes"], tuple(f["chunk_crc32c"]))

        made = sorted(key(f) for f in keeper.copies if f["writer"] == owner.writer)
        return bool(made) and made == sorted(key(f) for f in owner.files)

    def _make_node_dir(self, tmp: str) -> tuple[DirLock | None, BaseException | None]:
        """The node leader checks its target and makes its node's temporary directory."""
        if not self.placement.is_leader(self.rank):
            return None, None
        try:
            check_name_fits(self.path, striped=False)
            check_target(self.path)
            return make_locked_dir(tmp), None
        except FileExistsError as e:
            hint = " (do two nodes share this root? with the Partner level each node needs its own root)"
            return None, FileExistsError(e.errno, f"{e.strerror}{hint}", e.filename)
        except Exception as e:
            return None, e

    def manifest_extra(self, statuses: list[RankStatus]) -> dict[str, Any]:
        return {
            "levels": {
                "replicas": self.replicas,
                "rank_nodes": self.placement.rank_nodes,
                "share_ranks": [s.rank for s in statuses if s.writer is not None],
            }
        }

    def _replicate(self, statuses: list[RankStatus]) -> int:
        """Step C: sends this rank's share to the partners that lack a good copy of it and
        receives the shares it keeps a copy of; returns the shares sent over the group."""
        transfers = [
            Transfer(src=s.rank, dst=p, files=share_files(s, self.sharded))
            for s in statuses
            if s.writer is not None
            for p in self.placement.partners(s.rank, self.replicas)
            if self.sharded or not self._copy_matches(s, statuses[p])
        ]
        for t in transfers:
            if t.dst == self.rank:  # a copy made from this rank's state that differs: replaced
                for f in t.files:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.layout.tmp_dir, f.name))
        send_and_receive(
            self.control.pg,
            self.rank,
            transfers,
            src_dir=self.layout.tmp_dir,
            dst_dir=self.layout.tmp_dir,
            chunk_bytes=self.config.resolved_chunk_bytes,
            timeout_s=self.config.timeout_s,
            durable=self.config.durable,
        )
        return len(transfers)

    def _gather_errors(self, what: str, error: BaseException | None) -> list[tuple[int, str]]:
        """Every rank's outcome of `what` (control.agree's encoding), as ``(rank, why)`` failures."""
        return failures_in(self._exchange(what, lambda: self.control.all_gather(outcome(error))))

    def finish(self, timeout: float | None = None) -> SaveResult:
        status, written, local_error = self._write_share(timeout)
        status = self._split_copies(status)
        if status.error == "" and self.sharded:
            size = os.path.getsize(os.path.join(self.layout.data_dir, MANIFEST_NAME))
            status = replace(status, manifest_bytes=size)
        statuses = self._exchange("exchange write results", lambda: self.control.all_gather(status))
        failures = self._failures(statuses)
        if failures:
            self._raise_failed(failures, local_error, "to write every share")
        copy_error: BaseException | None = None
        copy_started = time.perf_counter()
        sent = 0
        try:
            sent = self._replicate(statuses)
        except Exception as e:
            copy_error = e
        copy_seconds = time.perf_counter() - copy_started
        if sent and not self.sharded:
            log.info(
                "%d copies of %s's replicated shares differed from their owners' (is the state the same on "
                "every rank?) and were sent over the group instead",
                sent,
                self.path,
            )
        failed = self._gather_errors("exchange replication results", copy_error)
        if failed:
            self._raise_failed(
                [f"rank {r}: {e}" for r, e in failed],
                copy_error,
                f"to keep {self.replicas} copies of every share on other nodes",
            )
        assert self.job is not None and written is not None
        commit_error: BaseException | None = None
        if self.layout.owner:
            try:
                self._commit(statuses)
            except BaseException as e:
                commit_error = e
                self.job.discard()
        failed = self._gather_errors("learn whether every node committed", commit_error)
        if failed:
            nodes = sorted({self.placement.rank_nodes[r] for r, _ in failed})
            error = self._fail(
                commit_error
                or GroupSaveError(
                    f"nodes {nodes} could not commit their copy of {self.path} ({failed[0][1]}); the step is "
                    "not complete on the partner level"
                )
            )
            if not self.job.verdict.committed:
                self._discard_local()
            raise error
        self.job.verdict.mark_committed()
        result = self.job.result(written)
        result.phases["replicate"] = copy_seconds
        return result
