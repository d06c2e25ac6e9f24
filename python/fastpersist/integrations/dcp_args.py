"""``FileSystemWriter``/``FileSystemReader``'s arguments as the DCP plug-in takes them: each is
turned into the engine's :class:`~fastpersist.Config`, checked and kept, or refused with why.

Example:
    >>> writer_config(None, sync_files=False, thread_count=4, per_thread_copy_ahead=0, extensions=None).durable
    False
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..config import Config
from ..format.layout import DCP_METADATA_NAME

__all__ = ["checked_config", "refuse_rank_local_metadata", "writer_config"]


def checked_config(config: object, ours: str, theirs: str) -> Config:
    """`config`, or the default; a TypeError for anything else (torch's positional arguments)."""
    if config is None:
        return Config()
    if not isinstance(config, Config):
        raise TypeError(
            f"{ours}(path, config): config must be a fastpersist.Config, not {type(config).__name__}; "
            f"pass {theirs}'s other arguments by keyword"
        )
    return config


def writer_config(
    config: object,
    sync_files: bool | None,
    thread_count: int,
    per_thread_copy_ahead: int,
    extensions: Sequence[object] | None,
) -> Config:
    """The engine config of a FastPersistWriter given ``FileSystemWriter``'s arguments:
    ``sync_files`` is ``durable``; the counts are checked; stream transforms are refused."""
    config = checked_config(config, "FastPersistWriter", "FileSystemWriter")
    if extensions:
        names = ", ".join(type(e).__name__ for e in extensions)
        raise NotImplementedError(
            f"FastPersistWriter(_extensions=[{names}]): stream transforms such as compression are not "
            "supported: items are stored as raw aligned bytes checksummed per chunk, so that a load reads "
            "only the byte ranges it needs, and a transformed stream has no such ranges; use "
            "torch.distributed.checkpoint.FileSystemWriter for a compressed checkpoint"
        )
    if sync_files is not None:
        if sync_files and not config.durable:  # durable=False is never a default: both were chosen
            raise ValueError(
                "FastPersistWriter(sync_files=True) contradicts config.durable=False: they are one switch "
                "(fsync before the save returns); give one of them"
            )
        config = dataclasses.replace(config, durable=bool(sync_files))
    for name, value, least in (("thread_count", thread_count, 1), ("per_thread_copy_ahead", per_thread_copy_ahead, 0)):
        if type(value) is not int or value < least:
            raise ValueError(f"FastPersistWriter({name}={value!r}): expected an integer >= {least}")
    return config


def refuse_rank_local_metadata(use_collectives: object) -> None:
    """``dcp.save(use_collectives=False)`` on several ranks: each rank would commit the one
    ``.metadata`` alone (and remove the others' files as stale), so it is refused."""
    if use_collectives is False and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        raise NotImplementedError(
            "dcp.save(use_collectives=False) with FastPersistWriter on several ranks: rank-local metadata "
            f"is not supported, as the writer commits one {DCP_METADATA_NAME} for all ranks; "
            "save with use_collectives=True (the default), or give each rank its own directory"
        )
