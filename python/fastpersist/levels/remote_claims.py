"""Configurations of a remote level that cannot work, refused when the Checkpointer is made.

* A remote directory that is the root, lies inside it, or holds it: the drain would read and
  write the same step directories (a step "committed already" on the remote before its drain,
  markers never written, ``close()`` waiting ``timeout_s`` per attempt), and the root's cleaning
  and retention would see the remote's files.
* One remote (a directory, or an ``s3://bucket/prefix``; or one nested in the other) for two
  roots at once in this process: each root's drains would retire the other's steps, and its
  restores would follow the other's index. A Checkpointer holds its remote from its making until
  :meth:`~fastpersist.Checkpointer.close` (again from its next save), or until it is garbage.

Two processes on one remote prefix cannot be seen from here; the run identity rule
(:mod:`fastpersist.levels.run_identity`) keeps either from restoring the other's steps.

Example:
    >>> remote_key("s3://bucket//runs/exp1/"), overlap("s3://b/runs", "s3://b/runs/exp1")
    ('s3://bucket/runs/exp1', True)
"""

from __future__ import annotations

import os
import re
import threading
import weakref
from typing import Any

from .host import LevelHost

__all__ = ["RemoteClaim", "claim_remote", "overlap", "remote_key"]

_holders: dict[str, tuple[str, weakref.ReferenceType[Any]]] = {}
_lock = threading.Lock()


def remote_key(target: str | os.PathLike[str]) -> str:
    """The remote as one string to compare: a URL without doubled or trailing slashes, or a
    directory's real path."""
    text = os.fspath(target)
    if "://" in text:
        scheme, _, rest = text.partition("://")
        return f"{scheme}://" + re.sub("/+", "/", rest).strip("/")
    return os.path.realpath(text)


def overlap(a: str, b: str) -> bool:
    """Whether the keys `a` and `b` name the same place or one lies inside the other."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


class RemoteClaim:
    """One Checkpointer's hold on its remote (see the module docstring)."""

    def __init__(self, host: LevelHost, key: str, target: str) -> None:
        self.root, self.key, self.target = host.root, key, target
        self._host = weakref.ref(host)

    def hold(self) -> None:
        """Takes the remote for this root (idempotent).

        Raises:
            ValueError: another live Checkpointer of another root in this process holds it,
                or a remote inside or around it.
        """
        with _lock:
            for key, (root, ref) in list(_holders.items()):
                holder = ref()
                if holder is None:
                    del _holders[key]
                elif overlap(key, self.key) and root != self.root:
                    raise ValueError(
                        f"Remote({self.target!r}) is the remote level of another root in this process ({root}: "
                        f"its remote {key}); two roots draining into one remote would retire each other's steps "
                        "and restore from each other's index. Give each root its own remote prefix, or close() "
                        "the other Checkpointer first"
                    )
            _holders[self.key] = (self.root, self._host)

    def release(self) -> None:
        """Lets go of the remote (at close(); a later save takes it again)."""
        with _lock:
            held = _holders.get(self.key)
            if held is not None and held[0] == self.root:
                del _holders[self.key]


def claim_remote(host: LevelHost, target: str | os.PathLike[str]) -> RemoteClaim:
    """Refuses a remote that overlaps `host`'s root, or that another root holds; returns the held claim.

    Raises:
        ValueError: naming both places and what to do instead.
    """
    text = os.fspath(target)
    key = remote_key(text)
    if "://" not in text:
        root = os.path.realpath(host.root)
        if overlap(key, root):
            where = "is" if key == root else "lies inside" if key.startswith(root) else "holds"
            raise ValueError(
                f"Remote({text!r}) {where} the root {host.root!r}: the remote level must be a place of its own "
                "(another filesystem, or at least a directory beside the root), or its drains would read and write the "
                "root's own step directories"
            )
    claim = RemoteClaim(host, key, text)
    claim.hold()
    return claim
