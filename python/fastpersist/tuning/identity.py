"""Which device a directory is on, as the tuning cache keys it.

The key is the filesystem's block device number (``MAJ:MIN`` of ``st_dev``); the identity
around it (filesystem type, and from sysfs the disk's model and serial number) tells a cached
entry apart from another device that got the same number later (a replaced drive, a
re-created volume). Filesystems without a block device (tmpfs, overlay, NFS: major 0) get a
number at mount time, so their mount point is part of the identity too.

Example:
    >>> ident = device_identity("/")            # doctest: +SKIP
    >>> ident.key, ident.fs_type, ident.disk    # doctest: +SKIP
    ('254:0', 'ext4', 'vda')
"""

from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass
from typing import Any

from ..blockdev import block_node, mount_of, sysfs_text

__all__ = ["DeviceIdentity", "device_identity"]


@dataclass(frozen=True)
class DeviceIdentity:
    """The device under a directory (None: not reported by the kernel).

    Attributes:
        key: ``"MAJ:MIN"`` of the filesystem's device: the cache's key.
        fs_type: filesystem type (ext4, xfs, tmpfs, ...).
        mount_point: where that filesystem is mounted (identity only for major 0).
        disk: the whole disk (``nvme0n1``, ``vda``), the parent of a partition.
        model: the disk's model string from sysfs.
        serial: the disk's serial number (or WWID) from sysfs.
    """

    key: str
    fs_type: str | None = None
    mount_point: str | None = None
    disk: str | None = None
    model: str | None = None
    serial: str | None = None

    def matches(self, recorded: dict[str, Any]) -> bool:
        """Whether `recorded` (a cache entry's ``device``) names this same device."""
        fields = ["key", "fs_type", "disk", "model", "serial"]
        if self.key.startswith("0:"):
            fields.append("mount_point")
        return all(recorded.get(name) == getattr(self, name) for name in fields)

    def describe(self) -> str:
        """A short human name: ``vda (254:0, ext4)``, with the model where known."""
        name = self.disk or self.mount_point or "?"
        model = f" {self.model}" if self.model else ""
        return f"{name}{model} ({self.key}, {self.fs_type or 'unknown fs'})"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _existing(path: str) -> str:
    """`path`, or its nearest existing ancestor (a save's target need not exist yet)."""
    path = os.path.realpath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


_known: dict[tuple[int, str, str], DeviceIdentity] = {}
_known_lock = threading.Lock()


def _identify(dev: int, path: str, sysfs: str, mountinfo: str) -> DeviceIdentity:
    fs_type, point, _ = mount_of(path, dev, mountinfo)
    key = f"{os.major(dev)}:{os.minor(dev)}"
    found = block_node(dev, sysfs)
    if found is None:
        return DeviceIdentity(key=key, fs_type=fs_type, mount_point=point)
    disk_dir = found.disk_dir
    dev_dir = os.path.join(disk_dir, "device")
    serial = (  # NVMe and SCSI: device/serial or wwid; virtio-blk: the disk's own serial
        sysfs_text(os.path.join(dev_dir, "serial"))
        or sysfs_text(os.path.join(disk_dir, "serial"))
        or sysfs_text(os.path.join(dev_dir, "wwid"))
    )
    return DeviceIdentity(
        key=key,
        fs_type=fs_type,
        mount_point=point,
        disk=os.path.basename(disk_dir),
        model=sysfs_text(os.path.join(dev_dir, "model")),
        serial=serial,
    )


def device_identity(
    path: str | os.PathLike[str], *, sysfs: str = "/sys", mountinfo: str = "/proc/self/mountinfo"
) -> DeviceIdentity:
    """The device holding `path` (or its nearest existing ancestor). Remembered per device
    number for the life of the process, so a save looks it up without rereading sysfs."""
    real = _existing(os.fspath(path))
    memo = (os.stat(real).st_dev, sysfs, mountinfo)
    with _known_lock:
        found = _known.get(memo)
    if found is None:
        found = _identify(memo[0], real, sysfs, mountinfo)
        with _known_lock:
            _known[memo] = found
    return found
