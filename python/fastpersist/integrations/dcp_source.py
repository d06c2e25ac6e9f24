"""A checkpoint written through the DCP plug-in, as a Hugging Face export reads it.

A :class:`DcpSource` is the export's :class:`~fastpersist.interop.hfsources.Source` for a
directory that :class:`~fastpersist.integrations.dcp.FastPersistWriter` wrote: names are DCP's
fully qualified names; tensors are read with ``dcp.load`` and this plug-in's reader in batches of
about a window, so a tensor saved in chunks (by several ranks) is assembled by DCP's own
planner. ``fp.export_hf`` opens it with :func:`opened_dcp_sources` where
:func:`~fastpersist.format.layout.is_dcp_checkpoint` says so; it lives here, above the export,
because the export itself (below the Checkpointer, which runs it in the background) knows no DCP.

Example:
    >>> import torch, torch.distributed.checkpoint as dcp
    >>> from fastpersist.integrations.dcp import FastPersistWriter
    >>> dcp.save({"w": torch.ones(2)}, storage_writer=FastPersistWriter("/tmp/fp-doc-dcpsrc"), no_dist=True)
    >>> with opened_dcp_sources("/tmp/fp-doc-dcpsrc") as sources:
    ...     [n.name for n in sources[0].tensors()]
    ['w']
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load

from ..config import Config
from ..interop.hfsources import Named, Source
from ..loading import reading
from .dcp import FastPersistReader

__all__ = ["DcpSource", "opened_dcp_sources"]

log = logging.getLogger("fastpersist")


class DcpSource:
    """The tensors of a checkpoint written by :class:`~fastpersist.integrations.dcp.FastPersistWriter`.

    Read through DCP's own ``dcp.load`` with a :class:`~fastpersist.integrations.dcp.FastPersistReader`
    (every chunk checksummed), in batches of about :data:`~fastpersist.loading.reading.WINDOW_BYTES`
    of tensors (or one larger tensor): DCP's planner assembles a tensor saved in chunks by
    several ranks, and the reader reads what each batch needs.
    """

    def __init__(self, path: str, config: Config) -> None:
        self.where = path
        self._config = config
        metadata = FastPersistReader(path, config).read_metadata()
        self._named: list[Named] = []
        skipped = []
        for fqn, meta in metadata.state_dict_metadata.items():
            if not isinstance(meta, TensorStorageMetadata):
                skipped.append(fqn)
                continue
            self._named.append(Named(fqn, meta.properties.dtype, tuple(meta.size), fqn, ("dcp", fqn)))
        if skipped:
            log.debug("export of %s skips %d value(s) that are not tensors: %s", path, len(skipped), skipped)

    def tensors(self) -> list[Named]:
        """Every tensor the checkpoint's metadata lists, by its fully qualified name."""
        return list(self._named)

    def stream(self, wanted: list[Named]) -> Iterator[tuple[Named, torch.Tensor]]:
        """Yields each of `wanted` with its values, read batch by batch through ``dcp.load``."""
        batch: list[Named] = []
        batch_bytes = 0
        for k, n in enumerate(wanted):
            batch.append(n)
            batch_bytes += math.prod(n.shape) * n.dtype.itemsize
            if k + 1 < len(wanted) and batch_bytes < reading.WINDOW_BYTES:
                continue
            targets = {b.ref: torch.empty(b.shape, dtype=b.dtype) for b in batch}
            # no_dist: one process reads the whole tensors, whatever group it may belong to.
            load(targets, storage_reader=FastPersistReader(self.where, self._config), no_dist=True)
            for b in batch:
                yield b, targets[b.ref]
            batch, batch_bytes = [], 0


@contextlib.contextmanager
def opened_dcp_sources(path: str | os.PathLike[str], config: Config | None = None) -> Iterator[list[Source]]:
    """The one source of the DCP-written checkpoint at `path` (a
    :data:`~fastpersist.interop.hfsources.SourceOpener`; nothing is held open between reads)."""
    yield [DcpSource(os.path.abspath(os.fspath(path)), config or Config())]
