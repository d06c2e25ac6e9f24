"""``fp.export_hf``: a checkpoint, or a Checkpointer root's latest step, as Hugging Face safetensors.

The export itself is :mod:`fastpersist.interop.hfexport`; this module only decides what it
reads: a Checkpointer root's latest step (:meth:`Checkpointer.latest`, the step a restore would
load), and for a checkpoint written through DCP the DCP plug-in's source
(:mod:`fastpersist.integrations.dcp_source`, which the export below the Checkpointer cannot
import).
"""

from __future__ import annotations

import errno
import os

from .checkpointer import Checkpointer
from .config import Config
from .format.layout import is_checkpointer_root, is_dcp_checkpoint
from .interop.hfexport import DEFAULT_MAX_SHARD_BYTES, ExportResult, export_checkpoint
from .interop.hfsources import SourceOpener, opened_sources

__all__ = ["export_hf"]


def export_hf(
    src: str | os.PathLike[str],
    outdir: str | os.PathLike[str],
    *,
    prefix: str = "",
    key: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    config: Config | None = None,
    durable: bool = True,
) -> ExportResult:
    """Writes the model tensors of `src` to `outdir` as ``from_pretrained`` loads them.

    `src`: a checkpoint (replicated, sharded, or written through DCP with
    :class:`~fastpersist.integrations.dcp.FastPersistWriter`), or a Checkpointer root: its latest
    committed step that verifies. The files are ``model.safetensors``, or shards of at most
    `max_shard_bytes` of tensor data (``save_pretrained``'s 5 GB by default) and
    ``model.safetensors.index.json``. Names are the state's key paths joined by ``.``; `key` picks
    the sub-tree to export by its dotted name (``"model"``), `prefix` is stripped from the names
    that start with it (``"module."``). Tied weights are written once; values that are not
    tensors are skipped. Memory: two read windows (64 MiB each, or the largest tensor), never the
    model. `config`: the read's engine knobs. See :mod:`fastpersist.interop.hfexport` and
    docs/interop.md.

    Raises:
        FileNotFoundError: a Checkpointer root without a committed step that verifies.
        FastPersistError: no tensor under `key`; a dtype safetensors lacks; shards of a sharded
            checkpoint holding different values (or dtype, or shape) under one name.
        CorruptCheckpointError / ChecksumMismatchError: the checkpoint is damaged.

    Example:
        >>> import fastpersist as fp, torch
        >>> ck = fp.Checkpointer("/tmp/fp-doc-export")
        >>> _ = ck.save(7, {"model": torch.nn.Linear(2, 2).state_dict(), "step": 7}); ck.wait()
        >>> res = fp.export_hf("/tmp/fp-doc-export", "/tmp/fp-doc-export-hf", key="model")
        >>> res.files, res.source.endswith("step-00000007")
        (['model.safetensors'], True)
    """
    path = os.path.abspath(os.fspath(src))
    if is_checkpointer_root(path):
        ck = Checkpointer(path)
        step = ck.latest()
        if step is None:
            raise FileNotFoundError(errno.ENOENT, "no committed, verified checkpoint in this Checkpointer root", path)
        path = ck.path(step)
    open_sources: SourceOpener = opened_sources
    if is_dcp_checkpoint(path):
        # Import time: torch.distributed.checkpoint is loaded only when a DCP checkpoint is exported.
        from .integrations.dcp_source import opened_dcp_sources

        open_sources = opened_dcp_sources
    return export_checkpoint(
        path,
        outdir,
        prefix=prefix,
        key=key,
        max_shard_bytes=max_shard_bytes,
        config=config,
        durable=durable,
        open_sources=open_sources,
    )
