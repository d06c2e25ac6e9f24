"""Consolidation to Hugging Face format: a checkpoint's model tensors as sharded safetensors.

:func:`export_checkpoint` (public as :func:`fastpersist.export_hf`, which also takes a
Checkpointer root, and opens a DCP-written checkpoint with the DCP plug-in's source) reads a
replicated or sharded checkpoint, or any :class:`~.hfsources.Source`, and writes what
``from_pretrained`` loads: ``model.safetensors``, or
size-limited ``model-0000K-of-0000N.safetensors`` shards and ``model.safetensors.index.json``
(:mod:`.hfshards`). Memory stays bounded: the tensors are read one window at a time
(:mod:`.hfsources`) and written at their place in the shard files as they arrive; nothing
of the size of the model is ever held.

Names are the state's key paths joined by ``.``; `key` picks the sub-tree to export (the
state's ``"model"`` entry of ``{"model": ..., "optimizer": ...}``) and `prefix` is stripped
from the names that start with it (``"module."`` of a DDP-wrapped model). A sharded
checkpoint's shards are merged: a name in several shards must hold the same values in each
(else :class:`~fastpersist.FastPersistError` names it). Tied weights (names of the same bytes
seen the same way, e.g. GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``) are written
once, under the first name, as ``save_pretrained`` does; ``from_pretrained`` ties them again.
Values that are not tensors are skipped (listed at DEBUG).

Example:
    >>> import fastpersist as fp, torch
    >>> _ = fp.save({"model": torch.nn.Linear(2, 2).state_dict(), "step": 3}, "/tmp/fp-doc-hf")
    >>> export_checkpoint("/tmp/fp-doc-hf", "/tmp/fp-doc-hf-out", key="model").files
    ['model.safetensors']
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import fastpersist._core as _core

from ..arguments import given_path
from ..config import Config
from ..errors import FastPersistError
from ..format.layout import MANIFEST_NAME, atomic_file, remove_dead_tmp_files
from ..format.quote import shown
from .hfshards import (
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_NAME,
    SAFETENSORS_DTYPES,
    OutTensor,
    ShardFile,
    plan_shards,
    shard_names,
    stale_files,
    write_index,
)
from .hfsources import Named, Source, SourceOpener, opened_sources

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "ExportResult", "export_checkpoint"]

log = logging.getLogger("fastpersist")


class ExportResult(NamedTuple):
    """What :func:`export_hf` wrote."""

    source: str  # the checkpoint read
    outdir: str
    files: list[str]  # shard file names, in order (the index not included)
    tensors: int
    total_bytes: int  # tensor bytes written (the index's ``metadata.total_size``)
    tied: list[str]  # names dropped as ties of a name written
    seconds: float


class _Planned(NamedTuple):
    """A name to write, and the source it is read from first; `copies`: later sources holding it too."""

    named: Named
    source: int
    copies: list[tuple[int, Named]]


def _selected(sources: Sequence[Source], key: str | None, prefix: str) -> tuple[list[_Planned], list[str]]:
    """The tensors to write (names under `key`, `prefix` stripped, ties dropped) and the tied names."""
    planned: dict[str, _Planned] = {}
    tied: list[str] = []
    for s, source in enumerate(sources):
        first_of_alias: dict[object, str] = {}
        for n in source.tensors():
            name = n.name
            if key is not None:
                if name != key and not name.startswith(key + "."):
                    continue
                name = name[len(key) + 1 :]
            if prefix and name.startswith(prefix):
                name = name[len(prefix) :]
            if not name:
                raise FastPersistError(
                    f"{source.where}: key={key!r} names a single tensor; export_hf writes a model's named tensors "
                    "(pick the entry holding them)"
                )
            n = n._replace(name=name)
            if n.alias in first_of_alias:
                tied.append(name)
                log.debug("export: %s is tied to %s (the same bytes): written once", name, first_of_alias[n.alias])
                continue
            first_of_alias[n.alias] = name
            have = planned.get(name)
            if have is None:
                planned[name] = _Planned(n, s, [])
                continue
            if have.source == s:
                raise FastPersistError(f"{source.where}: two different tensors are named {shown(name)}")
            if (have.named.dtype, have.named.shape) != (n.dtype, n.shape):
                raise FastPersistError(
                    f"tensor {shown(name)} is {have.named.dtype}{list(have.named.shape)} in "
                    f"{sources[have.source].where} but {n.dtype}{list(n.shape)} in {source.where}: the shards "
                    "disagree on it"
                )
            have.copies.append((s, n))
    if key is not None and not planned:
        tops = sorted({n.name.split(".", 1)[0] for source in sources for n in source.tensors()})
        raise FastPersistError(
            f"no tensor under key={key!r} in {sources[0].where if sources else '?'}; its top-level entries "
            f"holding tensors: {', '.join(map(shown, tops[:20])) or 'none'}"
        )
    for p in planned.values():
        if p.named.dtype not in SAFETENSORS_DTYPES:
            raise FastPersistError(
                f"tensor {shown(p.named.name)} has dtype {p.named.dtype}, which safetensors cannot hold; convert it "
                "(e.g. to float32) before saving, or export a sub-tree without it (key=)"
            )
    return list(planned.values()), tied


def export_checkpoint(
    src: str | os.PathLike[str],
    outdir: str | os.PathLike[str],
    *,
    prefix: str = "",
    key: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    config: Config | None = None,
    durable: bool = True,
    pause: Callable[[], None] | None = None,
    open_sources: SourceOpener = opened_sources,
) -> ExportResult:
    """Writes the tensors of the checkpoint `src` as Hugging Face safetensors shards in `outdir`
    (:func:`fastpersist.export_hf`, which also takes a Checkpointer root, documents it all).

    `src`: a checkpoint directory (replicated or sharded; one written through DCP with
    :class:`~fastpersist.integrations.dcp.FastPersistWriter` is read through the DCP plug-in's
    `open_sources`). `key`: the sub-tree to export, by its dotted name (``"model"``); None: the
    whole state. `prefix`: stripped from each name that starts with it.
    `max_shard_bytes`: tensor bytes per shard file (``save_pretrained``'s 5 GB by default).
    `config`: the read's engine knobs (``stripes`` as for :func:`fastpersist.load`).
    `pause`: called before each tensor is written (a background export waits there while a
    save is staging). `open_sources`: how `src` is read, :func:`~.hfsources.opened_sources`
    (a fastpersist checkpoint) unless the caller knows better (``fp.export_hf`` passes the DCP
    plug-in's opener for a DCP-written checkpoint).
    Each file is written under a temporary name, fsynced (`durable`) and renamed; the index
    goes last, and files of an earlier export to `outdir` that this one does not write are
    removed, as are the temporary files of an export that was killed. Every chunk read is
    checksummed. See the module docstring for names and ties.

    Raises:
        ValueError: `outdir` is empty, is `src` or lies inside it, or is a committed checkpoint
            (:func:`check_outdir`), before anything is written.
        FastPersistError: no tensor under `key`; a dtype safetensors lacks; shards of a sharded
            checkpoint holding different values (or dtype, or shape) under one name.
        CorruptCheckpointError / ChecksumMismatchError: the checkpoint is damaged.

    Example:
        >>> res = export_checkpoint("/tmp/fp-doc-hf", "/tmp/fp-doc-hf-out2", key="model", max_shard_bytes=10)
        >>> res.files
        ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
    """
    started = time.perf_counter()
    source_path = os.path.abspath(os.fspath(src))
    out = os.path.abspath(given_path(outdir, "outdir", "export_hf", "a directory for the safetensors files"))
    check_outdir(source_path, out)
    with open_sources(source_path, config) as sources:
        planned, tied = _selected(sources, key, prefix)
        tensors = [OutTensor(p.named.name, p.named.dtype, p.named.shape) for p in planned]
        shards = plan_shards(tensors, max_shard_bytes)
        names = shard_names(len(shards))
        os.makedirs(out, exist_ok=True)
        remove_dead_tmp_files(out)  # an export killed before its renames left full-size shards
        # Each file under a temporary name until every shard is whole, then fsynced and renamed.
        with contextlib.ExitStack() as stack:
            files = []
            for name, shard in zip(names, shards, strict=True):
                files.append(
                    ShardFile(stack.enter_context(atomic_file(os.path.join(out, name), durable=durable)), shard)
                )
                stack.callback(files[-1].close)
            file_of = {t.name: f for f, shard in zip(files, shards, strict=True) for t in shard}
            _copy(sources, planned, file_of, pause or (lambda: None))
    total = sum(t.nbytes for t in tensors)
    if len(names) > 1:
        write_index(out, {t.name: n for n, shard in zip(names, shards, strict=True) for t in shard}, total, durable)
    for stale in stale_files(out, {*names, INDEX_NAME} if len(names) > 1 else set(names)):
        os.remove(stale)
    if durable:
        _core.fsync_dir(out)
    seconds = time.perf_counter() - started
    log.info("exported %d tensors (%d bytes) of %s to %s in %.2f s", len(tensors), total, source_path, out, seconds)
    return ExportResult(source_path, out, names, len(tensors), total, tied, seconds)


def check_outdir(source: str, out: str) -> None:
    """Refuses an export directory `out` that is the checkpoint `source` or lies inside it, or
    that is another committed checkpoint: the export's files would be written into a committed
    checkpoint's directory (a checkpoint *inside* `out` is safe: an export writes and removes
    only its own ``model*.safetensors`` names)."""
    real_source, real_out = os.path.realpath(source), os.path.realpath(out)
    if real_out == real_source or real_out.startswith(real_source.rstrip(os.sep) + os.sep):
        raise ValueError(
            f"export_hf(outdir={out!r}): it is, or lies inside, the checkpoint being exported ({source}); the "
            "export would write its files into that committed checkpoint. Choose a directory outside it"
        )
    if os.path.isfile(os.path.join(out, MANIFEST_NAME)):
        raise ValueError(
            f"export_hf(outdir={out!r}): it is a committed checkpoint (it holds {MANIFEST_NAME}); exporting "
            f"{source} there would write into it. Choose another directory"
        )


def _copy(
    sources: Sequence[Source], planned: list[_Planned], file_of: dict[str, ShardFile], pause: Callable[[], None]
) -> None:
    """Streams every planned tensor into its shard file; a copy in a later source is compared."""
    first: dict[int, list[Named]] = {}
    again: dict[int, list[Named]] = {}
    origin: dict[str, int] = {}
    for p in planned:
        first.setdefault(p.source, []).append(p.named)
        origin[p.named.name] = p.source
        for s, n in p.copies:
            again.setdefault(s, []).append(n)
    for s, source in enumerate(sources):
        repeated = {id(n) for n in again.get(s, [])}
        for n, values in source.stream(first.get(s, []) + again.get(s, [])):
            pause()
            f = file_of[n.name]
            if id(n) not in repeated:
                f.write(n.name, values)
                continue
            if not f.holds(n.name, values):
                raise FastPersistError(
                    f"tensor {shown(n.name)} differs between {sources[origin[n.name]].where} and {source.where}: "
                    "a sharded checkpoint's shards may hold one name only with the same values"
                )
