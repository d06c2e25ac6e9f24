"""Which chunk size and queue depths a bench run uses, and where they came from.

``--chunk-bytes``/``--queue-depth`` default to ``"auto"``, settled here once for the first
run directory's device exactly as a save and a load settle them (:mod:`fastpersist.tuning`):
from ``fastpersist tune``'s cache, else the defaults. The run's report and table say which.

Example:
    >>> settings_line({"chunk_bytes": 8 << 20, "queue_depth": 8, "read_queue_depth": 8,
    ...                "settings_source": {"write": "default", "read": "default"}})
    'settings: chunk 8 MiB, write depth 8 (default); read depth 8 (default)'
"""

from __future__ import annotations

import argparse
from typing import Any

from ...config import Config, resolve

__all__ = ["settings_line", "settle_settings"]


def settle_settings(args: argparse.Namespace, directory: str) -> str:
    """Replaces ``"auto"`` in `args` by the settings for `directory`'s device (adding
    ``read_queue_depth``, ``write_source``, ``read_source``); returns the line that says so."""

    asked = Config(chunk_bytes=args.chunk_bytes, queue_depth=args.queue_depth, pool_bytes=args.pool_bytes)
    write = resolve(asked, directory, "write")
    read = resolve(asked, directory, "read")
    args.chunk_bytes = write.config.resolved_chunk_bytes
    args.queue_depth = write.config.resolved_queue_depth
    args.read_queue_depth = read.config.resolved_queue_depth
    args.write_source, args.read_source = write.source, read.source
    return settings_line(
        {
            "chunk_bytes": args.chunk_bytes,
            "queue_depth": args.queue_depth,
            "read_queue_depth": args.read_queue_depth,
            "settings_source": {"write": write.source, "read": read.source},
        }
    )


def settings_line(config: dict[str, Any]) -> str:
    """One line naming the settings of a run and their origin (a report's ``config``)."""
    source = config["settings_source"]
    return (
        f"settings: chunk {config['chunk_bytes'] / 2**20:g} MiB, write depth {config['queue_depth']} "
        f"({source['write']}); read depth {config['read_queue_depth']} ({source['read']})"
    )
