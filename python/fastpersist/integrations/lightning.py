"""PyTorch Lightning ``CheckpointIO`` plug-in: the Trainer's checkpoints written by fastpersist.

Install with ``pip install 'fastpersist[lightning]'`` and pass the plug-in to the Trainer:

    >>> from fastpersist.integrations.lightning import FastPersistCheckpointIO
    >>> trainer = L.Trainer(plugins=[FastPersistCheckpointIO()])          # doctest: +SKIP
    >>> trainer.fit(model, ckpt_path="last")                             # doctest: +SKIP

Each ``.ckpt`` path becomes a fastpersist checkpoint directory (aligned O_DIRECT writes,
checksums, atomic replace). Lightning checkpoints hold a few values our format does not know
(``AttributeDict`` hyper-parameters and other dict subclasses): they are stored as plain
dicts. Anything else unsupported (an arbitrary object in ``hyper_parameters``) is stored as
its ``repr`` string with a warning, unless ``strict=True``, which raises instead.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

try:
    from lightning.pytorch.plugins.io import CheckpointIO
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fastpersist.integrations.lightning needs PyTorch Lightning: pip install 'fastpersist[lightning]'"
    ) from e

from ..api import load, save
from ..config import Config
from ..format.layout import MANIFEST_NAME
from ..format.quote import shown
from ..saving.remover import remove_checkpoint_later, wait_removed

__all__ = ["FastPersistCheckpointIO"]

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
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (got {storage_options!r})")
        target = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        save(self._plain(checkpoint, "checkpoint"), target, config=self.config)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        """Reads the checkpoint at `path`; `map_location` as in ``torch.load`` (never unpickles)."""
        return load(os.fspath(path), map_location, weights_only=weights_only, config=self.config)

    def remove_checkpoint(self, path: Any) -> None:
        """Removes the checkpoint directory at `path` (only if it is one of ours) and its stripe
        directories: it is out of sight at once, its bytes are deleted in the background."""
        target = os.fspath(path)
        if os.path.isdir(target) and os.path.exists(os.path.join(target, MANIFEST_NAME)):
            remove_checkpoint_later(target, self.config.stripes)
        elif os.path.isfile(target):
            os.remove(target)

    def teardown(self) -> None:
        """At the end of fit: the background removals of replaced and pruned checkpoints finish."""
        wait_removed()

    def _plain(self, x: Any, where: str) -> Any:
        """`x` with dict subclasses as dicts and unknown objects handled per `strict`."""
        cls = type(x)
        if cls is dict or cls is OrderedDict or isinstance(x, dict):
            out = {k: self._plain(v, f"{where}[{k!r}]") for k, v in x.items()}
            return OrderedDict(out) if isinstance(x, OrderedDict) else out
        if cls is list or cls is tuple:
            return cls(self._plain(v, f"{where}[{i}]") for i, v in enumerate(x))
        if isinstance(x, (torch.Tensor, np.ndarray, np.generic, *_PLAIN)) or (
            isinstance(x, tuple) and hasattr(x, "_fields")
        ):
            return x
        if self.strict:
            raise TypeError(f"{shown(where)}: {type(x).__name__} cannot be stored by fastpersist (strict=True)")
        log.warning("%s: storing %s as its repr string (fastpersist stores data only)", shown(where), type(x).__name__)
        return repr(x)
