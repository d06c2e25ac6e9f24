"""``torch_save_async``: ``fp.torch_save``'s file, written while the caller goes on.

The archive is laid out on the caller's thread as :mod:`.torchfile` lays it out: torch pickles
the object without its data, so every plain value (dicts, lists, numbers, strings, objects) is
in the skeleton once the call returns, and only the storages' bytes are left to read. The
engine then stages and writes them on its own thread into a temporary file beside the target
(:func:`~fastpersist.format.layout.atomic_file`, under its lock), and the future's commit
thread fsyncs it and renames it into place. A process killed before that rename leaves the
target as it was (absent, or the previous complete file) and a temporary that the next save
of the same path and ``fastpersist clean`` recognise as dead.

The storages are read after the call returns, so the mutation guard of ``fp.save_async``
watches them (docs/overlap.md): every tensor pickled is recorded with its version counter,
and once a storage's bytes are staged, each tensor over it must still have that version, or
the save fails with :class:`~fastpersist.errors.SaveCancelledError` and commits nothing.
Small storages (the statistics a forward pass updates) are copied before the call returns,
as ``save_async`` copies them (:mod:`fastpersist.gpu.early`, host storages only: a device
storage's copy is queued before the call returns and checked like the others).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import IO, Any

import numpy as np
import torch

import fastpersist._core as _core

from ..config import Config
from ..engine import Guard
from ..errors import SaveCancelledError
from ..format.blobs import Blob
from ..format.layout import atomic_file
from ..futures import SaveFuture, SaveResult
from ..gpu.early import choose_early_copies
from ..saving.engine_save import EngineSave
from ..saving.verdict import Verdict
from .torchfile import Archive, capture_skeleton, fast_path_target, lay_out_archive, save_instead, torch_save
from .torchroutes import TORCH_DEFAULT, TorchSaveArgs, torch_save_result, torch_save_route

__all__ = ["ArchiveSaveJob", "copy_unversioned_extents", "torch_save_async", "watched_storages"]

#: Which tensors were pickled over the bytes of one extent, each with its version at pickling.
Watchers = list[tuple[torch.Tensor, int]]


def _address(data: np.ndarray | torch.Tensor) -> tuple[str, int]:
    """Where `data`'s first byte lies: (device, address)."""
    if isinstance(data, torch.Tensor):
        return str(data.device), int(data.data_ptr())
    return "cpu", int(data.__array_interface__["data"][0])


def _storage_address(t: torch.Tensor) -> tuple[str, int] | None:
    """Where `t`'s storage begins; None for a tensor without one (sparse, meta, wrapper)."""
    try:
        ptr = int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return (str(t.device), ptr) if ptr else None


def watched_storages(archive: Archive) -> list[Watchers]:
    """Per extent of `archive`, the tensors whose storage it reads in place (empty for bytes
    the layout copied: the skeleton's, storage tails, host copies of device storages).

    An extent read in place starts where its storage starts; two live allocations cannot
    begin at one address, so the address says which storage, if any, an extent views.
    """
    by_storage: dict[tuple[str, int], Watchers] = {}
    for tensor, version in archive.skeleton.tensors:
        where = _storage_address(tensor)
        if where is not None:
            by_storage.setdefault(where, []).append((tensor, version))
    in_place = {
        where
        for storage in archive.skeleton.storages.values()
        if storage.nbytes() and (where := (str(storage.device), int(storage.data_ptr()))) in by_storage
    }
    return [by_storage[a] if (a := _address(e)) in in_place else [] for e in archive.extents]


def copy_unversioned_extents(archive: Archive) -> None:
    """Replaces each extent read in place from an inference tensor's storage by a copy made now
    (on the host, or on the storage's device): such a tensor keeps no version counter, so the
    guard could not see it modified before its bytes are staged."""
    unversioned = {where for t in archive.skeleton.unversioned if (where := _storage_address(t)) is not None}
    if not unversioned:
        return
    extents = archive.extents
    for i, extent in enumerate(extents):
        if _address(extent) in unversioned:
            extents[i] = extent.clone() if isinstance(extent, torch.Tensor) else extent.copy()


def _early_copies(archive: Archive, watchers: list[Watchers]) -> list[int]:
    """The watched host extents the engine copies before the call returns (``save_async``'s rule)."""
    blobs = [
        Blob(e, e, 0 if watching else None) if isinstance(e, np.ndarray) else Blob(None, e, None, e.nbytes)
        for e, watching in zip(archive.extents, watchers, strict=True)
    ]
    return choose_early_copies(blobs)


class ArchiveSaveJob(EngineSave):
    """One ``torch_save_async`` on the fast path: the engine's write into a temporary file, and
    the commit (fsync, rename) that :class:`SaveFuture`'s thread runs through :meth:`finish`."""

    cancelled_leaves = "nothing was written"

    def __init__(self, target: str, archive: Archive, config: Config, started: float) -> None:
        self.path = target
        self.config = config
        self.archive: Archive | None = archive
        self.started = started
        self.total_bytes = archive.total_bytes
        self.verdict = Verdict()
        self.watchers: list[Watchers] | None = watched_storages(archive)
        self.handle: _core.WriteHandle | None = None
        self._file = contextlib.ExitStack()

    def start(self) -> ArchiveSaveJob:
        """Makes the temporary file and starts the engine's write into it (background)."""
        assert self.archive is not None and self.watchers is not None
        tmp = self._file.enter_context(atomic_file(self.path, durable=self.config.durable))
        try:
            self.handle = self.archive.start(
                self.config,
                tmp,
                what=self.path,
                background=True,
                guard=Guard(
                    watched=[bool(w) for w in self.watchers],
                    on_staged=self._check_staged,
                    copy_early=_early_copies(self.archive, self.watchers),
                ),
            )
            if self.config.guard == "copy":
                # Writes the version counter cannot see (.data, .numpy(), CUDA) are kept out only by waiting.
                self.handle.wait_staged()
        except BaseException as e:
            self._discard(e)
            raise
        return self

    def _check_staged(self, extents: list[int]) -> bool:
        """The mutation guard (the engine's thread calls it once `extents` are staged whole):
        every tensor over them must have the version it was pickled with."""
        watchers = self.watchers
        if watchers is None:
            return True
        for index in extents:
            for tensor, version in watchers[index]:
                now = tensor._version
                if now != version:
                    self.verdict.fail(
                        SaveCancelledError(
                            f"a tensor ({tensor.dtype}, shape {list(tensor.shape)}) saved to {self.path} was "
                            f"modified in place before torch_save_async had copied it (version {version} -> "
                            f"{now}); call wait_staged() on the future before modifying what it saves (before "
                            "optimizer.step()). The file was not written; the previous one is untouched."
                        )
                    )
                    return False
        return True

    def drop_sources(self) -> None:
        self.archive = None
        self.watchers = None

    def finish(self, timeout: float | None = None) -> SaveResult:
        """Waits for the write, then fsyncs and renames the file into place (unless the save
        failed: then the temporary file is removed and the error raised)."""
        assert self.handle is not None
        try:
            report = self.handle.wait(timeout)
            self.verdict.commit(self._file.close)  # fsync, rename, fsync the directory
        except TimeoutError:
            raise
        except BaseException as e:
            error = self.verdict.fail(e) or e
            self._discard(error)
            if error is e:
                raise
            raise error from None
        finally:
            self.drop_sources_if_staged()
        staged = report.get("staged_seconds")
        return torch_save_result(
            self.path, self.total_bytes, self.started, str(report["backend"]), None if staged is None else float(staged)
        )

    def _discard(self, error: BaseException) -> None:
        """Removes the temporary file (the target stays as it was)."""
        self.stop_engine()
        self._file.__exit__(type(error), error, error.__traceback__)


class _Done:
    """A save that already happened (written by ``torch.save`` itself, on the caller's thread)."""

    def __init__(self, result: SaveResult) -> None:
        self.path = result.path
        self.result = result

    def wait_staged(self, timeout: float | None = None) -> None:
        return None

    def staged(self) -> bool:
        return True

    def finish(self, timeout: float | None = None) -> SaveResult:
        return self.result

    def cancel(self) -> bool:
        return False


def torch_save_async(
    obj: object,
    f: str | os.PathLike[str] | IO[bytes],
    pickle_module: Any = TORCH_DEFAULT,
    pickle_protocol: int = TORCH_DEFAULT,
    _use_new_zipfile_serialization: bool = TORCH_DEFAULT,
    _disable_byteorder_record: bool = TORCH_DEFAULT,
    *,
    config: Config | None = None,
) -> SaveFuture:
    """:func:`fastpersist.torch_save`'s file, written in the background: returns a
    :class:`SaveFuture` once the object is pickled and the write has started.

    Takes what ``torch_save`` takes and writes the same file (a torch zip archive that
    ``torch.load`` reads, laid out byte for byte as ``torch.save`` lays it out). The two
    moments of ``fp.save_async`` hold: ``fut.wait_staged()`` returns once the object's tensors
    may be modified again; ``fut.wait()`` (or ``result()``) once the file is durable and
    renamed into place atomically. Until then the target is untouched: a process killed before
    the rename leaves the previous file (or none), never a part of the new one. Plain values
    are captured by the call itself; a tensor modified in place (through torch) before its
    bytes are staged fails the save (``SaveCancelledError`` from ``wait_staged()`` and
    ``wait()``; nothing is written); small host tensors are copied before the call returns.
    ``Config(guard="copy")`` returns only once every byte is staged.

    Errors of the call itself (an object that does not pickle, a bad ``pickle_protocol``) are
    raised by the call, as ``torch.save`` raises them; errors of the write (a full disk, an I/O
    error) by ``wait()``. What ``torch_save`` hands to ``torch.save`` itself (a file object,
    ``_use_new_zipfile_serialization=False``, a custom ``pickle_module``, a path ``torch.save``
    refuses) is written on the caller's thread, synchronously, and the future returned is
    already done (its exception raised by the call, as ``torch.save`` raises it).

    Example:
        >>> import fastpersist as fp, torch
        >>> state = {"w": torch.arange(4.0)}
        >>> fut = fp.torch_save_async(state, "/tmp/fp-doc-async.pt")
        >>> fut.wait_staged(); state["w"].add_(1)     # the file keeps 0, 1, 2, 3
        tensor([1., 2., 3., 4.])
        >>> torch.load(fut.wait().path, weights_only=True)["w"]
        tensor([0., 1., 2., 3.])
    """
    started = time.perf_counter()
    given = (pickle_module, pickle_protocol, _use_new_zipfile_serialization, _disable_byteorder_record)
    args = TorchSaveArgs.of(*given)
    if torch_save_route(f, args) is not None or not isinstance(f, (str, os.PathLike)):
        return SaveFuture(_Done(torch_save(obj, f, *given, config=config)))
    target = fast_path_target(f)
    config = (config or Config()).resolved_for(target)
    try:
        archive = lay_out_archive(capture_skeleton(obj, args.pickle_protocol, args.disable_byteorder_record), config)
    except Exception as e:  # torch's own error, if any, is raised by torch.save in save_instead
        return SaveFuture(_Done(save_instead(obj, target, args, config, started, e)))
    copy_unversioned_extents(archive)
    return SaveFuture(ArchiveSaveJob(target, archive, config, started).start())
