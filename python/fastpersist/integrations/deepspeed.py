"""DeepSpeed's checkpoints written by fastpersist: a ``CheckpointEngine``, blocking or decoupled.

Install it on an initialized engine, on every rank, with one call:

    >>> import fastpersist as fp
    >>> from fastpersist.integrations import deepspeed as fp_deepspeed
    >>> engine, optimizer, _, _ = deepspeed.initialize(model=model, config=ds_config)   # doctest: +SKIP
    >>> fp_deepspeed.install(engine, decoupled=True, config=fp.Config())                # doctest: +SKIP
    >>> engine.save_checkpoint("ckpt")     # returns once the files are being written   # doctest: +SKIP

``engine.save_checkpoint`` and ``engine.load_checkpoint`` are used as before. Each of
DeepSpeed's files is written by :func:`fastpersist.torch_save` (blocking) or
:func:`fastpersist.torch_save_async` (decoupled) in ``torch.save``'s format, which every reader of
DeepSpeed checkpoints (``zero_to_fp32.py``, the converters, ``torch.load``) reads: whole or absent,
never torn (docs/integrations.md, "DeepSpeed", says why the format stays).

**When ``latest`` moves.** Only at this engine's :meth:`~FastPersistCheckpointEngine.commit`:
each rank waits until its files of the tag are durable, the ranks agree over a private gloo group
(a killed rank is noticed at once), and only if every rank succeeded does rank 0 replace
``latest`` atomically and durably, before the commit returns on any rank (:func:`install` has
DeepSpeed's own code pass ``save_latest=False``).

**A tag saved again** (``save_checkpoint(dir, tag="last")`` each time) is never overwritten in
place while ``latest`` may name it: when its directory exists at the save's start, the new files
go to a staging directory beside it (in a fastpersist temporary directory, ``flock``-held), which the
commit, once every rank's files are durable and the ranks agreed, exchanges with the tag's
directory atomically (``renameat2``); the old files are removed in the background. A kill or a
full disk before leaves the old files whole; a dead staging directory is removed by the next save
(and ``fastpersist clean``). Its maker swaps it in: rank 0, and one rank of each node that
cannot see rank 0's (node-local storage). :mod:`.deepspeed_staging` holds that part.

**Decoupled mode.** ``save`` returns once the file's write has started; the tag is committed at
DeepSpeed's commit point (``engine.step()``, before the optimizer changes the weights), when the
next save begins, before any ``load_checkpoint`` (of any installed engine) and in
``engine.destroy()``. A tensor modified in place before its bytes were staged fails the save
(docs/overlap.md). At exit, saves still running are waited for, but a tag never committed is not
named by ``latest`` (that needs every rank): call ``engine.destroy()`` before the end.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import inspect
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("fastpersist.integrations.deepspeed needs DeepSpeed: pip install deepspeed") from e

from ..config import Config
from ..distributed.control import ControlGroup, agree, collective, control_for, failures_in, outcome
from ..errors import GroupSaveError
from ..format.layout import write_small_file
from ..futures import SaveFuture, SaveResult
from ..interop.torchasync import torch_save_async
from ..interop.torchfile import torch_save
from ..saving.target import make_parents
from .deepspeed_staging import TagStaging, open_staging

__all__ = ["LATEST_NAME", "FastPersistCheckpointEngine", "install"]

log = logging.getLogger("fastpersist")

#: DeepSpeed's tag file: the name of the newest tag, read by ``load_checkpoint(tag=None)`` and ``zero_to_fp32.py``.
LATEST_NAME = "latest"


@dataclasses.dataclass
class OpenTag:
    """A tag being saved: where, whether ``latest`` is to name it, whether ``save_checkpoint``
    handed over all its files (it returned), and its staging directory if it is re-saved."""

    tag: str
    save_dir: str
    save_latest: bool
    saved: bool = False
    staging: TagStaging | None = None
    #: Files this rank wrote into the staging directory.
    staged_files: int = 0


#: The engines with a tag open, in the order opened: a ``load_checkpoint`` commits them first. Held
#: strongly: a garbage collector running on one rank only must not make the ranks disagree.
_open_tags: list[FastPersistCheckpointEngine] = []


class FastPersistCheckpointEngine(CheckpointEngine):  # type: ignore[misc]  # (DeepSpeed ships no types)
    """DeepSpeed's ``CheckpointEngine`` interface over :func:`fastpersist.torch_save` and
    :func:`fastpersist.torch_save_async`; see the module docstring. Made by :func:`install`,
    whose wrapper of ``save_checkpoint`` also tells it when a tag's files are all handed over
    (:meth:`mark_saved`): a decoupled tag is committed only then. When the ranks stop
    answering at a commit (a rank killed, ``timeout_s`` passed), its group is closed and later
    commits raise :class:`~fastpersist.GroupSaveError` too: restart from the tag ``latest`` names.

    `config`: the knobs for every file; `decoupled`: save in the background, commit at DeepSpeed's
    commit point; `control`: the private gloo group (:func:`~fastpersist.distributed.control.control_for`).
    """

    def __init__(self, config: Config, *, decoupled: bool, control: ControlGroup) -> None:
        super().__init__(None)
        self.name = "FastPersistCheckpointEngine"
        self.config = config
        self.decoupled = decoupled
        self.control = control
        #: What :func:`install`'s wrapper of ``save_checkpoint`` was asked for ``latest``.
        self.latest_wanted: bool | None = None
        self._open: OpenTag | None = None
        self._futures: list[SaveFuture] = []
        self._errors: list[BaseException] = []

    # -- DeepSpeed's interface ------------------------------------------------------------------

    def create(self, info: CheckpointCommitInfo) -> None:
        """A tag's saves begin (on every rank). An open tag of the decoupled mode is committed
        first (or dropped, if its ``save_checkpoint`` never returned); a tag whose directory
        exists gets a staging directory (:func:`open_staging`)."""
        if self._settled_open():
            self._commit_open()
        wanted, self.latest_wanted = self.latest_wanted, None
        save_dir, tag = os.fspath(info.save_dir), str(info.tag)
        staging = open_staging(self.control, save_dir, tag)
        if staging is not None and staging.error is not None:
            self._errors.append(staging.error)
        self._open = OpenTag(tag, save_dir, bool(info.save_latest if wanted is None else wanted), staging=staging)
        _open_tags.append(self)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """``os.makedirs`` (into a re-saved tag's staging directory), each new directory made durable."""
        path = self._staged(path)
        if os.path.isdir(path) and not exist_ok:
            raise FileExistsError(f"{path} exists (DeepSpeed asked for a new directory: exist_ok=False)")
        make_parents(os.path.join(path, "-"), durable=self.config.durable)  # makes `path`, the parent of "-"

    def save(self, state_dict: object, path: str) -> None:
        """Writes `state_dict` to `path` (a re-saved tag's: in its staging directory) as ``torch.save``
        would (decoupled: starts the write). A failure is raised by the tag's :meth:`commit`, on
        every rank, so that no rank is left waiting in a collective for one that gave up."""
        staged = self._staged(path)
        if staged != path and self._open is not None:  # (staged only while a tag is open)
            self._open.staged_files += 1
        try:
            if self.decoupled:
                self._futures.append(torch_save_async(state_dict, staged, config=self.config))
            else:
                torch_save(state_dict, staged, config=self.config)
        except Exception as e:
            log.error("saving %s failed; the tag's commit raises it: %s", staged, e)
            self._errors.append(e)

    def load(self, path: str, map_location: Any = None) -> Any:
        """``torch.load(path)``, as DeepSpeed's own engines load (its files hold Python objects:
        ``weights_only=False``; load only checkpoints you trust)."""
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Makes the open tag durable on every rank (a re-saved one replaces its old files),
        then has rank 0 name it in ``latest``.

        Raises:
            GroupSaveError: a rank failed to save its files of the tag, or stopped answering;
                ``latest`` still names the previous tag, and a re-saved tag keeps its old files.
            OSError and the other errors of this rank's saves.
        """
        if self._open is None:  # a commit without create (DeepSpeed always creates first)
            self._open = OpenTag(str(info.tag), os.fspath(info.save_dir), bool(info.save_latest))
            _open_tags.append(self)
        self._commit_open()
        return True

    def is_decoupled(self) -> bool:
        return self.decoupled

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        """The tag to commit at DeepSpeed's commit point, as DeepSpeed's ``step()`` asks for it.
        Its ``save_latest`` is False: :meth:`commit` writes ``latest`` itself, after every rank."""
        if not self._settled_open():
            return None
        assert self._open is not None
        return CheckpointCommitInfo(tag=self._open.tag, save_dir=self._open.save_dir, save_latest=False)

    def cleanup(self) -> None:
        """``engine.destroy()``, and before a ``load_checkpoint``: commits an open tag (every rank calls it)."""
        if self._settled_open():
            self._commit_open()

    def mark_saved(self) -> None:
        """DeepSpeed's ``save_checkpoint`` returned: the open tag has all its files (:func:`install`'s wrapper)."""
        if self._open is not None:
            self._open.saved = True

    def _staged(self, path: str) -> str:
        staging = self._open.staging if self._open is not None else None
        return path if staging is None else staging.redirect(path)

    def _close_open(self) -> tuple[OpenTag, list[SaveFuture], list[BaseException]]:
        tag, futures, errors = self._open, self._futures, self._errors
        assert tag is not None
        self._open, self._futures, self._errors = None, [], []
        with contextlib.suppress(ValueError):
            _open_tags.remove(self)
        return tag, futures, errors

    def _settled_open(self) -> bool:
        """Whether a tag is open and complete. One whose ``save_checkpoint`` raised before it
        returned is dropped here (its saves cancelled or waited for, its staging directory
        removed): ``latest`` never names it, and a re-saved tag keeps its old files."""
        if self._open is None or self._open.saved:
            return self._open is not None
        tag, futures, _ = self._close_open()
        for fut in futures:
            fut.cancel()
        with contextlib.suppress(Exception):
            wait_all(futures)
        if tag.staging is not None:
            tag.staging.discard()
        msg = "DeepSpeed tag %r was not committed: its save_checkpoint did not return; %s still names the previous tag"
        log.warning(msg, tag.tag, os.path.join(tag.save_dir, LATEST_NAME))
        return False

    # -- the commit ---------------------------------------------------------------------------

    def _commit_open(self) -> None:
        tag, futures, errors = self._close_open()
        error = errors[0] if errors else None
        try:
            wait_all(futures)
        except Exception as e:
            error = error or e
        control = self.control
        what = f"agree that every rank's files of tag {tag.tag!r} are durable"
        mine = (outcome(error), tag.staged_files)
        consequence = f"; {LATEST_NAME!r} in {tag.save_dir} still names the previous tag"
        outcomes = collective(control, what, lambda: control.all_gather(mine), GroupSaveError, consequence)
        failed = failures_in([why for why, _ in outcomes])
        if tag.staging is not None:
            if failed or not any(staged for _, staged in outcomes):  # (nothing staged: save_16bit_model's tag)
                tag.staging.discard()
            else:
                self._swap_in(tag, tag.staging)
        if not failed and tag.save_latest:
            self._name_latest(tag)
        if error is not None:
            raise error
        if failed:
            rank, why = failed[0]
            raise GroupSaveError(
                f"rank {control.rank}: rank {rank} failed to save its files of tag {tag.tag!r} ({why}); "
                f"{LATEST_NAME!r} in {tag.save_dir} still names the previous tag"
            )

    def _name_latest(self, tag: OpenTag) -> None:
        """Rank 0 names `tag` in ``latest``; every rank returns once it did (a load right after
        reads it on every rank, not only on rank 0), or raises if it could not."""
        error: OSError | None = None
        if self.control.rank == 0:
            try:
                write_small_file(os.path.join(tag.save_dir, LATEST_NAME), tag.tag.encode(), durable=self.config.durable)
            except OSError as e:
                error = e
        agree(self.control, f"name tag {tag.tag!r} in {LATEST_NAME!r}", error, f"; in {tag.save_dir}")

    def _swap_in(self, tag: OpenTag, staging: TagStaging) -> None:
        """Puts a re-saved tag's staging directory in place of its old files, on each view's
        swapper; raises on every rank if one failed (its view keeps the old files)."""
        error: OSError | None = None
        try:
            staging.swap_in(durable=self.config.durable)
        except OSError as e:
            error = e  # (the staging directory is gone with it)
        what = f"put tag {tag.tag!r}'s new files in place"
        agree(self.control, what, error, f"; its view of {staging.tag_dir} keeps the old ones")

    def wait_outstanding(self) -> None:
        """Waits for the saves still running (at interpreter exit): their files become durable,
        but ``latest`` moves only at a commit, which needs every rank."""
        futures, self._futures = self._futures, []
        try:
            wait_all(futures)
        except Exception as e:
            log.error("a DeepSpeed checkpoint file failed to save at exit: %s", e)
        if self._open is not None and self._open.save_latest:
            msg = "DeepSpeed tag %r was never committed (no engine.step() or destroy() after its save): %s is unchanged"
            log.warning(msg, self._open.tag, os.path.join(self._open.save_dir, LATEST_NAME))


def wait_all(futures: Iterable[SaveFuture]) -> list[SaveResult]:
    """Waits for every future, even after one failed; returns their results or raises the first error."""
    results: list[SaveResult] = []
    first: BaseException | None = None
    for fut in futures:
        try:
            results.append(fut.wait())
        except Exception as e:
            first = first or e
    if first is not None:
        raise first
    return results


def commit_open_tags() -> None:
    """Commits every installed engine's open tag (on every rank, as before a ``load_checkpoint``)."""
    for engine in list(_open_tags):
        engine.cleanup()


def _latest_by_us(original: Callable[..., Any], ours: FastPersistCheckpointEngine) -> Callable[..., Any]:
    """`original` (an engine's ``save_checkpoint``) called with ``save_latest=False``, the
    caller's choice handed to `ours`, whose commit writes ``latest`` once every rank is durable."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        ours.latest_wanted = bool(bound.arguments["save_latest"])
        bound.arguments["save_latest"] = False
        result = original(*bound.args, **bound.kwargs)
        ours.mark_saved()
        return result

    return save_checkpoint


def _committed_first(original: Callable[..., Any]) -> Callable[..., Any]:
    """`original` (an engine's ``load_checkpoint``) after the open tags are committed: a
    checkpoint read right after its decoupled save has its files and ``latest``."""

    @functools.wraps(original)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        commit_open_tags()
        return original(*args, **kwargs)

    return load_checkpoint


def install(engine: Any, *, decoupled: bool = False, config: Config | None = None) -> FastPersistCheckpointEngine:
    """Makes `engine` (an initialized ``deepspeed.DeepSpeedEngine``) save and load its
    checkpoints through fastpersist; call it on every rank, after ``deepspeed.initialize``.

    `decoupled`: ``save_checkpoint`` returns once the writes have started; the tag is made
    durable, and ``latest`` moved, at DeepSpeed's commit point (``engine.step()``), or before a
    ``load_checkpoint``. `config`: fastpersist's knobs (``Config.timeout_s`` bounds the ranks'
    agreement at a commit).

    Replaces ``engine.checkpoint_engine`` (a decoupled engine it held is committed and shut down
    first), wraps ``engine.save_checkpoint`` so that DeepSpeed leaves ``latest`` to this engine,
    and ``engine.load_checkpoint`` so that open tags are committed first. At interpreter exit,
    saves still running are waited for. Returns the engine installed (the module docstring has an example).
    """
    config = config or Config()
    if not hasattr(engine, "save_checkpoint") or not hasattr(engine, "checkpoint_engine"):
        raise TypeError(
            f"install(engine={engine!r}): expected a DeepSpeed engine (deepspeed.initialize's first result)"
        )
    previous = engine.checkpoint_engine
    if isinstance(previous, FastPersistCheckpointEngine):
        raise ValueError("install(engine): fastpersist's checkpoint engine is installed on it already")
    if previous is not None and previous.is_decoupled():
        previous.cleanup()  # its commit, then its background process stopped
    # Every rank calls install, so the control group (a collective to make) is made here, in step.
    ours = FastPersistCheckpointEngine(
        config, decoupled=decoupled, control=control_for(None, config.timeout_s, lane="deepspeed")
    )
    engine.checkpoint_engine = ours
    engine.save_checkpoint = _latest_by_us(engine.save_checkpoint, ours)
    engine.load_checkpoint = _committed_first(engine.load_checkpoint)
    atexit.register(ours.wait_outstanding)
    return ours
