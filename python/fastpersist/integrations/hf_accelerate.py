"""Accelerate's ``save_state``/``load_state`` with the models' weights written by fastpersist,
through the two hooks Accelerate offers (``register_save_state_pre_hook``,
``register_load_state_pre_hook``): :class:`FastPersistStateHooks`.

    >>> hooks = FastPersistStateHooks().install(accelerator)      # doctest: +SKIP
    >>> accelerator.save_state("ckpt/step-100")  # complete and durable on return  # doctest: +SKIP
    >>> accelerator.load_state("ckpt/step-100")                   # doctest: +SKIP

The save hook takes each model's state dict out of the list Accelerate would write and starts
:func:`fastpersist.save_async` of it into ``model_fastpersist`` (``model_{i}_fastpersist``)
beside Accelerate's files: a fastpersist checkpoint (aligned O_DIRECT writes, crc32c on every
chunk, atomic rename), written while Accelerate writes its own files (the optimizer state, the
RNG states). The load hook waits for the saves in flight, then fills each model's tensors in
place from its checkpoint (all or nothing, checksums verified) and takes the model out of the
list Accelerate would load; a folder saved without the hooks (no ``model_fastpersist``) is left
to Accelerate's own loader.

``install`` also wraps the accelerator's ``save_state`` and ``load_state``. ``save_state``
returns, as Accelerate's own does, with its folder complete: the weights committed, every file
of the folder fsynced. So a folder may be read, copied or removed right after it. With
``FastPersistStateHooks(background=True)`` it returns once the weights are staged instead and
the write commits during the next steps (each prepared optimizer's ``step()`` first waits until
the weights are staged): the folder lacks the weights until :meth:`FastPersistStateHooks.wait`,
the next ``save_state`` or ``load_state``, so copying or removing it before then races the write.

``save_state`` also removes what killed saves left in its folder (with
``automatic_checkpoint_naming``: in every folder of ``checkpoints/``). With
``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=k)`` it runs Accelerate's
with ``total_limit`` off and deletes the same oldest folders Accelerate would have deleted, but
only once the new folder is durable (:func:`folders_past_limit`, :func:`remove_folders`): so a
folder whose save is in flight is never deleted and the previous checkpoint stays until its
successor is loadable (``k + 1`` folders exist meanwhile). ``load_state`` waits for the save in
flight before Accelerate picks or reads its folder.

What the hooks cannot reach, since Accelerate writes and reads it itself after the hook: the
optimizer state (``optimizer.bin``), schedulers, the grad scaler, the RNG states
(``random_states_*.pkl``), dataloader samplers and ``register_for_checkpointing`` objects.
They stay ``torch.save`` files written synchronously by ``save_state``, with no checksum; the
hooks fsync them (and the directory) after the fact, so the directory is durable once the
weights are, but a crash during ``save_state`` can leave them partial. ``save_state`` writes
into the folder in place, and ``load_state()`` with automatic naming picks the newest folder
whether it is complete or not (a folder whose weights' save was killed is refused by the load
hook with an error naming it; load the folder before it). Models of FSDP, DeepSpeed or
Megatron-LM runs are saved by Accelerate itself (their hook list is empty). For checkpoints that
appear only when complete, use :class:`~fastpersist.Checkpointer` or, under the Trainer,
:mod:`.hf_trainer`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
from collections.abc import Callable, Collection, Sequence
from typing import Any

import fastpersist._core as _core

from ..api import load, save_async
from ..cleanup import clean
from ..config import Config
from ..format.layout import MANIFEST_NAME, fsync_tree, parse_tmp_dir
from ..futures import SaveFuture, SaveResult
from ..saving.commit import Commit
from ..saving.optimizer_guard import guard_optimizer
from ..saving.target import remove_checkpoint_tree
from .hf_checkpoint import snapshot_pool_config

__all__ = ["FastPersistStateHooks", "model_dir_name"]


def model_dir_name(index: int) -> str:
    """The checkpoint directory of the `index`-th prepared model, beside Accelerate's files
    (its own names are ``model.safetensors``, ``model_1.safetensors``, ...)."""
    return "model_fastpersist" if index == 0 else f"model_{index}_fastpersist"


_NUMBER = re.compile(r"\d+")


def folder_number(path: str) -> int:
    """The number Accelerate orders its checkpoint folders by: the first in the folder's name.

    Example:
        >>> folder_number("/run/checkpoints/checkpoint_12")
        12
    """
    match = _NUMBER.search(os.path.basename(path))
    if match is None:
        raise ValueError(
            f"{path} has no number in its name, so Accelerate's total_limit cannot order it among its "
            "checkpoint folders; move it out of the checkpoints directory"
        )
    return int(match.group())


def folders_past_limit(checkpoints_dir: str, total_limit: int) -> list[str]:
    """The entries of `checkpoints_dir` that Accelerate's ``save_state`` would delete now to make
    room for one more under `total_limit`, oldest first (every entry counts, as in Accelerate).

    Example:
        >>> import tempfile
        >>> root = tempfile.mkdtemp()
        >>> for n in (10, 2, 1):
        ...     os.mkdir(os.path.join(root, f"checkpoint_{n}"))
        >>> [os.path.basename(p) for p in folders_past_limit(root, total_limit=2)]
        ['checkpoint_1', 'checkpoint_2']
    """
    if not os.path.isdir(checkpoints_dir):
        return []
    folders = [os.path.join(checkpoints_dir, name) for name in os.listdir(checkpoints_dir)]
    excess = len(folders) + 1 - total_limit
    if excess <= 0:
        return []
    folders.sort(key=folder_number)  # stable: ties keep the listing's order, as in Accelerate
    return folders[:excess]


def remove_folders(folders: Sequence[str], stripes: Sequence[str] | None) -> None:
    """Deletes `folders` (and the stripe directories their fastpersist checkpoints own)."""
    for folder in folders:
        if stripes and os.path.isdir(folder):
            for entry in os.scandir(folder):
                if entry.is_dir(follow_symlinks=False) and os.path.isfile(os.path.join(entry.path, MANIFEST_NAME)):
                    remove_checkpoint_tree(entry.path, stripes)
        if os.path.isdir(folder) and not os.path.islink(folder):
            shutil.rmtree(folder)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(folder)


def clean_folders(folders: Sequence[str], stripes: Sequence[str] | None) -> None:
    """Removes what killed saves left in each of `folders` (a save in progress is left alone)."""
    for folder in folders:
        if os.path.isdir(folder) and not os.path.islink(folder):
            clean(folder, stripes=list(stripes) if stripes else None)


def fsync_folder(folder: str, durable_already: Collection[str]) -> None:
    """Fsyncs every file and directory under `folder` except the trees in `durable_already`,
    then the directory holding `folder`, so that the folder survives a crash whole."""
    fsync_tree(folder, durable_already=durable_already)
    _core.fsync_dir(os.path.dirname(os.path.abspath(folder)))


def unsaved_models(folder: str) -> list[str]:
    """The names of the fastpersist checkpoints whose save into `folder` left only its hidden
    temporary directory (the process died before the commit)."""
    if not os.path.isdir(folder):
        return []
    names = set()
    for name in os.listdir(folder):
        parsed = parse_tmp_dir(name)
        if parsed is not None and not os.path.exists(os.path.join(folder, parsed[0])):
            names.add(parsed[0])
    return sorted(names)


class FastPersistStateHooks:
    """The save and load hooks of one ``Accelerator``, and the saves they started.

    Args:
        config: engine knobs for the models' saves and loads. Without it, a model's weights are
            staged in snapshot mode (a pool of their size, capped at a quarter of RAM), so
            Accelerate's own writes (and, with `background`, the next steps) wait for one memory
            copy, not for the disk.
        background: ``save_state`` returns once the weights are staged, not committed; the
            folder lacks them until :meth:`wait` (see the module docstring).

    Example:
        >>> hooks = FastPersistStateHooks().install(accelerator)   # doctest: +SKIP
        >>> accelerator.save_state(out)  # complete and durable     # doctest: +SKIP
        >>> hooks = FastPersistStateHooks(background=True).install(other)  # doctest: +SKIP
        >>> other.save_state(out2); hooks.wait()  # durable at wait()      # doctest: +SKIP
    """

    def __init__(self, config: Config | None = None, *, background: bool = False) -> None:
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config={config!r}: expected a fastpersist.Config (or None for the defaults)")
        if not isinstance(background, bool):
            raise TypeError(f"background={background!r}: expected True or False")
        self.config = config
        self.background = background
        self.accelerator: Any = None
        self._in_flight: list[SaveFuture] = []
        self._last_dir: str | None = None
        self._retire_after_commit: list[str] = []
        self._handles: list[Any] = []
        self._wrappers: dict[str, Callable[..., Any]] = {}
        self._guarded: set[int] = set()

    def install(self, accelerator: Any) -> FastPersistStateHooks:
        """Registers both hooks on `accelerator` and wraps its ``save_state`` and ``load_state``
        (see the module docstring); returns self. :meth:`remove` undoes it."""
        if self.accelerator is not None:
            raise RuntimeError("these hooks are installed already; make a FastPersistStateHooks per Accelerator")
        if not callable(getattr(accelerator, "register_save_state_pre_hook", None)):
            raise TypeError(
                f"accelerator={accelerator!r}: expected an accelerate.Accelerator (with register_save_state_pre_hook)"
            )
        self.accelerator = accelerator
        self._handles = [
            accelerator.register_save_state_pre_hook(self._save_hook),
            accelerator.register_load_state_pre_hook(self._load_hook),
        ]
        self._wrappers = {
            "save_state": self._wrap_save_state(accelerator.save_state),
            "load_state": self._wrap_load_state(accelerator.load_state),
        }
        for name, wrapper in self._wrappers.items():
            setattr(accelerator, name, wrapper)  # an instance attribute: the class's method is untouched
        return self

    def remove(self) -> None:
        """Waits for the saves in flight and unregisters the hooks (the optimizer guards stay)."""
        self.wait()
        for handle in self._handles:
            handle.remove()
        for name, wrapper in self._wrappers.items():
            if vars(self.accelerator).get(name) is wrapper:
                delattr(self.accelerator, name)
        self._handles, self._wrappers, self.accelerator = [], {}, None

    @property
    def saves_in_flight(self) -> list[SaveFuture]:
        """The models' saves started by the last ``save_state`` and not yet waited for."""
        return list(self._in_flight)

    def wait_staged(self, timeout: float | None = None) -> None:
        """Returns once the weights being saved may be modified (what ``optimizer.step()`` calls;
        `timeout` applies to each model's save)."""
        for fut in self._in_flight:
            fut.wait_staged(timeout)

    def wait(self) -> list[SaveResult]:
        """Blocks until the models' checkpoints are committed, fsyncs the files Accelerate wrote
        into the same folder, then deletes the folders ``total_limit`` retired; returns the
        models' :class:`SaveResult`. Raises a save's error (and then deletes nothing)."""
        futures, self._in_flight = self._in_flight, []
        folder, self._last_dir = self._last_dir, None
        retired, self._retire_after_commit = self._retire_after_commit, []

        def durable(results: list[SaveResult]) -> None:
            if folder is not None:
                fsync_folder(folder, durable_already={r.path for r in results})

        return Commit(
            folder or "the models' checkpoints",
            futures,
            kept="no folder was retired",
            durable=durable,
            retire=lambda: remove_folders(retired, self._stripes()),
        ).run()

    def _stripes(self) -> list[str] | None:
        return [os.fspath(s) for s in self.config.stripes] if self.config and self.config.stripes else None

    def _wrap_save_state(self, save_state: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(save_state)
        def wrapper(output_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
            self.wait()  # Accelerate lists (and may pick) folders: none may be half-written
            project = self.accelerator.project_configuration
            if project.automatic_checkpoint_naming:
                checkpoints = os.path.join(self.accelerator.project_dir, "checkpoints")
                if os.path.isdir(checkpoints):
                    clean_folders([os.path.join(checkpoints, n) for n in os.listdir(checkpoints)], self._stripes())
            elif output_dir is not None:
                clean_folders([os.fspath(output_dir)], self._stripes())
            limit = project.total_limit
            retired: list[str] = []
            if project.automatic_checkpoint_naming and limit is not None and self.accelerator.is_main_process:
                retired = folders_past_limit(checkpoints, limit)
            project.total_limit = None  # Accelerate would delete them now, before the new folder is durable
            try:
                location = save_state(output_dir, *args, **kwargs)
            finally:
                project.total_limit = limit
            self._retire_after_commit = retired
            if not (self.background and self._in_flight):
                self.wait()  # Accelerate's contract: the folder complete on return (and rotated)
            return location

        return wrapper

    def _wrap_load_state(self, load_state: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(load_state)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.wait()  # before Accelerate picks the newest folder or reads the one named
            return load_state(*args, **kwargs)

        return wrapper

    def _save_hook(self, models: list[Any], weights: list[dict[str, Any]], output_dir: str) -> None:
        self.wait()  # one save_state in flight at a time
        for optimizer in self.accelerator._optimizers if self.background else ():
            inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer's step bypasses its own hooks
            if id(inner) not in self._guarded:
                guard_optimizer(inner, self)
                self._guarded.add(id(inner))
        self._last_dir = output_dir
        self._in_flight = []
        for i, state in enumerate(weights):
            path = os.path.join(output_dir, model_dir_name(i))
            config = self.config or snapshot_pool_config(state.values(), output_dir)
            self._in_flight.append(save_async(state, path, config=config))
        weights.clear()  # Accelerate writes no model file of its own

    def _load_hook(self, models: list[Any], input_dir: str) -> None:
        self.wait()
        paths = [os.path.join(input_dir, model_dir_name(i)) for i in range(len(models))]
        found = [os.path.isdir(p) for p in paths]
        if not any(found):
            killed = unsaved_models(input_dir)
            if killed:
                raise FileNotFoundError(
                    f"load_state({input_dir!r}): the save of {killed} into this folder never committed (the process "
                    "died while writing it); load the folder saved before it"
                )
            return  # a folder saved without these hooks: Accelerate loads its own model files
        if not all(found):
            missing = [p for p, there in zip(paths, found, strict=True) if not there]
            raise FileNotFoundError(
                f"load_state({input_dir!r}): {len(models)} models are prepared but {missing} hold no fastpersist "
                "checkpoint; prepare the same models, in the same order, as the run that saved this folder"
            )
        for model, path in zip(models, paths, strict=True):
            load(path, out=model.state_dict(), config=self.config or Config())
        models.clear()  # loaded: Accelerate must not look for its own model files
