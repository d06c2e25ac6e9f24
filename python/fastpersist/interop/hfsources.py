"""What a Hugging Face export reads: the named tensors of a checkpoint, streamed window by window.

A :class:`Source` lists its tensors (:class:`Named`: a dotted name built from the key path, the
dtype and the shape, known from the manifest before any data byte is read) and then yields
them, each as a contiguous CPU tensor, reading only the windows that hold the wanted ones
(:func:`fastpersist.loading.reading.stream_windows`: 64 MiB of blobs, or one larger blob,
checksums checked), the next window read in the background while the current one is used (two
window buffers in all). Each yielded tensor may be a view of the current window: use it before
asking for the next.

* :class:`CheckpointSource`: one plain fastpersist checkpoint (replicated, or one shard of a
  sharded one). Names come from the manifest's tree: dict keys and list indices joined by
  ``.`` (``model.transformer.h.0.attn.c_attn.weight``), as ``state_dict()`` names them.
* a checkpoint written through :mod:`fastpersist.integrations.dcp` is a source of the DCP
  plug-in's own (:class:`fastpersist.integrations.dcp_source.DcpSource`, above this package):
  the export takes any :class:`Source`, and ``fp.export_hf`` opens the one its checkpoint needs
  (a :data:`SourceOpener`).

Example:
    >>> import fastpersist as fp, torch
    >>> _ = fp.save({"model": {"w": torch.ones(2)}, "step": 1}, "/tmp/fp-doc-hfsrc")
    >>> with opened_sources("/tmp/fp-doc-hfsrc") as sources:
    ...     [n.name for n in sources[0].tensors()]
    ['model.w']
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol

import torch

from ..config import Config
from ..errors import FastPersistError
from ..format.confine import check_data_files
from ..format.layout import MANIFEST_NAME
from ..format.manifest import Manifest
from ..format.quote import shown
from ..format.records import TORCH_DTYPES, span_elems
from ..loading import reading
from ..loading.opened import OpenedCheckpoint, opened_checkpoint, opened_shard
from ..loading.reading import paged_uint8, read_window, stream_windows
from ..loading.relocate import check_stripes_present, read_opened

__all__ = ["CheckpointSource", "Named", "Source", "SourceOpener", "opened_sources", "tree_names"]

log = logging.getLogger("fastpersist")


class Named(NamedTuple):
    """One tensor a source holds: its dotted name, dtype, shape, and what the source reads it by."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    #: The record index (a checkpoint) or the fully qualified name (DCP).
    ref: Any
    #: Tensors with equal `alias` are the same bytes seen the same way (tied weights).
    alias: Any


class Source(Protocol):
    """Where the tensors of an export come from."""

    where: str

    def tensors(self) -> list[Named]:
        """Every tensor this source holds, in stream order."""
        ...

    def stream(self, wanted: list[Named]) -> Iterator[tuple[Named, torch.Tensor]]:
        """Yields each of `wanted` with its values (a contiguous CPU tensor, valid until the next)."""
        ...


#: Opens the sources of the checkpoint at a path (with the read's Config) for the length of a ``with``.
SourceOpener = Callable[[str, Config | None], contextlib.AbstractContextManager[list[Source]]]


# ----------------------------------------------------------------------------- names


def _key_text(key: object) -> str | None:
    """A dict key as a name part, or None for keys no weight name has (bytes, dtypes, ...)."""
    if key is None or isinstance(key, (str, bool)):
        return str(key)
    if isinstance(key, dict) and key.get("t") in ("int", "float"):
        return str(key.get("v"))
    return None


def tree_names(tree: dict[str, Any]) -> tuple[dict[int, list[str]], list[str]]:
    """The dotted names of each tensor record of a manifest tree (``{record: [names]}``, in tree
    order: one tensor object reached twice has two), and the names of the leaves that are not
    dense tensors (skipped)."""
    names: dict[int, list[str]] = {}
    skipped: list[str] = []
    stack: list[tuple[str, object]] = [("", tree.get("root"))]
    while stack:
        name, node = stack.pop()
        tag = node.get("t") if isinstance(node, dict) else None
        if tag in ("tensor", "tensor_attrs"):
            assert isinstance(node, dict)
            names.setdefault(node["i"], []).append(name)
            continue
        children: list[tuple[str, object]] = []
        if tag in ("dict", "odict"):
            assert isinstance(node, dict)
            for key, value in zip(node["k"], node["v"], strict=True):
                text = _key_text(key)
                if text is None:
                    skipped.append(f"{name}[{shown(key)}]")
                    continue
                children.append((f"{name}.{text}" if name else text, value))
        elif tag in ("list", "tuple", "ntuple"):
            assert isinstance(node, dict)
            children = [(f"{name}.{i}" if name else str(i), v) for i, v in enumerate(node["v"])]
        else:
            skipped.append(name or "(root)")
        stack.extend(reversed(children))
    return names, skipped


# ----------------------------------------------------------------------------- fastpersist


class CheckpointSource:
    """The torch tensors of one opened, unsharded fastpersist checkpoint."""

    def __init__(self, ck: OpenedCheckpoint, m: Manifest, config: Config) -> None:
        self.where = ck.root
        self._ck, self._m, self._config = ck, m, config
        names, skipped = tree_names(m.tree)
        self._named: list[Named] = []
        for i, rec in enumerate(m.tensors):
            if rec.kind != "torch" or rec.device == "meta":
                skipped.extend(names.get(i, [rec.key_path]))
                continue
            alias = (rec.blob, rec.offset_bytes, rec.dtype, tuple(rec.shape), tuple(rec.stride))
            for name in names.get(i, []):
                self._named.append(Named(name, TORCH_DTYPES[rec.dtype], tuple(rec.shape), i, alias))
        if skipped:
            log.debug("export of %s skips %d value(s) that are not tensors: %s", ck.root, len(skipped), skipped)

    def tensors(self) -> list[Named]:
        return list(self._named)

    def stream(self, wanted: list[Named]) -> Iterator[tuple[Named, torch.Tensor]]:
        m, root = self._m, self._ck.at
        check_stripes_present(m, self._ck.root)
        check_data_files(root, m, self._config.stripes)
        by_blob: dict[int, list[Named]] = {}
        for n in wanted:
            by_blob.setdefault(m.tensors[n.ref].blob, []).append(n)
        windows = [w for w in stream_windows(m, reading.WINDOW_BYTES) if any(b in by_blob for b in w[2])]
        if not windows:
            return
        # Two buffers of the largest window: the next window is read while this one is written.
        size = max(hi - lo for lo, hi, _ in windows)
        buffers = [paged_uint8(size), paged_uint8(size)]

        def read(k: int) -> None:
            lo, hi, _ = windows[k]
            read_window(root, m, lo, hi, buffers[k % 2][0], True, self._config)

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastpersist-export-read") as reader:
            pending = reader.submit(read, 0)
            for k, (lo, _hi, blobs) in enumerate(windows):
                pending.result()
                if k + 1 < len(windows):
                    pending = reader.submit(read, k + 1)
                window = buffers[k % 2][1]
                for b in blobs:
                    for n in by_blob.get(b, ()):
                        yield n, self._tensor(window, m.blobs[b][0] - lo, n)

    def _tensor(self, window: torch.Tensor, blob_start: int, n: Named) -> torch.Tensor:
        """`n`'s values, contiguous: a view of `window` where they are stored contiguously."""
        rec = self._m.tensors[n.ref]
        span = span_elems(rec.shape, rec.stride) * n.dtype.itemsize
        raw = window[blob_start + rec.offset_bytes : blob_start + rec.offset_bytes + span]
        if raw.storage_offset() % n.dtype.itemsize:
            raw = raw.clone()
        return raw.view(n.dtype).as_strided(rec.shape, rec.stride).contiguous()


# ----------------------------------------------------------------------------- DCP


# ----------------------------------------------------------------------------- opening


@contextlib.contextmanager
def opened_sources(path: str | os.PathLike[str], config: Config | None = None) -> Iterator[list[Source]]:
    """The sources of the fastpersist checkpoint at `path`: one for a replicated checkpoint, one
    per shard (in rank order) for a sharded one; each checkpoint directory held open until the end.
    (A checkpoint written through DCP opens with
    :func:`fastpersist.integrations.dcp_source.opened_dcp_sources`.)"""
    config = config or Config()
    root = os.path.abspath(os.fspath(path))
    with opened_checkpoint(root) as ck:
        m = read_opened(ck, config.stripes)
        if not m.shards:
            yield [CheckpointSource(ck, m, config)]
            return
        with contextlib.ExitStack() as stack:
            sources: list[Source] = []
            for name in m.shards:
                shard_ck = stack.enter_context(opened_shard(ck, name))
                shard_m = read_opened(shard_ck, config.stripes)
                if shard_m.shards:
                    raise FastPersistError(f"{shard_ck.root}/{MANIFEST_NAME}: a shard may not itself be sharded")
                sources.append(CheckpointSource(shard_ck, shard_m, config))
            yield sources
