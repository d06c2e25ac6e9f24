"""The filesystem and block device under a directory, as the kernel reports them.

Two sources, each a parameter so that tests can point it at a fake tree:
``/proc/self/mountinfo`` (which mount holds a path: filesystem type, mount point, options) and
sysfs (``/sys/dev/block/MAJ:MIN`` -> the device's node; for a partition, the whole disk is its
parent, whose ``queue/`` and ``device/`` describe the drive). The advisor's device facts
(:mod:`fastpersist.advisor.devinfo`) and the tuning cache's device identity
(:mod:`fastpersist.tuning.identity`) both read them here.

Example:
    >>> import os
    >>> mount_of("/", os.stat("/").st_dev, "/proc/self/mountinfo")[1]   # doctest: +SKIP
    '/'
"""

from __future__ import annotations

import os
from typing import NamedTuple

__all__ = ["BlockNode", "block_node", "mount_of", "sysfs_text"]


def sysfs_text(path: str) -> str | None:
    """The stripped text of a small kernel file (a sysfs attribute, mountinfo); None when it is
    missing, unreadable or empty: an empty attribute reports nothing."""
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def mount_of(path: str, dev: int, mountinfo: str) -> tuple[str | None, str | None, list[str]]:
    """(fs type, mount point, options) of the mount holding `path`: same device, longest prefix."""
    text = sysfs_text(mountinfo) or ""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    best: tuple[int, bool, str, str, list[str]] | None = None
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 6 or len(tail) < 2:
            continue
        point = fields[4].replace("\\040", " ")
        if not (path == point or path.startswith(point.rstrip("/") + "/")):
            continue
        options = list(dict.fromkeys(fields[5].split(",") + (tail[2].split(",") if len(tail) > 2 else [])))
        key = (len(point), fields[2] == want, tail[0], point, options)
        if best is None or key[:2] > best[:2]:
            best = key
    return (best[2], best[3], best[4]) if best else (None, None, [])


class BlockNode(NamedTuple):
    """Where sysfs describes a block device: its own node and its whole disk's directory."""

    #: The device's directory (``.../nvme0n1/nvme0n1p2``; the disk itself when not a partition).
    node: str
    #: The whole disk's directory: the parent of a partition, else `node`.
    disk_dir: str


def block_node(dev: int, sysfs: str) -> BlockNode | None:
    """The sysfs directories of block device `dev` (a ``st_dev``); None when `dev` is not a
    block device (major 0: tmpfs, overlay, NFS) or sysfs does not list it."""
    link = os.path.join(sysfs, "dev", "block", f"{os.major(dev)}:{os.minor(dev)}")
    if os.major(dev) == 0 or not os.path.exists(link):
        return None
    node = os.path.realpath(link)
    disk_dir = os.path.dirname(node) if os.path.exists(os.path.join(node, "partition")) else node
    return BlockNode(node, disk_dir)
