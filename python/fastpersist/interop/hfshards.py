"""Writing Hugging Face sharded safetensors: the shard plan, each shard file, the index.

The layout is what ``transformers``' ``save_pretrained`` writes: ``model.safetensors`` when
everything fits in one shard, else ``model-00001-of-0000N.safetensors`` files of at most
`max_shard_bytes` of tensor data each (a tensor larger than that gets a shard of its own),
filled in order, and ``model.safetensors.index.json`` with ``metadata.total_size`` and the
``weight_map`` (tensor name -> shard file).

A shard's header (JSON: each tensor's dtype, shape and byte range) is known before any tensor
byte is read, so the file is created at its final size with its header, and each tensor's bytes
are written at their offset (``pwrite``) as they arrive, in any order: a tensor is never held longer than
its read window. Within a shard, tensors are laid out by decreasing element size, as
safetensors' own writer does, so every tensor starts aligned to its element size.

Example:
    >>> t = [OutTensor("a", torch.float32, (4,)), OutTensor("b", torch.float32, (2,))]
    >>> [[x.name for x in s] for s in plan_shards(t, max_shard_bytes=16)]
    [['a'], ['b']]
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import NamedTuple

import torch

from ..format.blobs import byte_view
from ..format.layout import atomic_file

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_NAME",
    "SAFETENSORS_DTYPES",
    "SINGLE_NAME",
    "OutTensor",
    "ShardFile",
    "plan_shards",
    "shard_names",
    "write_index",
]

#: ``save_pretrained``'s default ``max_shard_size="5GB"`` (decimal).
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
#: torch dtype -> the name in a safetensors header (the dtypes safetensors can hold).
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    getattr(torch, name): code
    for name, code in (
        ("float64", "F64"),
        ("float32", "F32"),
        ("float16", "F16"),
        ("bfloat16", "BF16"),
        ("int64", "I64"),
        ("int32", "I32"),
        ("int16", "I16"),
        ("int8", "I8"),
        ("uint8", "U8"),
        ("bool", "BOOL"),
        ("uint16", "U16"),
        ("uint32", "U32"),
        ("uint64", "U64"),
        ("complex64", "C64"),
        ("float8_e4m3fn", "F8_E4M3"),
        ("float8_e5m2", "F8_E5M2"),
        ("float8_e8m0fnu", "F8_E8M0"),
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}


class OutTensor(NamedTuple):
    """One tensor of the export: its name in the files, dtype and shape (stored C-contiguous)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count * self.dtype.itemsize


def plan_shards(tensors: list[OutTensor], max_shard_bytes: int) -> list[list[OutTensor]]:
    """`tensors` cut, in order, into shards of at most `max_shard_bytes` of data (a larger
    tensor alone in its shard), as ``huggingface_hub``'s state-dict splitter does."""
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r}: expected a positive byte count")
    shards: list[list[OutTensor]] = []
    current: list[OutTensor] = []
    used = 0
    for t in tensors:
        if current and used + t.nbytes > max_shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(t)
        used += t.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    """The file names of `count` shards, as ``save_pretrained`` names them."""
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _header(tensors: list[OutTensor]) -> tuple[bytes, dict[str, int]]:
    """The header bytes (length prefix included, padded to 8) and each tensor's file offset."""
    order = sorted(tensors, key=lambda t: -t.dtype.itemsize)  # stable: the plan's order within a size
    doc: dict[str, object] = {"__metadata__": {"format": "pt"}}
    spans: dict[str, int] = {}
    at = 0
    for t in order:
        code = SAFETENSORS_DTYPES[t.dtype]
        doc[t.name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
        spans[t.name] = at
        at += t.nbytes
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = len(text).to_bytes(8, "little") + text
    return head, {name: len(head) + offset for name, offset in spans.items()}


class ShardFile:
    """One safetensors file being written at `path` (a temporary name: the caller renames it into
    place, e.g. with :func:`~fastpersist.format.layout.atomic_file`): created whole, header first;
    :meth:`write` puts a tensor's bytes at its offset."""

    def __init__(self, path: str, tensors: list[OutTensor]) -> None:
        head, self.offsets = _header(tensors)
        self.sizes = {t.name: t.nbytes for t in tensors}
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.ftruncate(self._fd, len(head) + sum(self.sizes.values()))
            _pwrite_all(self._fd, memoryview(head), 0)
        except BaseException:
            self.close()
            raise

    def write(self, name: str, data: torch.Tensor) -> None:
        """Writes `data` (a contiguous CPU tensor of `name`'s dtype and shape) at `name`'s offset."""
        raw = _bytes_of(data)
        if len(raw) != self.sizes[name]:
            raise AssertionError(f"{name}: {len(raw)} bytes for a tensor of {self.sizes[name]}")
        _pwrite_all(self._fd, raw, self.offsets[name])

    def holds(self, name: str, data: torch.Tensor) -> bool:
        """Whether the bytes written for `name` are those of `data` (a later copy of the tensor)."""
        return os.pread(self._fd, self.sizes[name], self.offsets[name]) == bytes(_bytes_of(data))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _bytes_of(t: torch.Tensor) -> memoryview:
    return byte_view(t.detach().reshape(-1)).data


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """os.pwrite until every byte is written (short writes are normal)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def write_index(outdir: str, weight_map: dict[str, str], total_bytes: int, durable: bool) -> None:
    """Writes ``model.safetensors.index.json`` (atomically) as ``save_pretrained`` does."""
    doc = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    with atomic_file(os.path.join(outdir, INDEX_NAME), durable=durable) as tmp, open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def stale_files(outdir: str, keep: set[str]) -> Iterator[str]:
    """Files of an earlier export in `outdir` that this one does not write (removed after it)."""
    for name in os.listdir(outdir):
        if name in keep:
            continue
        if name == SINGLE_NAME or name == INDEX_NAME or (name.startswith("model-") and name.endswith(".safetensors")):
            yield os.path.join(outdir, name)
