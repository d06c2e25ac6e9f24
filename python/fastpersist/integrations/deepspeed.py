"""DeepSpeed's checkpoints written by fastpersist: a ``CheckpointEngine``, blocking or decoupled.

Install it on an initialized engine, on every rank, with one call:

    >>> import fastpersist as fp
    >>> from fastpersist.integrations import deepspeed as fp_deepspeed
    >>> engine, optimizer, _, _ = deepspeed.initialize(model=model, config=ds_config)   # doctest: +SKIP
    >>> fp_deepspeed.install(engine, decoupled=True, config=fp.Config())                # doctest: +SKIP
    >>> engine.save_checkpoint("ckpt")     # returns once the files are being written   # doctest: +SKIP

``engine.save_checkpoint`` and ``engine.load_checkpoint`` are used as before. Each of
DeepSpeed's files (``mp_rank_00_model_states.pt``, ``zero_pp_rank_*_optim_states.pt``, ...)
is written by :func:`fastpersist.torch_save` (blocking) or :func:`fastpersist.torch_save_async`
(decoupled): large aligned O_DIRECT writes from the tensors' memory, fsynced, renamed into
place, so a file is whole or absent, never torn.

**Why the files stay in torch.save's format.** A DeepSpeed checkpoint is read by more than the
engine that wrote it: ``load_checkpoint`` (through the engine's ``load``, and in places by
``torch.load`` directly), ``zero_to_fp32.py`` (copied into every checkpoint and run where no
DeepSpeed engine exists), the universal-checkpoint converters, and users' own ``torch.load``
calls. A fastpersist checkpoint directory per file would be faster to load but readable by none
of them. ``fp.torch_save`` writes the zip archive ``torch.save`` writes, byte for byte, with its
CRC-32s, at the engine's speed, so every one of those readers keeps working; what is given up
is fastpersist's per-chunk crc32c and its O_DIRECT loads (a file's zip CRC-32s still cover it).

**When ``latest`` moves.** DeepSpeed's own ``save_checkpoint`` has rank 0 write ``latest`` right
after rank 0's own commit, without waiting for the other ranks, with a plain truncating
``open(..., "w")``; the decoupled engine writes it after only rank 0's background process is
done. Here ``latest`` is written by this engine's :meth:`~FastPersistCheckpointEngine.commit`
alone: each rank waits until its files of the tag are durable, the ranks agree over a private
gloo group (a killed rank is noticed at once), and only if every rank succeeded does rank 0
replace ``latest`` atomically and durably. :func:`install` has DeepSpeed pass
``save_latest=False`` to its own code, so that it never rewrites the file itself. A process
killed at any point leaves ``latest`` naming the previous tag, whose files are all durable.

**Decoupled mode.** ``save`` returns once the file's write has started; DeepSpeed calls
``commit`` at its commit point, in ``engine.step()`` before the optimizer changes the weights
(the forward and backward passes in between overlap the writes), and this engine also commits
an open tag when the next save begins and in ``engine.destroy()``. A tensor modified in place
before its bytes were staged fails the save rather than tearing it (docs/overlap.md); small
tensors (BatchNorm statistics) are copied at the call. At interpreter exit, the saves still
running are waited for, but a tag whose ``commit`` never ran is not named by ``latest`` (that
needs every rank): call ``engine.destroy()`` (or ``engine.step()``) before the end.
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
from ..distributed.control import ControlGroup, collective, control_for, describe
from ..errors import GroupSaveError
from ..format.layout import write_small_file
from ..futures import SaveFuture, SaveResult
from ..interop.torchasync import torch_save_async
from ..interop.torchfile import torch_save
from ..saving.target import make_parents

__all__ = ["LATEST_NAME", "FastPersistCheckpointEngine", "install"]

log = logging.getLogger("fastpersist")

#: DeepSpeed's tag file: the name of the newest tag, read by ``load_checkpoint(tag=None)`` and ``zero_to_fp32.py``.
LATEST_NAME = "latest"


@dataclasses.dataclass
class OpenTag:
    """A tag whose files are being saved: where, whether ``latest`` is to name it, and whether
    DeepSpeed's ``save_checkpoint`` handed over all of them (it returned: the tag may be
    committed later, at DeepSpeed's commit point)."""

    tag: str
    save_dir: str
    save_latest: bool
    saved: bool = False


class FastPersistCheckpointEngine(CheckpointEngine):  # type: ignore[misc]  # (DeepSpeed ships no types)
    """DeepSpeed's ``CheckpointEngine`` interface over :func:`fastpersist.torch_save` and
    :func:`fastpersist.torch_save_async`; see the module docstring. Made by :func:`install`,
    whose wrapper of ``save_checkpoint`` also tells it when a tag's files are all handed over
    (:meth:`mark_saved`): a decoupled tag is committed only then. When the ranks stop
    answering at a commit (a rank killed, ``timeout_s`` passed), its group is closed and later
    commits raise :class:`~fastpersist.GroupSaveError` too: restart from the tag ``latest`` names.

    Args:
        config: the engine's knobs for every file.
        decoupled: save in the background and make the tag durable at DeepSpeed's commit point.
        control: the private gloo group over every rank in which the ranks agree at a commit
            (:func:`fastpersist.distributed.control.control_for`).
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
        first (or dropped, if its ``save_checkpoint`` never returned)."""
        if self._settled_open():
            self._commit_open()
        wanted, self.latest_wanted = self.latest_wanted, None
        self._open = OpenTag(
            str(info.tag), os.fspath(info.save_dir), bool(info.save_latest if wanted is None else wanted)
        )

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """``os.makedirs``, each new directory made durable in its parent."""
        if os.path.isdir(path) and not exist_ok:
            raise FileExistsError(f"{path} exists (DeepSpeed asked for a new directory: exist_ok=False)")
        make_parents(os.path.join(path, "-"), durable=self.config.durable)  # makes `path`, the parent of "-"

    def save(self, state_dict: object, path: str) -> None:
        """Writes `state_dict` to `path` as ``torch.save`` would (decoupled: starts the write).
        A failure is raised by the tag's :meth:`commit`, on every rank, so that no rank is left
        waiting in a collective for one that gave up."""
        try:
            if self.decoupled:
                self._futures.append(torch_save_async(state_dict, path, config=self.config))
            else:
                torch_save(state_dict, path, config=self.config)
        except Exception as e:
            log.error("saving %s failed; the tag's commit raises it: %s", path, e)
            self._errors.append(e)

    def load(self, path: str, map_location: Any = None) -> Any:
        """``torch.load(path)``, as DeepSpeed's own engines load (its files hold Python objects:
        ``weights_only=False``; load only checkpoints you trust)."""
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Makes the open tag durable on every rank, then has rank 0 name it in ``latest``.

        Raises:
            GroupSaveError: a rank failed to save its files of the tag, or stopped answering;
                ``latest`` still names the previous tag.
            OSError and the other errors of this rank's saves.
        """
        if self._open is None:  # a commit without create (DeepSpeed always creates first)
            self._open = OpenTag(str(info.tag), os.fspath(info.save_dir), bool(info.save_latest))
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
        """``engine.destroy()``: commits an open tag (every rank calls it)."""
        if self._settled_open():
            self._commit_open()

    def mark_saved(self) -> None:
        """DeepSpeed's ``save_checkpoint`` returned: the open tag has all its files (:func:`install`'s wrapper)."""
        if self._open is not None:
            self._open.saved = True

    def _settled_open(self) -> bool:
        """Whether a tag is open and complete. One whose ``save_checkpoint`` raised before it
        returned is dropped here (its saves cancelled or waited for): ``latest`` never names it."""
        tag = self._open
        if tag is None or tag.saved:
            return tag is not None
        self._open = None
        futures, self._futures, self._errors = self._futures, [], []
        for fut in futures:
            fut.cancel()
        with contextlib.suppress(Exception):
            wait_all(futures)
        log.warning(
            "DeepSpeed tag %r was not committed: its save_checkpoint did not return; %r in %s still names the "
            "previous tag",
            tag.tag,
            LATEST_NAME,
            tag.save_dir,
        )
        return False

    # -- the commit ---------------------------------------------------------------------------

    def _commit_open(self) -> None:
        tag, self._open = self._open, None
        assert tag is not None
        futures, errors = self._futures, self._errors
        self._futures, self._errors = [], []
        error = errors[0] if errors else None
        try:
            wait_all(futures)
        except Exception as e:
            error = error or e
        control = self.control
        outcomes = collective(
            control,
            f"agree that every rank's files of tag {tag.tag!r} are durable",
            lambda: control.all_gather(None if error is None else describe(error)),
            GroupSaveError,
            f"; {LATEST_NAME!r} in {tag.save_dir} still names the previous tag",
        )
        failed = {rank: why for rank, why in enumerate(outcomes) if why is not None}
        if not failed and tag.save_latest and control.rank == 0:
            write_small_file(os.path.join(tag.save_dir, LATEST_NAME), tag.tag.encode(), durable=self.config.durable)
        if error is not None:
            raise error
        if failed:
            rank, why = next(iter(failed.items()))
            raise GroupSaveError(
                f"rank {control.rank}: rank {rank} failed to save its files of tag {tag.tag!r} ({why}); "
                f"{LATEST_NAME!r} in {tag.save_dir} still names the previous tag"
            )

    def wait_outstanding(self) -> None:
        """Waits for the saves still running (at interpreter exit): their files become durable,
        but ``latest`` moves only at a commit, which needs every rank."""
        futures, self._futures = self._futures, []
        try:
            wait_all(futures)
        except Exception as e:
            log.error("a DeepSpeed checkpoint file failed to save at exit: %s", e)
        if self._open is not None and self._open.save_latest:
            log.warning(
                "DeepSpeed tag %r was never committed (no engine.step() or engine.destroy() after its save): its "
                "files are written, but %r in %s still names the previous tag",
                self._open.tag,
                LATEST_NAME,
                self._open.save_dir,
            )


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


def install(engine: Any, *, decoupled: bool = False, config: Config | None = None) -> FastPersistCheckpointEngine:
    """Makes `engine` (an initialized ``deepspeed.DeepSpeedEngine``) save and load its
    checkpoints through fastpersist; call it on every rank, after ``deepspeed.initialize``.

    `decoupled`: ``save_checkpoint`` returns once the writes have started; the tag is made
    durable, and ``latest`` moved, at DeepSpeed's commit point (``engine.step()``). `config`:
    fastpersist's knobs (``Config.timeout_s`` bounds the ranks' agreement at a commit).

    Replaces ``engine.checkpoint_engine`` (a decoupled engine it held is committed and shut down
    first) and wraps ``engine.save_checkpoint`` so that DeepSpeed leaves ``latest`` to this
    engine. At interpreter exit, saves still running are waited for. Returns the engine installed.

    Example:
        >>> ours = install(engine, decoupled=True)      # doctest: +SKIP
        >>> engine.save_checkpoint("ckpt")               # doctest: +SKIP
        >>> engine.step()                                 # doctest: +SKIP
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
    atexit.register(ours.wait_outstanding)
    return ours
