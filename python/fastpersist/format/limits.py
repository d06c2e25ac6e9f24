"""The bounds a reader puts on a manifest, in one place: load enforces them and save checks them.

A checkpoint that commits but can never load is worse than a save that fails (with
``Checkpointer(keep=1)`` the previous step is already gone), so every limit the reader applies
to a manifest field is defined here and checked by the save path before anything is committed:
the manifest's size (:func:`check_manifest_size`, called by ``manifest.build``), the nesting
depth, tensor dimensions, namedtuple names and fields (``flatten``).

Example:
    >>> check_manifest_size(b"{}" * 10, {"spec_version": 1, "root": None}, [])
    >>> MAX_MANIFEST_BYTES >> 30, MAX_DEPTH, MAX_DIMS
    (1, 200, 64)
"""

from __future__ import annotations

import heapq
import json
import keyword
from typing import Any

from ..errors import UnsupportedValueError
from .quote import shown

__all__ = [
    "MAX_BYTES",
    "MAX_DEPTH",
    "MAX_DIMS",
    "MAX_EXTENT",
    "MAX_MANIFEST_BYTES",
    "MAX_NTUPLE_FIELDS",
    "MAX_NTUPLE_NAME_CHARS",
    "check_manifest_size",
    "largest_values",
    "namedtuple_problem",
]

#: A manifest larger than this is refused before parsing (a hostile file could be huge), and a
#: save whose manifest would be larger fails before it commits.
MAX_MANIFEST_BYTES = 1 << 30
#: Offsets and lengths past this are refused (no file system holds an exabyte file).
MAX_BYTES = 1 << 60
# Python's json encoder and decoder recurse (two levels per container), so a deeper state
# could be written but not read back; no real training state comes close.
MAX_DEPTH = 200
#: Dimensions of a tensor record or a torch.Size leaf (numpy's own limit).
MAX_DIMS = 64
#: Elements along one dimension, and in all.
MAX_EXTENT = 1 << 62
#: A namedtuple's fields (building its class costs time linear in them) and its name's length.
MAX_NTUPLE_FIELDS = 4096
MAX_NTUPLE_NAME_CHARS = 256

_CONTRIBUTORS_SHOWN = 5


def namedtuple_problem(name: object, fields: object) -> str | None:
    """Why a reader refuses a namedtuple with this qualified name and these fields, or None.

    Fields must be distinct public identifiers (``_make`` and friends start with ``_``, so a
    ``rename=True`` field like ``_0`` is refused), at most :data:`MAX_NTUPLE_FIELDS` of them.

    Example:
        >>> namedtuple_problem("Point", ["x", "y"]) is None, namedtuple_problem("P", ["_0"]) is None
        (True, False)
    """
    if not isinstance(name, str) or len(name) > MAX_NTUPLE_NAME_CHARS:
        return f"namedtuple 'module' and 'name' must be strings, the name at most {MAX_NTUPLE_NAME_CHARS} characters"
    if not (
        type(fields) is list
        and len(fields) <= MAX_NTUPLE_FIELDS
        and all(
            type(f) is str and f.isidentifier() and not f.startswith("_") and not keyword.iskeyword(f) for f in fields
        )
        and len(set(fields)) == len(fields)
    ):
        return f"namedtuple 'fields' must be at most {MAX_NTUPLE_FIELDS} distinct identifiers not starting with '_'"
    return None


def check_manifest_size(manifest: bytes, tree: dict[str, Any], tensors: list[dict[str, Any]]) -> None:
    """Refuses a manifest that a reader would refuse as too large, naming what made it so.

    Raises:
        UnsupportedValueError: `manifest` exceeds :data:`MAX_MANIFEST_BYTES`; the message names
            the limit, the largest values in the state by key path, and the tensor records' share.
    """
    if len(manifest) <= MAX_MANIFEST_BYTES:
        return
    largest = ", ".join(f"{shown(path)} ({nbytes} bytes)" for nbytes, path in largest_values(tree))
    records = len(json.dumps(tensors, separators=(",", ":")))
    raise UnsupportedValueError(
        f"the manifest of this save would be {len(manifest)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit "
        f"(MAX_MANIFEST_BYTES) that load enforces, so the checkpoint could never be loaded; nothing was "
        f"committed. Largest values: {largest or 'none'}; {len(tensors)} tensor records take {records} bytes. "
        "Store large values as tensors (bytes over 4 KiB already are), or split the state"
    )


def largest_values(tree: dict[str, Any], count: int = _CONTRIBUTORS_SHOWN) -> list[tuple[int, str]]:
    """The `count` largest non-container leaves of a flattened tree: ``(JSON bytes, key path)``."""
    found: list[tuple[int, str]] = []
    stack: list[tuple[object, str]] = [(tree.get("root"), "state")]
    while stack:
        node, path = stack.pop()
        tag = node.get("t") if isinstance(node, dict) else None
        if tag in ("dict", "odict"):
            assert isinstance(node, dict)
            stack.extend((value, _child_path(path, key)) for key, value in zip(node["k"], node["v"], strict=True))
        elif tag in ("list", "tuple", "ntuple"):
            assert isinstance(node, dict)
            stack.extend((value, f"{path}[{i}]") for i, value in enumerate(node["v"]))
        elif tag != "tensor":  # a tensor node is a reference of a few bytes
            nbytes = len(json.dumps(node, separators=(",", ":")))
            found = heapq.nlargest(count, [*found, (nbytes, path)])
    return found


def _child_path(path: str, key: object) -> str:
    return f"{path}.{key}" if isinstance(key, str) and key.isidentifier() else f"{path}[{shown(key)}]"
