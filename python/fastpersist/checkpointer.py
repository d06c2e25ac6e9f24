"""`Checkpointer`: per-iteration checkpoints that overlap training, with retention and resume.

Layout under `root`::

    root/step-00000120/      a committed checkpoint (see docs/format.md)
    root/step-00000121/
    root/latest.json         {"step": 121, "path": "step-00000121", ...}, replaced atomically

The loop calls ``ck.save(step, state)`` after ``optimizer.step()`` and ``ck.wait_staged()``
right before the next ``optimizer.step()`` (or installs :func:`fastpersist.integrations.guard_optimizer`
so it cannot be forgotten). The save of step *i* is written while step *i+1* runs forward and
backward.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import functools
import json
import logging
import os
import threading
from collections.abc import Iterable
from typing import Any, Literal

import fastpersist._core as _core

from .advisor.history import DEFAULT_MAX_EVERY, SaveHistory
from .advisor.multilevel import Failures, local_mtbf_s
from .arguments import given_path, given_timeout
from .config import Config, given_config, snapshot_pool_bytes
from .distributed.control import control_for, group_rank_and_size
from .format.layout import INDEX_NAME, write_small_file
from .futures import SaveFuture, SaveResult
from .levels.host import CommittedStepCopies, RestoringCopies, RootLevel
from .levels.level_objects import Level, levels_given, moved_keywords_error, root_and_copies
from .levels.local_level import LocalLevel
from .levels.local_steps import LocalSteps
from .levels.resume import bring_in, restore_point, run_id
from .retention import retired_steps
from .saving.in_flight import InFlight
from .saving.incremental import Incremental
from .saving.optimizer_guard import guard_optimizer
from .saving.pools import pool_for
from .saving.remover import wait_removed
from .saving.share_layout import flatten_to_save
from .saving.start import start_save

__all__ = ["Checkpointer"]

log = logging.getLogger("fastpersist")


class Checkpointer:
    """Saves a training state every `every` steps, asynchronously, keeping the newest `keep`.

    Args:
        root: directory holding the checkpoints (created if missing); an empty path is refused
            (it would make the working directory the root).
        every: save when ``step % every == 0``; or ``"auto"``: start at 1 and adapt from this
            Checkpointer's own measured stall, write and step times (see docs/advisor.md).
        keep: committed checkpoints to keep (>= 1). Older ones are deleted only after a newer
            one has committed and its files check out (present, of their recorded sizes), so
            there is always at least one good checkpoint. Steps newer than the one being saved
            (another run's, in a reused root) are never deleted; see :meth:`latest`.
        config: a :class:`Config`; by default the staging pool is sized to hold the whole state
            (snapshot mode, capped at a quarter of RAM) so ``wait_staged()`` costs one memcpy.
        group: a ``torch.distributed`` process group: every rank calls the same methods; the
            save is replicated across the group (or sharded with ``sharded=True``); rank 0
            commits and maintains the index; every rank removes its own stripe directories of
            retired steps.
        sharded: each rank saves its own shard (FSDP/ZeRO-style); needs `group`.
        levels: the levels beyond the root, one object each (:mod:`fastpersist.levels.level_objects`):
            :class:`~fastpersist.Partner` (copies of each rank's share on other nodes; needs
            `group`), :class:`~fastpersist.Remote` (a shared directory or an object store drained
            in the background), :class:`~fastpersist.HFExport` (Hugging Face safetensors exported
            in the background). See docs/levels.md.
        failures: the failure model (:class:`fastpersist.Failures`: process crashes, node losses,
            cluster losses). ``every="auto"`` needs it: `every` is set against the failures the
            local and partner levels survive; with a :class:`~fastpersist.Remote` level of
            ``every=None``, each drain's measured cost sets the remote interval to the
            multi-level advisor's choice against the failures only the remote level survives
            (docs/advisor.md, "Several levels").
        max_every: the largest interval ``every="auto"`` may choose.
        incremental: an :class:`~fastpersist.Incremental` without a base: each step writes only the
            blocks that differ from the newest committed step and links the rest (one process,
            no `group`, no stripes yet; docs/incremental.md).

    The keywords of earlier versions (``replicas=``, ``remote*=``, ``export_hf*=``, ``mtbf_s=``)
    are refused with a TypeError that shows the call's new form.

    Levels (docs/levels.md): **local**, `root` itself (an NVMe directory, or a directory under
    ``/dev/shm`` for an in-memory level that survives the process but not the node); **partner**,
    with ``Partner(replicas=k)``, copies of each rank's share in the roots of k other nodes. A step counts
    on a level once it is complete there; :meth:`latest` and :meth:`load` restore from the fastest
    level that holds a copy that verifies, agreed by every rank; :meth:`levels` says what each holds.

    Example:
        >>> ck = fp.Checkpointer("runs/exp1", every=1, keep=2)        # doctest: +SKIP
        >>> for step in range(start, steps):                           # doctest: +SKIP
        ...     loss = model(batch).loss; loss.backward()
        ...     ck.wait_staged()          # the previous save no longer reads the tensors
        ...     opt.step(); opt.zero_grad()
        ...     ck.save(step, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step})
        >>> ck.wait()
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        every: int | Literal["auto"] = 1,
        keep: int = 2,
        config: Config | None = None,
        group: object = None,
        sharded: bool = False,
        levels: Iterable[Level] = (),
        failures: Failures | None = None,
        max_every: int = DEFAULT_MAX_EVERY,
        incremental: Incremental | None = None,
        **moved: Any,
    ) -> None:
        if moved:
            raise moved_keywords_error(moved)
        if incremental is not None and (incremental.base is not None or group is not None):
            raise ValueError(
                "Checkpointer(incremental=...): each step builds on the newest committed step, so give no base; "
                "one process only (not yet with group=)"
            )
        #: Each step written as an increment of the newest committed one (None: in full).
        self.incremental = incremental
        if every == "auto" and group is not None:
            raise ValueError('every="auto" is not supported with group= yet: every rank must save the same steps')
        if type(keep) is not int or keep < 1:
            raise ValueError(f"keep={keep!r}: expected an integer >= 1 (the last good checkpoint is always kept)")
        if sharded and group is None:
            raise ValueError("sharded=True needs group=")
        if config is not None:
            given_config(config)
        partner, copies = root_and_copies(levels_given(levels, group))
        #: Copies of each rank's share kept on other nodes (the partner level; 0: none).
        self.replicas = partner.replicas if partner is not None else 0
        self.failures = failures
        mtbf_s = local_mtbf_s(failures, self.replicas, auto=every == "auto")
        self.root = os.path.abspath(given_path(root, "root", "Checkpointer"))
        self.history = SaveHistory(self.root, every=every, mtbf_s=mtbf_s, max_every=max_every)
        self.keep = keep
        self.config = config
        self.group = group
        self.sharded = sharded
        self.rank = 0
        if group is not None:
            self.rank = group_rank_and_size(group)[0]
            # Made now, while every rank is here: a rank lost during a later save or restore is then
            # noticed through the group's watch (docs/distributed.md), not after timeout_s.
            control_for(group, self.timeout_s)
        #: The saves started and not yet seen through (its newest: ``in_flight.newest()``).
        self.in_flight = InFlight()
        self._from_device = False
        self._pool: _core.Pool | None = None
        self._lock = threading.Lock()
        #: The local level: the root's committed steps, its index, the newest step that verifies.
        self.local = LocalSteps(self.root)
        os.makedirs(self.root, exist_ok=True)
        #: What :meth:`clean` removed (it runs before the first save, never for a read-only use).
        self.removed_leftovers: list[str] = []
        self._cleaned = False
        self.history.persist = self.rank == 0
        #: The result of the newest committed save (None before one).
        self.last_result: SaveResult | None = None
        #: This root's run id (levels/run_identity.py), set at the first commit.
        self.run: str | None = None
        #: The levels that copy committed steps elsewhere, in the order given (the commit sequence's order).
        self._copies: list[CommittedStepCopies] = [level.attach(self) for level in copies]
        #: The one of them a restore may take a step from (the remote level), if any.
        self._far: RestoringCopies | None = next((c for c in self._copies if isinstance(c, RestoringCopies)), None)
        #: The level that keeps the root's steps: the partner level (attached last, as before: its
        #: first use is collective), or the local level alone.
        self._root: RootLevel = partner.attach(self) if partner is not None else LocalLevel(self)

    @property
    def timeout_s(self) -> float:
        """How long a rank of the group waits for the others (the config's ``timeout_s``)."""
        return float(self.config.timeout_s) if self.config is not None else Config().timeout_s

    @property
    def every(self) -> int:
        """Steps between saves (with ``every="auto"``: the current choice)."""
        return self.history.every

    # -- paths -------------------------------------------------------------------------------

    def path(self, step: int) -> str:
        """The directory of `step`'s checkpoint."""
        return self.local.path(step)

    def steps(self) -> list[int]:
        """Steps with a committed checkpoint (a manifest), oldest first. Does not verify data."""
        return self.local.steps()

    def clean(self) -> list[str]:
        """Removes what interrupted saves left in `root` and this rank's stripe roots; returns the paths.

        Runs by itself before this Checkpointer's first save. Only provable leftovers go (see
        :func:`fastpersist.clean`): another process's save in progress, other roots sharing the
        stripe roots, and committed steps are left alone. In a group, rank 0 cleans `root` and
        every rank its own stripe roots.
        """
        removed = self._root.clean()
        self.removed_leftovers.extend(removed)
        self._cleaned = True
        return removed

    def _before_first_save(self, step: int) -> None:
        self.clean()
        newer = [s for s in self.steps() if s > step]
        if newer and self.rank == 0:
            log.warning(
                "%s holds steps %s, newer than step %d being saved (another run's?). They are kept and never "
                "retired by this run; latest() follows this Checkpointer's index (%s), not the highest step.",
                self.root,
                newer[:10],
                step,
                INDEX_NAME,
            )

    # -- saving ------------------------------------------------------------------------------

    def _config_for(self, state: object) -> tuple[Config, object]:
        """The config of every save, resolved once for the root's device so that the pool held
        for every save fits its chunks (resolving a config of integers returns it as it is), and
        the state to save: without a config the pool is sized by the first state, flattened for
        that once and handed to the save flattened."""
        tuned_chunk = self.group is None  # a group's ranks plan one stream: see Config.resolved_for
        if self.config is not None:
            self.config = self.config.resolved_for(self.root, tuned_chunk=tuned_chunk)
            return self.config, state

        flat = flatten_to_save(state)
        nbytes = sum(b.nbytes for b in flat.blobs)
        chunk = Config().resolved_for(self.root, tuned_chunk=tuned_chunk).resolved_chunk_bytes
        pool = snapshot_pool_bytes(nbytes, chunk)
        self.config = Config(pool_bytes=pool).resolved_for(self.root, tuned_chunk=tuned_chunk)
        return self.config, flat

    def save(self, step: int, state: object) -> SaveFuture | None:
        """Starts saving `state` as `step` if the step is due; returns its future, else None.

        Waits for the previous save to finish first, except for a state of device (GPU) tensors:
        saved by one process alone (no `group`), a step due while the previous save still writes
        is staged at once (one device-to-host copy) and written once the disk is free, unless a
        newer due step replaces it first; with `group`, such a step is skipped on every rank and
        None returned. A replaced or skipped step is not on the local level (saving/in_flight.py,
        docs/levels.md). If a save failed and nobody has seen its error yet (``wait_staged()``
        raises it at once), it is raised here (in a group: at the first step not skipped) and
        this step is not saved.
        """
        if type(step) is not int or step < 0:
            raise ValueError(f"step={step!r}: expected a non-negative integer")
        if not self.history.due(step):
            return None
        for copies in self._copies:
            copies.before_save()
        ahead = self._from_device and self.group is None and not self.sharded and self.in_flight.disk_busy()
        with self.history.waiting("commit"):
            if self.group is not None and self.in_flight.skip_in_group(
                self.group, self.timeout_s, from_device=self._from_device, step=step
            ):
                log.debug("step %d skipped: a rank's previous save still writes", step)
                return None
            self.in_flight.raise_unseen() if ahead else self.in_flight.finish_all()
        with self.history.waiting("start"), self._lock:
            config, state = self._config_for(state)
            if not self._cleaned:
                self._before_first_save(step)
            if self._pool is None:
                self._pool = pool_for(config)  # held for this Checkpointer's life, reused by every save
            gate = _core.WriteGate() if ahead else None
            job = start_save(
                state,
                self.path(step),
                config,
                group=self.group,
                sharded=self.sharded,
                pool=self._pool,
                replicas=self.replicas,
                write_gate=gate,
                incremental=self._increment_on(step),
            )
            future = SaveFuture(job, on_commit=functools.partial(self._after_commit, step))
            self.in_flight.started(future, gate)
            self._from_device = getattr(job, "from_device", False)  # a GPU state's next steps may go ahead
            return future

    def _increment_on(self, step: int) -> Incremental | None:
        """This Checkpointer's Incremental with the newest committed step up to `step` as its base."""
        if self.incremental is None:
            return None
        older = [s for s in self.steps() if s <= step]
        return dataclasses.replace(self.incremental, base=self.path(older[-1]) if older else None)

    def _after_commit(self, step: int, result: SaveResult) -> None:
        """On every rank, once `step` committed: the index (rank 0), then retention, then the costs."""
        stripes = self.config.stripes if self.config else None
        pinned = set().union(*(copies.pinned() for copies in self._copies))
        candidates = [self.path(s) for s in retired_steps(self.steps(), step, self.keep) if s not in pinned]
        if self.run is None:
            self.run = run_id(self)
        self._root.after_commit(step, result, candidates)  # the index, then retention
        self.last_result = result
        if self.rank == 0:
            self.history.committed(result, stripes=stripes, group=self.group is not None)  # costs and wear
        for copies in self._copies:
            copies.after_commit(step)

    def write_index(self, step: int) -> None:
        """Replaces the root's index (``latest.json``) with one naming `step`, durably (the root level calls it)."""
        doc: dict[str, Any] = {
            "step": step,
            "path": os.path.basename(self.path(step)),
            "updated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        if self.run is not None:
            doc["run"] = self.run
        write_small_file(os.path.join(self.root, INDEX_NAME), (json.dumps(doc, indent=2) + "\n").encode(), durable=True)

    def wait_staged(self, timeout: float | None = None) -> None:
        """Blocks until the newest save (if any) no longer reads the state's tensors (`timeout`:
        seconds, as for :meth:`SaveFuture.wait_staged`)."""
        timeout = given_timeout(timeout, "Checkpointer.wait_staged")
        with self.history.waiting("staged"):
            self.in_flight.wait_staged(timeout)

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Blocks until every save in flight commits; returns the newest's result or raises an
        error (``TimeoutError`` once `timeout` seconds passed; None waits without a limit)."""
        return self.in_flight.wait(given_timeout(timeout, "Checkpointer.wait"))

    # -- resuming ----------------------------------------------------------------------------

    def latest(self) -> int | None:
        """The newest step, up to the one the index names, whose checkpoint is committed and verifies, or None.

        The index (``latest.json``, replaced atomically after each commit) names the step this
        root's Checkpointer last committed: steps above it (an earlier run's, in a reused root)
        are never returned. If the indexed step fails verification, the next older one that
        verifies is returned. Without an index, the newest step that verifies. Verification
        results are cached per checkpoint while its files are unchanged.

        With ``replicas``, every rank must call it: the newest step, up to the highest any node's
        index names, that every rank can restore from some level, each share's copy verified
        (docs/levels.md); the ranks agree on it. It waits for the save in flight first.

        With ``remote``: a newer step of this run's remote lineage (docs/levels.md), never
        waiting for the drain; the store is asked only if the local level lacks the step its
        index names, for at most about 10 s (``levels.remote_stores.PROBE_TIMEOUT_S``) and one WARNING.

        Another process may save to the root meanwhile: a step it retires while this one checks
        it is not damage (nothing is logged); the index and the steps are read again, up to
        :data:`RESTORE_ATTEMPTS` times, then ``CheckpointNotFoundError`` says to try again.
        """
        return restore_point(self, self._root, self._far)[0]

    def load(
        self,
        step: int | None = None,
        *,
        out: object = None,
        map_location: Any = None,
        namedtuple_types: Iterable[type] = (),
    ) -> Any:
        """Loads `step` (default: :meth:`latest`); `out`, `map_location` and `namedtuple_types`
        as in :func:`fastpersist.load`.

        With ``replicas``, every rank must call it: each takes its share from its own root, else
        from a partner's copy (docs/levels.md); `out` is filled once the rank's share is read and
        verified, so a failed restore leaves it as it was.

        Without `step`, a step retired by another process's save before or while it is read is
        not an error: the newest step is chosen again (up to :data:`RESTORE_ATTEMPTS` times; not in a
        group, whose load is collective).

        Raises:
            FileNotFoundError: there is no good checkpoint under `root`.
            CheckpointNotFoundError: the `step` asked for is not committed here (never saved, or
                retired), naming its path.
        """
        if step is not None and (type(step) is not int or step < 0):
            raise TypeError(f"step={step!r}: expected a step number (a non-negative integer) or None (the latest)")
        if self._far is not None:
            step = bring_in(self, self._root, self._far, step)
            if step is None:
                raise FileNotFoundError(errno.ENOENT, "no committed, verified checkpoint on any level", self.root)
        with self.history.loading():
            return self._root.load(step, out, map_location, namedtuple_types)

    def levels(self) -> dict[str, Any]:
        """What this rank's node holds on each level: ``{"local": {...}, "partner": {...}}``, each
        with the ``steps`` held, their ``bytes`` and ``last_seconds`` (the last copy's time)."""

        found = self._root.levels()
        for copies in self._copies:
            found.update(copies.levels())
        return found

    def close(self) -> None:
        """Waits for every pending copy, the remote drain and Hugging Face export included (raising
        a failure nobody has seen yet, or the newest drain's or export's), and for the removal of
        retired steps; the Checkpointer can still be used afterwards."""
        self.in_flight.finish_all()
        for copies in self._copies:
            copies.close()
        wait_removed()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:  # the body's exception is the one that matters
            log.warning("closing %s after an error: the pending save failed too: %s", self.root, e)

    def guard(self, optimizer: Any) -> Any:
        """Makes ``optimizer.step()`` call :meth:`wait_staged` first; returns the hook handle."""
        return guard_optimizer(optimizer, self)

    def __repr__(self) -> str:
        return f"Checkpointer({self.root!r}, every={self.every}, keep={self.keep})"
