"""A checkpoint named by an ``s3://`` URL, for :func:`fastpersist.load`, ``inspect`` and
``verify``: fetched into a temporary directory (every chunk checked on the way) and read from
there, or checked where it is with ranged reads.

Example:
    >>> split_url("s3://bucket/runs/exp1/step-00000010")
    ('s3://bucket/runs/exp1', 'step-00000010')
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from ..errors import CheckpointNotFoundError
from ..format.layout import MANIFEST_NAME, write_new_file
from ..format.manifest import Manifest, parse
from .remote_steps import files_named
from .remote_stores import S3Store

__all__ = ["fetched", "is_url", "split_url", "verify_url"]


def is_url(path: object) -> bool:
    """Whether `path` names a checkpoint in an object store."""
    return isinstance(path, str) and path.startswith("s3://")


def split_url(url: str) -> tuple[str, str]:
    """``(the store's URL, the checkpoint's name in it)``."""
    parent, _, name = url.rstrip("/").rpartition("/")
    if not name or parent.endswith(":/") or parent == "s3:/":
        raise ValueError(f"{url!r}: expected s3://bucket/[prefix/]checkpoint")
    return parent, name


def _manifest(store: S3Store, name: str) -> tuple[bytes, Manifest]:
    key = f"{name}/{MANIFEST_NAME}"
    raw = store.get_bytes(key)
    if raw is None:
        raise CheckpointNotFoundError(2, "no manifest: not a committed fastpersist checkpoint", store.where(key))
    return raw, parse(raw, where=store.where(key))


@contextlib.contextmanager
def fetched(url: str, *, data: bool = True) -> Iterator[str]:
    """Yields a temporary local copy of the checkpoint at `url` (manifests only unless `data`)."""
    parent, name = split_url(url)
    store = S3Store(parent)
    raw, m = _manifest(store, name)
    tmp = tempfile.mkdtemp(prefix="fastpersist-fetch-")
    try:
        local = os.path.join(tmp, name)
        os.mkdir(local)
        for f in files_named(store, name, m):
            dest = os.path.join(local, f.name)
            if data or os.path.basename(f.name) == MANIFEST_NAME:
                store.download(f"{name}/{f.name}", dest, f)
        write_new_file(os.path.join(local, MANIFEST_NAME), raw, durable=False)
        yield local
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def verify_url(url: str) -> dict[str, Any]:
    """:func:`fastpersist.verify` of a checkpoint in an object store: ranged reads, every chunk checked."""
    parent, name = split_url(url)
    store = S3Store(parent)
    _, m = _manifest(store, name)
    files = chunks = nbytes = 0
    for f in files_named(store, name, m):
        if os.path.basename(f.name) == MANIFEST_NAME:
            continue
        files += 1
        chunks += len(f.chunk_crc32c)
        for lo, hi, _ in store.read_pieces(f"{name}/{f.name}", f):
            nbytes += hi - lo
    return {"files": files, "bytes": nbytes, "chunks": chunks}
