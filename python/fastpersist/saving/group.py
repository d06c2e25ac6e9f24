"""Saves across a ``torch.distributed`` process group (docs/architecture.md, "Saves across a process group").

**Replicated** state (DDP, or the data-parallel copies of a model-parallel shard): the logical
byte stream is split at chunk granularity into near-equal ranges, one per writer rank; each
writer stages and writes only its range, into its own stripe directories. **Sharded** state
(FSDP/ZeRO: each rank's state differs): each rank writes its whole state as one shard
directory of the checkpoint (named by :func:`fastpersist.format.layout.shard_name`).

The commit protocol runs over the group's control plane (:mod:`fastpersist.distributed.control`), whose
operations time out after ``Config.timeout_s``:

A. rank 0 checks the target, creates the temporary directory and broadcasts the save's id (or
   its error, so every rank fails at once);
B. every rank writes its share (and, sharded, its shard manifest); a failure is caught, not
   raised yet;
C. all ranks exchange a status: files and checksums, or the error. If any rank failed, or one
   does not answer within the timeout (killed, hung), every rank cleans up and raises;
D. rank 0 writes the manifest and commits atomically; it broadcasts the outcome, so every rank
   returns only once the checkpoint is committed (or raises if it was not).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, Self, TypeVar

import fastpersist._core as _core

from ..config import Config
from ..distributed.control import collective, control_for, describe, writer_map
from ..errors import GroupSaveError
from ..format.layout import shard_name, stripe_tag, tmp_dir_for
from ..format.manifest import FileEntry, build
from ..format.ownership import DirLock, make_locked_dir
from ..futures import SaveResult
from .job import SaveJob, Written
from .leftovers import stripe_leftovers
from .share_layout import Layout
from .target import check_name_fits, check_stripe_roots, check_target, write_manifest

__all__ = ["CommitOutcome", "GroupSaveJob", "RankStatus", "StartMessage"]

T = TypeVar("T")


@dataclass(frozen=True)
class StartMessage:
    """Rank 0's word to the group at the start of a save: the temporary directory, or an error."""

    checkpoint_id: str = ""
    tmp_dir: str = ""
    error: str = ""


@dataclass(frozen=True)
class RankStatus:
    """What one rank reports after writing its share: its files, or why it failed."""

    rank: int
    error: str = ""
    writer: int | None = None
    files: list[dict[str, Any]] = field(default_factory=list)
    stripe_dirs: list[str] = field(default_factory=list)
    total_bytes: int = 0
    tensor_count: int = 0
    #: Sharded: the size of this rank's shard manifest.
    manifest_bytes: int = 0
    #: Partner level, replicated state: the files this rank wrote as copies of other writers'
    #: shares from its own (identical) state, with their checksums.
    copies: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class CommitOutcome:
    """Rank 0's word to the group after the commit: empty `error` means committed."""

    error: str = ""


class GroupSaveJob:
    """One rank's side of a group save; the same interface as :class:`SaveJob` for SaveFuture.

    Construction records the target; :meth:`start` runs the first collective (rank 0 makes the
    temporary directory and tells the others) and starts this rank's share.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: Config,
        group: Any,
        *,
        sharded: bool,
        pool: _core.Pool | None = None,
        early_copy: bool = True,
    ) -> None:
        self.path = os.path.abspath(os.fspath(path))
        # Every rank plans the same stream, so an "auto" chunk stays at the default here.
        self.config = config.resolved_for(self.path, tuned_chunk=False)
        self.sharded = sharded
        self.group = group
        self.pool = pool
        self.job: SaveJob | None = None
        #: Whether this rank's job copies small watched tensors before start returns (see SaveJob).
        self.early_copy = early_copy
        self.start_error: BaseException | None = None
        self.writer: int | None = None

    def start(self, state: object, *, background: bool = True) -> GroupSaveJob:
        """Agrees on the save with the group, then starts this rank's share of it."""
        self.control = control_for(self.group, self.config.timeout_s)
        self.rank = self.control.rank
        own_error: BaseException | None = None
        message: StartMessage | None = None
        tmp_lock: DirLock | None = None
        if self.rank == 0:
            try:
                check_stripe_roots(self.config.stripes)
                # The longest tag any rank's stripe directories get: a rank's tag is never shorter than a writer's.
                worst_tag = stripe_tag(rank=self.control.size - 1)
                check_name_fits(self.path, striped=bool(self.config.stripes), tag=worst_tag)
                check_target(self.path)
                checkpoint_id = uuid.uuid4().hex
                tmp = tmp_dir_for(self.path, checkpoint_id)
                tmp_lock = make_locked_dir(tmp)
                message = StartMessage(checkpoint_id=checkpoint_id, tmp_dir=tmp)
            except Exception as e:
                own_error = e
                message = StartMessage(error=describe(e))
        try:
            message = self._collective("start the save", lambda: self.control.broadcast(message))
        except GroupSaveError:
            if tmp_lock is not None:
                shutil.rmtree(tmp_lock.path, ignore_errors=True)
                tmp_lock.release()
            raise
        assert message is not None
        if message.error:
            if own_error is not None:
                raise own_error
            raise GroupSaveError(f"rank 0 could not start the save of {self.path}: {message.error}")
        self.layout = self._layout(message)
        # Rank 0 commits: the other ranks' stripes of the old tree must see it dead at once.
        return self._start_share(state, tmp_lock, background=background, hold_replaced=not self.config.stripes)

    def _start_share(
        self, state: object, tmp_lock: DirLock | None, *, background: bool, hold_replaced: bool = True
    ) -> Self:
        """Starts this rank's job on `self.layout`; an error is kept for the group (reported in
        finish(); wait_staged re-raises it), not raised."""
        try:
            self.job = SaveJob(
                self.path,
                self.config,
                layout=self.layout,
                pool=self.pool,
                tmp_lock=tmp_lock,
                early_copy=self.early_copy,
                hold_replaced=hold_replaced,
            )
            self.job.start(state, background=background)
        except BaseException as e:
            self.start_error = e
        return self

    def _layout(self, message: StartMessage) -> Layout:
        return self.layout_for(message.checkpoint_id, message.tmp_dir, owner=self.rank == 0)

    def layout_for(self, checkpoint_id: str, tmp: str, *, owner: bool) -> Layout:
        """This rank's layout in the temporary directory `tmp` (`owner`: it commits `tmp`)."""
        if self.sharded:
            self.writer = 0
            return Layout(
                checkpoint_id=checkpoint_id,
                tmp_dir=tmp,
                data_dir=os.path.join(tmp, shard_name(self.rank)),
                writer=0,
                writer_count=1,
                owner=owner,
                tag=stripe_tag(rank=self.rank),
            )
        writers = writer_map(self.control.nodes, self.config.writers)
        self.writer = writers.get(self.rank)
        return Layout(
            checkpoint_id=checkpoint_id,
            tmp_dir=tmp,
            data_dir=tmp,
            writer=self.writer,
            writer_count=len(writers),
            owner=owner,
            tag=stripe_tag(writer=self.writer),
        )

    def _collective(self, what: str, op: Callable[[], T]) -> T:
        return collective(
            self.control, f"{what} for {self.path}", op, GroupSaveError, ". Nothing was committed by this rank."
        )

    @property
    def from_device(self) -> bool:
        """Whether this rank's state has tensors staged from a device (a GPU)."""
        return self.job is not None and self.job.from_device

    def staged(self) -> bool:
        return self.job is None or self.job.staged()

    def wait_staged(self, timeout: float | None = None) -> None:
        if self.start_error is not None:
            raise self.start_error
        assert self.job is not None
        self.job.wait_staged(timeout)

    def cancel(self) -> bool:
        """Stops this rank's share unless it was already reported good to the group; the group
        then fails the save on every rank."""
        return self.job.cancel() if self.job is not None else False

    def _fail(self, error: BaseException) -> BaseException:
        """Makes `error` this rank's verdict unless one stands already; returns the standing one."""
        if self.job is None:
            return error
        return self.job.verdict.fail(error) or error

    def _discard_local(self) -> None:
        if self.job is not None:
            self.job.discard()

    def _exchange(self, what: str, op: Callable[[], T]) -> T:
        """A collective once this rank's share is written: if the group fails, this rank's share
        takes the group's error as its verdict and is discarded before the error is raised."""
        try:
            return self._collective(what, op)
        except GroupSaveError as e:
            self._fail(e)
            self._discard_local()
            raise

    def _raise_failed(self, failures: list[str], own: BaseException | None, what: str = "") -> NoReturn:
        """Fails and discards this rank's share, then raises its own error, else one naming the
        ranks' `failures` (the first four) and what the group failed `what` (e.g. "to ...")."""
        detail = "; ".join(failures[:4]) + (f"; and {len(failures) - 4} more" if len(failures) > 4 else "")
        doing = f" {what}" if what else ""
        error = self._fail(
            own or GroupSaveError(f"the save of {self.path} failed{doing} ({detail}); nothing was committed")
        )
        self._discard_local()
        raise error

    def _write_share(self, timeout: float | None) -> tuple[RankStatus, Written | None, BaseException | None]:
        """Waits for this rank's files (and shard manifest); its status for the group."""
        local_error = self.start_error
        written = None
        manifest_bytes = 0
        if self.job is not None and local_error is None:
            try:
                written = self.job.wait_written(timeout)
                if self.sharded:
                    doc = self.job.manifest(written.entries, written.stripe_dirs)
                    write_manifest(self.layout.data_dir, doc, durable=self.config.durable)
                    manifest_bytes = len(doc)
                # From here this rank's share is reported good: a late cancel() cannot undo that.
                self.job.verdict.seal()
            except BaseException as e:
                local_error = self.job.verdict.fail(e) or e
        if local_error is not None or written is None or self.job is None:
            error = describe(local_error or RuntimeError("no job"))
            return RankStatus(rank=self.rank, error=error), None, local_error
        status = RankStatus(
            rank=self.rank,
            writer=self.writer,
            files=[e.to_json() for e in written.entries],
            stripe_dirs=written.stripe_dirs,
            total_bytes=self.job.plan.total_bytes,
            tensor_count=len(self.job.records),
            manifest_bytes=manifest_bytes,
        )
        return status, written, None

    def _failures(self, statuses: list[RankStatus]) -> list[str]:
        failures = [f"rank {s.rank}: {s.error}" for s in statuses if s.error]
        if not failures and not self.sharded and len({(s.total_bytes, s.tensor_count) for s in statuses}) > 1:
            failures = [
                "the state differs between ranks (sizes or tensor counts); pass sharded=True "
                "if each rank holds its own shard"
            ]
        return failures

    def finish(self, timeout: float | None = None) -> SaveResult:
        status, written, local_error = self._write_share(timeout)
        statuses = self._exchange("exchange write results", lambda: self.control.all_gather(status))
        failures = self._failures(statuses)
        if failures:
            self._raise_failed(failures, local_error)
        assert self.job is not None and written is not None
        outcome: CommitOutcome | None = None
        if self.rank == 0:
            try:
                self._commit(statuses)
                outcome = CommitOutcome()
            except BaseException as e:
                outcome = CommitOutcome(error=describe(e))
                self.job.discard()
        try:
            outcome = self._collective("learn whether rank 0 committed", lambda: self.control.broadcast(outcome))
        except GroupSaveError as e:
            if self.rank != 0:
                self._fail(e)
                self._discard_local()
            raise
        assert outcome is not None
        if outcome.error:
            error = self._fail(GroupSaveError(f"rank 0 could not commit {self.path}: {outcome.error}"))
            self._discard_local()
            raise error
        self.job.verdict.mark_committed()
        if self.config.stripes:
            # A replaced checkpoint's stripe directories on this rank's drives (rank 0 removed its tree).
            stripe_leftovers(os.path.dirname(self.path), self.config.stripes, names={os.path.basename(self.path)})
        return self.job.result(written)

    def _commit(self, statuses: list[RankStatus]) -> None:
        assert self.job is not None
        if self.sharded:
            doc = build(
                checkpoint_id=self.layout.checkpoint_id,
                chunk_bytes=self.config.resolved_chunk_bytes,
                checksum=self.config.checksum,
                total_bytes=0,
                blobs=[],
                files=[],
                stripes=[],
                tensors=[],
                tree={"spec_version": 1, "root": None},
                shards=[shard_name(s.rank) for s in statuses],
                extra=self.manifest_extra(statuses),
            )
            self.job.publish(doc)
            return
        stripes: list[str] = []
        entries: list[FileEntry] = []
        for s in sorted((s for s in statuses if s.writer is not None), key=lambda s: s.writer or 0):
            base = len(stripes)
            stripes.extend(s.stripe_dirs)
            for item in s.files:
                entries.append(
                    FileEntry(
                        name=item["name"],
                        stripe=None if item["stripe"] is None else base + item["stripe"],
                        writer=item["writer"],
                        stream_offset_bytes=item["stream_offset_bytes"],
                        len_bytes=item["len_bytes"],
                        chunk_crc32c=item["chunk_crc32c"],
                    )
                )
        self.job.publish(self.job.manifest(entries, stripes, self.manifest_extra(statuses)))

    def manifest_extra(self, statuses: list[RankStatus]) -> dict[str, Any] | None:
        """What a kind of group save adds to the manifest's ``extra`` (nothing here)."""
        return None
