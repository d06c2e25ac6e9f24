"""The kernel's view of a directory's device (fastpersist.blockdev), and the one behaviour both of
its readers share: the advisor's device facts and the tuning cache's device identity."""

from __future__ import annotations

import os
from pathlib import Path

from fastpersist.advisor.devinfo import device_info
from fastpersist.blockdev import block_node, mount_of, sysfs_text
from fastpersist.tuning.identity import device_identity


def _partition_tree(tmp_path: Path, target: Path, files: dict[str, str]) -> tuple[str, str]:
    """A sysfs where `target`'s device is partition 1 of sda (with `files` under the disk), and a
    mountinfo mounting it at `target`."""
    dev = os.stat(target).st_dev
    sysfs = tmp_path / "sys"
    disk = sysfs / "devices" / "pci0" / "sda"
    (disk / "sda1").mkdir(parents=True)
    (disk / "sda1" / "partition").write_text("1\n")
    for name, text in files.items():
        (disk / name).parent.mkdir(parents=True, exist_ok=True)
        (disk / name).write_text(text)
    (sysfs / "dev" / "block").mkdir(parents=True)
    (sysfs / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}").symlink_to(disk / "sda1")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"36 1 {os.major(dev)}:{os.minor(dev)} / {target} rw - ext4 /dev/sda1 rw,relatime\n")
    return str(sysfs), str(mountinfo)


def test_a_partition_resolves_to_its_disk_and_its_mount(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    sysfs, mountinfo = _partition_tree(tmp_path, target, {})
    dev = os.stat(target).st_dev
    found = block_node(dev, sysfs)
    assert found is not None
    assert (os.path.basename(found.node), os.path.basename(found.disk_dir)) == ("sda1", "sda")
    assert mount_of(str(target), dev, mountinfo) == ("ext4", str(target), ["rw", "relatime"])
    assert block_node(dev, str(tmp_path / "no-sys")) is None


def test_an_empty_attribute_reports_nothing_to_every_reader(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "one").write_text(" 1\n")
    assert (sysfs_text(str(tmp_path / "empty")), sysfs_text(str(tmp_path / "one"))) == (None, "1")
    assert sysfs_text(str(tmp_path / "missing")) is None
    target = tmp_path / "ckpt"
    target.mkdir()
    empty = {"queue/fua": "\n", "queue/write_cache": "", "device/model": "\n", "device/serial": "", "size": ""}
    sysfs, mountinfo = _partition_tree(tmp_path, target, {**empty, "device/wwid": "naa.5000c500a1b2c3d4\n"})
    info = device_info(target, sysfs=sysfs, mountinfo=mountinfo)
    assert (info.disk, info.fua, info.write_cache, info.model, info.capacity_bytes) == ("sda", None, None, None, None)
    assert "does not report a write-cache mode" in info.durability
    ident = device_identity(target, sysfs=sysfs, mountinfo=mountinfo)
    assert (ident.disk, ident.model, ident.serial) == ("sda", None, "naa.5000c500a1b2c3d4")
