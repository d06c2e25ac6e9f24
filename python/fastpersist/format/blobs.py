"""Blobs: the contiguous runs of bytes a save writes, viewing tensor memory where they can.

`flatten` makes one per storage (or per tensor that cannot be viewed in place); a save stages
and writes them. Most tensors' bytes are viewed lazily, zero-copy, when first read.

Example:
    >>> import torch
    >>> blob = Blob(None, torch.ones(2), 0, 8)   # the lazy form flatten() uses
    >>> blob.nbytes, blob.data.view("<f4").tolist()
    (8, [1.0, 1.0])
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np
import torch

U8 = np.dtype(np.uint8)


class DeviceCopiers(Protocol):
    """Which tensors a save stages from their device instead of reading them on the host: the
    save's choice, handed to ``flatten(state, copiers=...)`` (``fastpersist.gpu.copiers.DEVICE_COPIERS``).
    The format keeps what it returns on the blob, and never looks inside."""

    @property
    def host_only(self) -> bool:
        """No CPU tensor is staged from a device: they are all read in place."""

    def __call__(self, tensor: torch.Tensor) -> object | None:
        """What stages `tensor` from its device (kept as ``Blob.device_copier``), or None."""


class Member(NamedTuple):
    """A tensor of a shared storage, as the mutation guard watches it."""

    record: int  # its record's index in the flat state
    tensor: torch.Tensor
    version: int  # its ``_version`` at flatten time


class Blob:
    """One contiguous run of bytes to write: a storage range or one tensor's values.

    `data` is a 1-D C-contiguous uint8 CPU array; it views the source memory when it can
    (contiguous CPU tensors and arrays), else it holds a copy. `source` keeps that memory alive
    and `version` (torch's `_version` at flatten time; None for numpy arrays, inference tensors
    and copies, which nothing can modify under a save) lets a save detect that the source was
    modified before its bytes were staged. A device tensor's blob stays on its device: where
    the save's :class:`DeviceCopiers` chose a copier for it, `device_copier` holds it and its
    bytes are never read on the host; else `data` copies it to the host when first read.

    A zero-copy view of a tensor is only built when `data` is first read (about 1 us per
    tensor, a third of flatten's cost on many small tensors): planning needs `nbytes` alone.

    Example:
        >>> from fastpersist.format.flatten import flatten
        >>> blob = flatten(torch.zeros(3)).blobs[0]
        >>> blob.nbytes, blob.data.dtype
        (12, dtype('uint8'))
    """

    __slots__ = ("_data", "device_copier", "members", "nbytes", "source", "version")

    def __init__(
        self,
        data: np.ndarray | None,
        source: torch.Tensor | np.ndarray | bytes,
        version: int | None,
        nbytes: int = -1,
        device_copier: object | None = None,
        members: tuple[Member, ...] = (),
    ) -> None:
        # flatten's native walk (rust/fastpersist-py/src/walk/tensor.rs) makes the blob of a plain
        # CPU tensor by setting these slots itself, as this does for Blob(None, x, version, nbytes):
        # keep the two in step (tests/format/test_native_walk.py compares them).
        self._data = data
        self.source = source
        self.version = version
        self.nbytes = data.nbytes if data is not None else nbytes
        #: For a device-resident blob (`source` a contiguous device tensor): what stages it, as
        #: the save's DeviceCopiers chose (opaque here); its bytes are never read on the host.
        self.device_copier = device_copier
        #: For a storage shared by several tensors: each of them with its version at flatten
        #: time. Tensors of one storage need not share a version counter (``p.data = buf[a:b]``
        #: gives ``p`` its own), so a watched blob is unchanged only if every member is.
        self.members = members

    @property
    def source_tensor(self) -> torch.Tensor:
        """`source` where it is a tensor (every blob of a torch tensor, device-resident ones included)."""
        source = self.source
        if not isinstance(source, torch.Tensor):
            raise TypeError(f"this blob's source is a {type(source).__name__}, not a tensor")
        return source

    @property
    def data(self) -> np.ndarray:
        """The blob's bytes on the host (a view of the source where it can be)."""
        if self.device_copier is not None:
            raise RuntimeError("a device-resident blob has no host bytes; its copier stages it")
        if self._data is None:
            # Only left unset for a non-empty contiguous plain tensor (_Walker._tensor); no
            # isinstance here: this runs once per tensor of the state, on the save call's path.
            source = self.source
            if not source.is_cpu:  # type: ignore[union-attr]  # a device tensor without a copier
                source = source.cpu()  # type: ignore[union-attr]
            data = byte_view(source)  # type: ignore[arg-type]
            if data.nbytes != self.nbytes:
                raise RuntimeError(
                    f"a tensor of {data.nbytes} bytes was resized from {self.nbytes} bytes between "
                    "flatten() and reading its data; do not resize tensors while a save is staging"
                )
            self._data = data
        return self._data

    def __repr__(self) -> str:
        return f"Blob(nbytes={self.nbytes}, source={type(self.source).__name__}, version={self.version})"


class _TensorBytes:
    """A tensor's bytes as numpy sees them through ``__array_interface__``: the array keeps this
    object, and so the tensor, alive. ``Tensor.numpy()`` would mark the storage non-resizable
    for the rest of its life, and a save must leave the user's tensors as it found them."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, t: torch.Tensor, nbytes: int) -> None:
        self.tensor = t
        self.__array_interface__ = {"data": (t.data_ptr(), False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


def byte_view(t: torch.Tensor) -> np.ndarray:
    """A 1-D uint8 numpy view of a contiguous plain CPU tensor's bytes, of any dtype.

    The tensor is left as it was (its storage stays resizable); resizing it while the view is
    read is the caller's to prevent, as for any write to a tensor a save is staging.
    """
    # "contiguous" allows any stride on a dimension of size 1: the bytes still run unbroken
    # from data_ptr(), the address of the tensor's first element.
    return np.asarray(_TensorBytes(t, t.numel() * t.element_size()))
