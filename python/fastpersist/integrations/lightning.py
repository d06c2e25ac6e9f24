"""PyTorch Lightning ``CheckpointIO`` plug-ins: the Trainer's checkpoints written by fastpersist.

Install with ``pip install 'fastpersist[lightning]'`` and pass a plug-in to the Trainer:

    >>> from fastpersist.integrations.lightning import FastPersistAsyncCheckpointIO
    >>> trainer = L.Trainer(plugins=[FastPersistAsyncCheckpointIO()])     # doctest: +SKIP
    >>> trainer.fit(model, ckpt_path="last")                             # doctest: +SKIP

:class:`FastPersistCheckpointIO` blocks training for the whole save (durable on return);
:class:`FastPersistAsyncCheckpointIO` returns once the state is staged and writes it while
training goes on (overlapped saves, docs/overlap.md).

**The host's format.** Each ``.ckpt`` is the file Lightning's own ``TorchCheckpointIO`` writes:
a ``torch.save`` zip archive (whatever ``torch.save`` pickles is saved, hyper-parameters of any
type included), written by :func:`fastpersist.torch_save` / :func:`fastpersist.torch_save_async`
(large aligned writes, fsynced, renamed into place: whole or absent). So ``torch.load``,
Lightning's ``pl_load``, ``LightningModule.load_from_checkpoint`` and ``os.path.isfile`` see an
ordinary checkpoint, and both plug-ins load a stock Lightning ``.ckpt`` as ``TorchCheckpointIO``
loads it. A ``.ckpt`` directory written by earlier versions of these plug-ins (a fastpersist
checkpoint) still loads, through :func:`fastpersist.load`; none is written any more.

**A name is taken when the save starts.** ``ModelCheckpoint`` picks a ``-vN`` suffix by asking
whether the file exists, right after the previous save returned. An overlapped save of a new
path therefore first creates the path exclusively as a small placeholder file (:data:`RESERVED`,
under a ``flock`` held until the save ends), which the commit's rename replaces. A process
killed meanwhile leaves the placeholder; every save cleans its directory first, removing the
placeholders no live process holds and the temporary files of killed saves
(:func:`fastpersist.clean`), never a checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import sys
import threading
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

try:
    from lightning.fabric.utilities.cloud_io import _load as pl_load
    from lightning.fabric.utilities.cloud_io import get_filesystem
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, CheckpointIO
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fastpersist.integrations.lightning needs PyTorch Lightning: pip install 'fastpersist[lightning]'"
    ) from e

from ..api import load
from ..cleanup import clean
from ..config import Config
from ..errors import SaveCancelledError
from ..format.flocks import lock_state, locked_dir
from ..format.layout import MANIFEST_NAME, create_locked_file
from ..format.quote import shown
from ..futures import SaveFuture
from ..interop.torchasync import torch_save_async
from ..interop.torchfile import torch_save
from ..saving.remover import remove_checkpoint_later, wait_removed

__all__ = ["RESERVED", "FastPersistAsyncCheckpointIO", "FastPersistCheckpointIO"]

log = logging.getLogger("fastpersist")

#: What a placeholder holds: the name is reserved for an overlapped save not yet committed.
RESERVED = b"fastpersist: this name is reserved for a checkpoint still being written\n"


def _keep_where_saved(storage: Any, _location: str) -> Any:
    """``TorchCheckpointIO.load_checkpoint``'s default `map_location`: every storage stays as loaded."""
    return storage


class FastPersistCheckpointIO(CheckpointIO):
    """Saves with :func:`fastpersist.torch_save` (durable on return) and loads as Lightning's
    ``TorchCheckpointIO`` does (see the module docstring).

    Args:
        config: engine knobs for every save (and for loading a directory of earlier versions).
    """

    def __init__(self, config: Config | None = None) -> None:
        super().__init__()
        self.config = config or Config()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Writes `checkpoint` to `path` as ``torch.save`` would, durably and atomically."""
        target = _target(self, path, storage_options, self.config)
        torch_save(checkpoint, target, config=self.config)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = _keep_where_saved, weights_only: bool | None = None
    ) -> Any:
        """Reads `path` as ``TorchCheckpointIO`` does (``torch.load``), or a directory of earlier versions."""
        return _load(path, map_location, weights_only, self.config)

    def remove_checkpoint(self, path: Any) -> None:
        """Removes the checkpoint at `path` (a file, or a directory of earlier versions)."""
        _remove(_absolute(path), self.config)

    def teardown(self) -> None:
        """At the end of fit: the background removals of earlier versions' directories finish."""
        wait_removed()


@dataclass(eq=False)
class _Reservation:
    """A placeholder at `path`, created by this process and locked through `fd` until the save ends."""

    path: str
    fd: int


@dataclass(eq=False)
class _Save:
    """One overlapped save and what its outcome decides (fields under the plug-in's lock)."""

    path: str
    future: SaveFuture
    reservation: _Reservation | None
    settled: threading.Event = field(default_factory=threading.Event)  # its commit thread's step ran
    error: BaseException | None = None  # the save's failure, or that of a removal it released
    raised: bool = False  # the error was raised to a caller (it is raised once)
    cancelled_here: bool = False  # remove_checkpoint cancelled it: its SaveCancelledError is ours


class FastPersistAsyncCheckpointIO(CheckpointIO):
    """Overlapped saves: ``save_checkpoint`` returns once the state is staged, the write goes on
    in the background (:func:`fastpersist.torch_save_async`), and the next call waits for it.

    What the Trainer (and :class:`~lightning.pytorch.callbacks.ModelCheckpoint`) may rely on:

    * ``save_checkpoint`` first waits until the previous save is durable (one save in flight: a
      loop that checkpoints faster than the disk writes runs at the disk's pace), then returns
      once every tensor of the new checkpoint is staged (``SaveFuture.wait_staged``), so the
      optimizer may change them. The checkpoint appears, whole, when the save commits; until
      then an existing checkpoint at the path stays as it was, and a new path holds a
      placeholder (:data:`RESERVED`), so that ``ModelCheckpoint`` sees the name taken.
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
    * Run by Lightning's ``AsyncCheckpointIO`` (which runs each save on its own thread, and at
      its teardown waits for that thread but never calls this plug-in's teardown), a save
      returns once durable: the wrapper's thread is the overlap, and the end of ``fit`` waits
      for the commit.
    * It pickles (``torch.save(trainer)``, ``strategy="ddp_spawn"``): the copy starts with no
      save in flight; pickling first waits for the save in flight to end.

    ``last.ckpt``, saved again at every checkpoint, is replaced atomically by each save: the
    previous one stays until the new one is durable. Use ``ModelCheckpoint(save_last=True)``,
    not ``"link"``: the link would name a checkpoint still being written.

    With the default ``Config`` a checkpoint larger than ``pool_bytes`` (256 MiB) is staged as
    the disk takes it, so ``save_checkpoint`` returns once all but the last 256 MiB are written;
    give ``Config(pool_bytes=...)`` at least the checkpoint's size to overlap the whole write.

    Args:
        config: engine knobs for every save (and for loading a directory of earlier versions).

    Example:
        >>> io = FastPersistAsyncCheckpointIO()
        >>> io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 0}, "/tmp/fp-doc-a.ckpt")
        >>> io.wait()          # durable now (the next save_checkpoint or teardown waits too)
        >>> io.load_checkpoint("/tmp/fp-doc-a.ckpt")["epoch"]
        0
    """

    def __init__(self, config: Config | None = None) -> None:
        super().__init__()
        self.config = config or Config()
        self._start_afresh()

    def _start_afresh(self) -> None:
        self._lock = threading.Lock()
        self._save: _Save | None = None  # the newest save whose outcome no caller collected yet
        self._removals: list[str] = []  # removals waiting for a save to commit

    def __getstate__(self) -> dict[str, Any]:
        """The plug-in without its save in flight (waited for first), its lock and its removals."""
        with self._lock:
            save = self._save
        if save is not None:
            save.settled.wait()
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_save", "_removals")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start_afresh()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Waits for the previous save, then starts writing `checkpoint` at `path` and returns once
        it is staged (durable later: at the next call, :meth:`wait` or ``teardown``)."""
        self.wait()
        target = _target(self, path, storage_options, self.config)
        with self._lock:
            self._removals = [p for p in self._removals if p != target]  # this save replaces it
        reservation = _reserve(target)
        try:
            future = torch_save_async(checkpoint, target, config=self.config)
        except BaseException:
            _release(reservation, committed=False)
            raise
        started = _Save(target, future, reservation)
        with self._lock:
            self._save = started
        future.add_done_callback(lambda _: self._settle(started))
        try:
            future.wait_staged()
        except BaseException:
            started.raised = True  # this call raises it; wait() will not again
            raise
        if _run_by_lightning_async_wrapper():
            self.wait()

    def load_checkpoint(
        self, path: Any, map_location: Any | None = _keep_where_saved, weights_only: bool | None = None
    ) -> Any:
        """Reads `path` as ``TorchCheckpointIO`` does, once the save of `path` in flight, if any,
        committed (a directory of earlier versions: through :func:`fastpersist.load`)."""
        with self._lock:
            save = self._save
        if save is not None and save.path == _absolute(path):
            self.wait()
        else:
            self._raise_if_failed(block=False)
        return _load(path, map_location, weights_only, self.config)

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
            _release(save.reservation, committed=error is None)
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
        with self._lock:
            save = self._save
        if save is None or not (block or save.settled.is_set()):
            return
        save.settled.wait()
        save.future.exception()  # returns once the save's commit thread has ended, too
        with self._lock:
            if self._save is save:
                self._save = None
            if save.error is None or save.raised:
                return
            save.raised = True
        raise save.error


def _run_by_lightning_async_wrapper() -> bool:
    """Whether the save in progress was called by Lightning's ``AsyncCheckpointIO`` (on its thread).

    The wrapper's teardown waits for its thread, not for the plug-in it wraps, so a save it
    runs must be durable before it returns. Its saving function holds the wrapper as ``self``
    somewhere above the plug-in's ``save_checkpoint`` on the wrapper's worker thread, whose
    stack is short; anything between (a ``Mock(wraps=...)``, a decorator) may add frames, so
    the whole stack is searched.
    """
    frame: FrameType | None = sys._getframe(2)
    for _ in range(_STACK_SEARCHED):
        if frame is None:
            return False
        if isinstance(frame.f_locals.get("self"), AsyncCheckpointIO):
            return True
        frame = frame.f_back
    return False


#: Frames searched for the wrapper: a worker thread's whole stack, with room for wrappers.
_STACK_SEARCHED = 64


def _target(io: CheckpointIO, path: Any, storage_options: Any | None, config: Config) -> str:
    """The absolute local path to save `path` at, its directory made and cleaned of dead leftovers."""
    if storage_options is not None:
        raise TypeError(f"{type(io).__name__} takes no storage_options (got {storage_options!r})")
    if "://" in str(path):
        raise ValueError(f"{type(io).__name__} saves to local paths only (got {path!r}); use TorchCheckpointIO")
    target = _absolute(path)
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    _clean_directory(directory, config)
    return target


def _absolute(path: str | os.PathLike[str]) -> str:
    """`path` as the plug-in keeps it: absolute, so that two spellings of one path are one."""
    return os.path.abspath(path)


def _clean_directory(directory: str, config: Config) -> None:
    """Removes what killed saves left in `directory`: their temporary files and directories
    (:func:`fastpersist.clean`) and the placeholders no live process holds."""
    clean(directory, stripes=config.stripes)
    _remove_dead_placeholders(directory)


def _remove_dead_placeholders(directory: str) -> None:
    """Removes the placeholders in `directory` that no live save holds."""
    with os.scandir(directory) as entries:
        sized = [e.path for e in entries if e.is_file(follow_symlinks=False) and _placeholder_sized(e)]
    if not sized:
        return  # the usual case, without the directory's lock
    with locked_dir(directory, fcntl.LOCK_EX):
        for path in sized:
            if _holds_reservation(path) and lock_state(path) == "dead":
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                log.info("removed %s: the placeholder of a save killed before it committed", path)


def _placeholder_sized(entry: os.DirEntry[str]) -> bool:
    with contextlib.suppress(FileNotFoundError):
        return entry.stat(follow_symlinks=False).st_size == len(RESERVED)
    return False


def _holds_reservation(path: str) -> bool:
    """Whether `path` is a regular file holding exactly :data:`RESERVED` (a placeholder)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        held = os.fstat(fd)
        if not stat.S_ISREG(held.st_mode) or held.st_size != len(RESERVED):
            return False
        return os.pread(fd, len(RESERVED) + 1, 0) == RESERVED
    finally:
        os.close(fd)


def _reserve(target: str) -> _Reservation | None:
    """Creates `target` as a locked placeholder, or returns None if something is there already."""
    try:
        fd = create_locked_file(target)
    except FileExistsError:
        return None
    try:
        os.write(fd, RESERVED)  # (a cleaner looks only at files of RESERVED's size, and this one is live)
    except BaseException:
        os.close(fd)
        os.remove(target)
        raise
    return _Reservation(target, fd)


def _release(reservation: _Reservation | None, *, committed: bool) -> None:
    """Ends a reservation: a committed save renamed its checkpoint over the placeholder; a failed
    one leaves the placeholder (or what a fallback wrote into it), which is removed."""
    if reservation is None:
        return
    try:
        if not committed:
            with contextlib.suppress(FileNotFoundError):
                here, ours = os.lstat(reservation.path), os.fstat(reservation.fd)
                if (here.st_dev, here.st_ino) == (ours.st_dev, ours.st_ino):
                    os.unlink(reservation.path)
    finally:
        os.close(reservation.fd)


def _load(path: Any, map_location: Any, weights_only: bool | None, config: Config) -> Any:
    """A Lightning checkpoint at `path`: a file as ``TorchCheckpointIO`` loads it, or the
    fastpersist checkpoint directory of earlier versions of these plug-ins.

    A resume loads before ``ModelCheckpoint`` picks its first name, so the placeholders that
    killed saves left beside `path` are removed first: their names are free again, as a
    killed ``TorchCheckpointIO`` save leaves them."""
    local = "://" not in str(path)
    if local:
        with contextlib.suppress(OSError):  # a read-only directory keeps them: the load goes on
            _remove_dead_placeholders(os.path.dirname(_absolute(path)))
    if local and os.path.isdir(path) and os.path.exists(os.path.join(path, MANIFEST_NAME)):
        return load(os.fspath(path), map_location, weights_only=weights_only, config=config)
    if local and _holds_reservation(os.fspath(path)):
        raise FileNotFoundError(
            f"{shown(os.fspath(path))} holds no checkpoint: it is the placeholder of a save that has not committed "
            "(still in flight in another process, or killed; the next save into its directory removes it then)"
        )
    if not get_filesystem(path).exists(path):
        raise FileNotFoundError(f"Checkpoint file not found: {path}")
    return pl_load(path, map_location=map_location, weights_only=weights_only)


def _remove(target: str, config: Config) -> None:
    """Removes the checkpoint at `target`: a file (or link), or an earlier version's directory."""
    if os.path.isdir(target) and not os.path.islink(target):
        if os.path.exists(os.path.join(target, MANIFEST_NAME)):
            remove_checkpoint_later(target, config.stripes)
        else:
            log.warning("kept %s: a directory that is not a fastpersist checkpoint", shown(target))
    elif os.path.lexists(target):
        os.remove(target)
