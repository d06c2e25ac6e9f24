"""Reading the DCP plug-in's ``.metadata`` as hostile input: a pickle, so an allow-list decides
which classes it may name, and nothing else from the file runs.

Example:
    >>> import os, pickle, tempfile
    >>> d = tempfile.mkdtemp()
    >>> with open(os.path.join(d, ".metadata"), "wb") as f:
    ...     pickle.dump(os.system, f)
    >>> read_dcp_metadata(d)
    Traceback (most recent call last):
    ...
    fastpersist.errors.CorruptCheckpointError: DCP metadata refers to 'posix.system', which a checkpoint never needs
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ..errors import CorruptCheckpointError
from ..format.layout import DCP_METADATA_NAME, read_small_file
from ..format.quote import shown

__all__ = ["read_dcp_metadata"]

#: Where FastPersistWriter's per-item record (``ItemInfo``) lives, as the pickle names it.
#: DCP's metadata of a state of millions of tensors is still far smaller.
MAX_METADATA_BYTES = 1 << 30
ITEM_INFO = ("fastpersist.integrations.dcp", "ItemInfo")


class _MetadataUnpickler(pickle.Unpickler):
    """Only DCP's data classes, ``ItemInfo``, torch dtypes / sizes / layouts / memory formats
    and a few builtins may appear."""

    _BUILTINS = frozenset({"set", "frozenset", "slice", "tuple", "list", "dict", "bytearray", "complex"})

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint.") or (module, name) == ITEM_INFO:
            return super().find_class(module, name)
        if (module, name) == ("torch.serialization", "_get_layout"):  # a name -> torch.layout lookup
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if value is torch.Size or isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        if (module, name) in {("collections", "OrderedDict"), ("builtins", name)} and (
            module != "builtins" or name in self._BUILTINS
        ):
            return super().find_class(module, name)
        raise CorruptCheckpointError(
            f"DCP metadata refers to {shown(f'{module}.{name}')}, which a checkpoint never needs"
        )


def read_dcp_metadata(directory: str) -> Metadata:
    """The ``Metadata`` of the DCP checkpoint in `directory`, read with the allow-list above;
    :class:`CorruptCheckpointError` for anything FastPersistWriter did not write."""
    path = os.path.join(directory, DCP_METADATA_NAME)
    raw = read_small_file(path, limit_bytes=MAX_METADATA_BYTES)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
        raise CorruptCheckpointError(f"{path}: unreadable DCP metadata ({e})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CorruptCheckpointError(f"{path}: not a checkpoint written by FastPersistWriter")
    return metadata
