"""What "durable" means for a directory: its filesystem, block device, write cache and FUA.

Everything comes from the kernel's own view, read through :mod:`fastpersist.blockdev`:
``/proc/self/mountinfo`` (filesystem, mount options) and sysfs (``/sys/dev/block/MAJ:MIN`` ->
the device; for a partition the ``queue/`` directory is its parent disk's).
``queue/write_cache`` says whether the kernel treats the device as having a volatile write
cache ("write back") or not ("write through"); ``queue/fua`` whether it accepts
Force-Unit-Access writes. An attribute that is missing or empty is not reported (None). Both
roots are parameters so tests can point them at a fake tree.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any

from ..blockdev import block_node, mount_of, sysfs_text

__all__ = ["DeviceInfo", "device_info"]

_MEMORY_FS = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"}
_NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "fuse", "fuse.sshfs", "ceph", "lustre", "gpfs", "9p", "virtiofs"}


@dataclass(frozen=True)
class DeviceInfo:
    """The storage under one directory, as the kernel reports it (None: not reported).

    Attributes:
        path: the directory asked about.
        fs_type: filesystem type (ext4, xfs, tmpfs, ...).
        mount_point: where that filesystem is mounted.
        mount_options: its mount options (``nobarrier`` matters).
        device: the block device holding it (``nvme0n1p2``, ``vda``, ``dm-0``), if any.
        disk: the whole disk whose ``queue/`` applies (the parent of a partition).
        write_cache: ``"write back"`` (volatile cache) or ``"write through"``.
        fua: the device accepts Force-Unit-Access writes.
        rotational: a spinning disk.
        capacity_bytes: the disk's size.
        model: the disk's model string.
        nvme: the disk is an NVMe namespace.
        percent_used: NVMe "percentage used" from ``nvme smart-log`` where that tool works.
        slaves: the devices under a device-mapper or md device.
        durability: what a completed ``fsync`` means here, in words.
    """

    path: str
    fs_type: str | None = None
    mount_point: str | None = None
    mount_options: list[str] = field(default_factory=list)
    device: str | None = None
    disk: str | None = None
    write_cache: str | None = None
    fua: bool | None = None
    rotational: bool | None = None
    capacity_bytes: int | None = None
    model: str | None = None
    nvme: bool = False
    percent_used: float | None = None
    slaves: list[str] = field(default_factory=list)
    durability: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _nvme_percent_used(disk: str) -> float | None:
    """NVMe SMART "percentage used" through the ``nvme`` tool, where installed and permitted."""
    tool = shutil.which("nvme")
    if tool is None:
        return None
    try:
        done = subprocess.run(
            [tool, "smart-log", f"/dev/{disk}", "-o", "json"], capture_output=True, text=True, timeout=5, check=False
        )
        value = json.loads(done.stdout).get("percent_used")
    except (OSError, subprocess.SubprocessError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def _block_facts(dev: int, sysfs: str) -> dict[str, Any]:
    """The sysfs facts of block device `dev` (empty when it is not a block device)."""
    found = block_node(dev, sysfs)
    if found is None:
        return {}
    node, disk_dir = found
    disk = os.path.basename(disk_dir)
    q = os.path.join(disk_dir, "queue")
    sectors = sysfs_text(os.path.join(disk_dir, "size"))
    fua = sysfs_text(os.path.join(q, "fua"))
    rotational = sysfs_text(os.path.join(q, "rotational"))
    try:
        slaves = sorted(os.listdir(os.path.join(node, "slaves")))
    except OSError:
        slaves = []
    return {
        "device": os.path.basename(node),
        "disk": disk,
        "write_cache": sysfs_text(os.path.join(q, "write_cache")),
        "fua": None if fua is None else fua == "1",
        "rotational": None if rotational is None else rotational == "1",
        "capacity_bytes": int(sectors) * 512 if sectors and sectors.isdigit() else None,
        "model": sysfs_text(os.path.join(disk_dir, "device", "model")),
        "nvme": disk.startswith("nvme"),
        "slaves": slaves,
    }


def _durability(fs_type: str | None, options: list[str], facts: dict[str, Any]) -> str:
    """What a completed fsync means, from the filesystem and the device's cache, in words."""
    if fs_type in _MEMORY_FS:
        return f"{fs_type} lives in memory: nothing written here survives a reboot or power loss"
    if not facts:
        kind = "a network or FUSE filesystem" if fs_type in _NETWORK_FS else "not on a local block device"
        return f"{fs_type or 'unknown filesystem'} is {kind}: fsync is passed on; durability is what the server gives"
    if "nobarrier" in options or "barrier=0" in options:
        return "mounted with nobarrier: fsync does NOT flush the drive's volatile cache; a power loss can lose data"
    disk = facts["disk"]
    cache = facts.get("write_cache")
    if cache == "write through":
        text = f"{disk} reports no volatile write cache: a completed write is on stable media; fsync needs no flush"
    elif cache == "write back":
        how = "FUA writes" if facts.get("fua") else "a flush after the write (no FUA)"
        text = (
            f"{disk} has a volatile write cache: fsync sends a cache flush and commits the journal with {how}; "
            "durable after fsync if the device honours flushes"
        )
    else:
        text = f"{disk}: the kernel does not report a write-cache mode"
    if disk.startswith(("vd", "xvd")) or "virtio" in (facts.get("model") or "").lower():
        text += "; a virtual disk: whether a flush reaches physical media depends on the hypervisor's cache mode"
    if facts.get("slaves"):
        text += f"; stacked on {', '.join(facts['slaves'])} (their caches matter too)"
    return text


def device_info(
    path: str | os.PathLike[str], *, sysfs: str = "/sys", mountinfo: str = "/proc/self/mountinfo"
) -> DeviceInfo:
    """Describes the storage under `path` (an existing file or directory).

    Example:
        >>> info = device_info("/")                       # doctest: +SKIP
        >>> info.disk, info.write_cache, info.fua         # doctest: +SKIP
        ('vda', 'write back', False)
    """
    real = os.path.realpath(os.fspath(path))
    dev = os.stat(real).st_dev
    fs_type, point, options = mount_of(real, dev, mountinfo)
    facts = _block_facts(dev, sysfs)
    percent = _nvme_percent_used(facts["disk"]) if facts.get("nvme") else None
    return DeviceInfo(
        path=real,
        fs_type=fs_type,
        mount_point=point,
        mount_options=options,
        percent_used=percent,
        durability=_durability(fs_type, options, facts),
        **facts,
    )
