"""PyTorch Lightning ``CheckpointIO`` plug-ins: the Trainer's checkpoints written by fastpersist.

Install with ``pip install 'fastpersist[lightning]'`` and pass a plug-in to the Trainer:

    >>> from fastpersist.integrations.lightning import FastPersistAsyncCheckpointIO
    >>> trainer = L.Trainer(plugins=[FastPersistAsyncCheckpointIO()])     # doctest: +SKIP
    >>> trainer.fit(model, ckpt_path="last")                             # doctest: +SKIP

:class:`FastPersistCheckpointIO` blocks training for the whole save (durable on return);
:class:`FastPersistAsyncCheckpointIO` returns once the state is staged and writes it while
training goes on (overlapped saves, docs/overlap.md). Both write the same checkpoints, and each
loads what the other wrote.

Each ``.ckpt`` path becomes a fastpersist checkpoint directory (aligned O_DIRECT writes,
checksums, atomic replace). Lightning checkpoints hold a few values our format does not know
(``AttributeDict`` hyper-parameters and other dict subclasses): they are stored as plain
dicts. Anything else unsupported (an arbitrary object in ``hyper_parameters``) is stored as
its ``repr`` string with a warning, unless ``strict=True``, which raises instead.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

try:
    from lightning.pytorch.plugins.io import CheckpointIO
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fastpersist.integrations.lightning needs PyTorch Lightning: pip install 'fastpersist[lightning]'"
    ) from e

from ..api import load, save, save_async
from ..config import Config
from ..errors import SaveCancelledError
from ..format.layout import MANIFEST_NAME
from ..format.quote import shown
from ..futures import SaveFuture
from ..saving.remover import remove_checkpoint_later, wait_removed

__all__ = ["FastPersistAsyncCheckpointIO", "FastPersistCheckpointIO"]

log = logging.getLogger("fastpersist")

_PLAIN = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.Size, torch.device)


class FastPersistCheckpointIO(CheckpointIO):
    """Saves and loads Lightning checkpoints with :func:`fastpersist.save` / :func:`fastpersist.load`.

    Args:
        config: engine knobs for every save and load.
        strict: raise on values the format cannot hold instead of storing their ``repr``.
    """

    def __init__(self, config: Config | None = None, strict: bool = False) -> None:
        super().__init__()
        self.config = config or Config()
        self.strict = strict

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Writes `checkpoint` as a fastpersist checkpoint directory at `path` (durable on return)."""
        target = _target(self, path, storage_options)
        save(_storable(checkpoint, "checkpoint", self.strict), target, config=self.config)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        """Reads the checkpoint at `path`; `map_location` as in ``torch.load`` (never unpickles)."""
        return load(os.fspath(path), map_location, weights_only=weights_only, config=self.config)

    def remove_checkpoint(self, path: Any) -> None:
        """Removes the checkpoint directory at `path` (only if it is one of ours) and its stripe
        directories: it is out of sight at once, its bytes are deleted in the background."""
        _remove(os.fspath(path), self.config)

    def teardown(self) -> None:
        """At the end of fit: the background removals of replaced and pruned checkpoints finish."""
        wait_removed()


@dataclass(eq=False)
class _Save:
    """One overlapped save and what its outcome decides (fields under the plug-in's lock)."""

    path: str
    future: SaveFuture
    settled: threading.Event = field(default_factory=threading.Event)  # its commit thread's step ran
    error: BaseException | None = None  # the save's failure, or that of a removal it released
    raised: bool = False  # the error was raised to a caller (it is raised once)
    cancelled_here: bool = False  # remove_checkpoint cancelled it: its SaveCancelledError is ours


class FastPersistAsyncCheckpointIO(CheckpointIO):
    """Overlapped saves: ``save_checkpoint`` returns once the state is staged, the write goes on
    in the background (:func:`fastpersist.save_async`), and the next call waits for it.

    What the Trainer (and :class:`~lightning.pytorch.callbacks.ModelCheckpoint`) may rely on:

    * ``save_checkpoint`` first waits until the previous save is durable (one save in flight: a
      loop that checkpoints faster than the disk writes runs at the disk's pace), then returns
      once every tensor of the new checkpoint is staged (``SaveFuture.wait_staged``), so the
      optimizer may change them. The path appears, whole, when the save commits; until then an
      existing checkpoint at the path stays as it was.
    * A background save's failure is raised by the next call of this plug-in
      (``save_checkpoint``, ``load_checkpoint``, :meth:`wait`, ``teardown``; ``remove_checkpoint``
      once the failure is known), once; it is also logged when it happens.
    * ``remove_checkpoint(p)`` while a save of another path is in flight removes nothing yet: the
      removal runs once a save in flight then (or started later) commits. Top-k rotation asks
      for the worst checkpoint's removal right after saving its successor, so no checkpoint is
      deleted before its successor is durable; if the successor fails, the old one stays on disk
      (teardown logs what was kept). A new save of `p` drops its pending removal.
    * ``remove_checkpoint(p)`` of the path being saved cancels that save and removes what was at
      `p` before.
    * ``teardown`` (the end of ``fit``) waits for the save in flight and for the removals.

    ``last.ckpt``, saved again at every checkpoint, is replaced atomically by each save: the
    previous one stays until the new one is durable. Use ``ModelCheckpoint(save_last=True)``,
    not ``"link"``: the link would name a checkpoint still being written.

    With the default ``Config`` a checkpoint larger than ``pool_bytes`` (256 MiB) is staged as
    the disk takes it, so ``save_checkpoint`` returns once all but the last 256 MiB are written;
    give ``Config(pool_bytes=...)`` at least the checkpoint's size to overlap the whole write.

    Args:
        config: engine knobs for every save and load.
        strict: raise on values the format cannot hold instead of storing their ``repr``.

    Example:
        >>> io = FastPersistAsyncCheckpointIO()
        >>> io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 0}, "/tmp/fp-doc-a.ckpt")
        >>> io.wait()          # durable now (the next save_checkpoint or teardown waits too)
        >>> io.load_checkpoint("/tmp/fp-doc-a.ckpt")["epoch"]
        0
    """

    def __init__(self, config: Config | None = None, strict: bool = False) -> None:
        super().__init__()
        self.config = config or Config()
        self.strict = strict
        self._lock = threading.Lock()
        self._save: _Save | None = None  # the newest save whose outcome no caller collected yet
        self._removals: list[str] = []  # removals waiting for a save to commit

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Waits for the previous save, then starts writing `checkpoint` at `path` and returns once
        it is staged (durable later: at the next call, :meth:`wait` or ``teardown``)."""
        target = _target(self, path, storage_options)
        state = _storable(checkpoint, "checkpoint", self.strict)
        self.wait()
        with self._lock:
            self._removals = [p for p in self._removals if p != target]  # this save replaces it
        future = save_async(state, target, config=self.config)
        started = self._save = _Save(target, future)
        future.add_done_callback(lambda _: self._settle(started))
        try:
            future.wait_staged()
        except BaseException:
            started.raised = True  # this call raises it; wait() will not again
            raise

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        """Reads the checkpoint at `path` once the save of `path` in flight, if any, committed;
        `map_location` as in ``torch.load`` (never unpickles)."""
        target = _absolute(path)
        save = self._save
        if save is not None and save.path == target:
            self.wait()
        else:
            self._raise_if_failed(block=False)
        return load(target, map_location, weights_only=weights_only, config=self.config)

    def remove_checkpoint(self, path: Any) -> None:
        """Removes the checkpoint at `path` once a save in flight now (or started later) has
        committed; cancels the save in flight if it is the save of `path`."""
        target = _absolute(path)
        self._raise_if_failed(block=False)
        with self._lock:
            save = self._save
            in_flight = save is not None and not save.settled.is_set()
            if save is not None and in_flight:
                if save.path != target:
                    self._removals.append(target)
                    return
                save.cancelled_here = True
        if save is not None and in_flight:
            save.future.cancel()  # False: it committed or failed meanwhile; either way it is over
            self.wait()
        _remove(target, self.config)

    def wait(self) -> None:
        """Blocks until the save in flight (if any) is durable, and its released removals are
        done; raises its failure if no call raised it yet.

        Example:
            >>> io.save_checkpoint(checkpoint, "ckpt/last.ckpt"); io.wait()   # doctest: +SKIP
        """
        self._raise_if_failed(block=True)

    def teardown(self) -> None:
        """At the end of fit: waits for the save in flight and for the background removals."""
        try:
            self.wait()
        finally:
            with self._lock:
                kept, self._removals = self._removals, []
            if kept:
                log.warning(
                    "kept %s: their removal waited for a newer checkpoint to be durable, and none was",
                    ", ".join(shown(p) for p in kept),
                )
            wait_removed()

    def _settle(self, save: _Save) -> None:
        """The save's commit thread, once it finished: a committed save releases the removals."""
        try:
            error = save.future.exception()
            with self._lock:
                released, self._removals = (self._removals, []) if error is None else ([], self._removals)
            if error is not None and not (save.cancelled_here and isinstance(error, SaveCancelledError)):
                save.error = error
                log.warning("the overlapped save of %s failed: %s", shown(save.path), error)
            for path in released:
                _remove(path, self.config)
        except BaseException as e:
            save.error = save.error or e
        finally:
            save.settled.set()

    def _raise_if_failed(self, *, block: bool) -> None:
        """Collects the newest save's outcome (waiting for it if `block`) and raises its failure once."""
        save = self._save
        if save is None or not (block or save.settled.is_set()):
            return
        save.settled.wait()
        self._save = None
        if save.error is not None and not save.raised:
            save.raised = True
            raise save.error


def _target(io: CheckpointIO, path: Any, storage_options: Any | None) -> str:
    if storage_options is not None:
        raise TypeError(f"{type(io).__name__} takes no storage_options (got {storage_options!r})")
    target = _absolute(path)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    return target


def _absolute(path: str | os.PathLike[str]) -> str:
    """`path` as the plug-in keeps it: absolute, so that two spellings of one path are one."""
    return os.path.abspath(path)


def _remove(target: str, config: Config) -> None:
    """Removes the checkpoint directory at `target` (only if it is one of ours), or a plain file."""
    if os.path.isdir(target) and os.path.exists(os.path.join(target, MANIFEST_NAME)):
        remove_checkpoint_later(target, config.stripes)
    elif os.path.isfile(target):
        os.remove(target)


def _storable(x: Any, where: str, strict: bool) -> Any:
    """`x` with dict subclasses as dicts and unknown objects handled per `strict`."""
    cls = type(x)
    if cls is dict or cls is OrderedDict or isinstance(x, dict):
        out = {k: _storable(v, f"{where}[{k!r}]", strict) for k, v in x.items()}
        return OrderedDict(out) if isinstance(x, OrderedDict) else out
    if cls is list or cls is tuple:
        return cls(_storable(v, f"{where}[{i}]", strict) for i, v in enumerate(x))
    if isinstance(x, (torch.Tensor, np.ndarray, np.generic, *_PLAIN)) or (
        isinstance(x, tuple) and hasattr(x, "_fields")
    ):
        return x
    if strict:
        raise TypeError(f"{shown(where)}: {type(x).__name__} cannot be stored by fastpersist (strict=True)")
    log.warning("%s: storing %s as its repr string (fastpersist stores data only)", shown(where), type(x).__name__)
    return repr(x)
