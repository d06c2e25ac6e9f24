"""Write-cache honesty: this machine's real sysfs, and a fake sysfs tree for every case."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fastpersist.advisor.devinfo import device_info


def test_the_real_device_under_the_test_directory(tmp_path: Path) -> None:
    info = device_info(tmp_path)
    assert info.path == os.path.realpath(tmp_path)
    assert info.fs_type and info.mount_point
    if os.major(os.stat(tmp_path).st_dev) == 0:
        pytest.skip(f"{tmp_path} is not on a block device ({info.fs_type})")
    assert info.disk and os.path.isdir(f"/sys/block/{info.disk}")
    expected = Path(f"/sys/block/{info.disk}/queue/write_cache").read_text().strip()
    assert info.write_cache == expected
    assert info.fua == (Path(f"/sys/block/{info.disk}/queue/fua").read_text().strip() == "1")
    assert info.disk in info.durability


def fake_tree(
    tmp_path: Path, target: Path, *, cache: str, fua: str, options: str = "rw,relatime", fstype: str = "ext4"
) -> tuple[str, str]:
    """A sysfs where `target`'s device is partition 1 of nvme0n1, and a mountinfo mounting it at `target`."""
    dev = os.stat(target).st_dev
    sysfs = tmp_path / "sys"
    disk = sysfs / "devices" / "pci0000:00" / "nvme" / "nvme0" / "nvme0n1"
    part = disk / "nvme0n1p1"
    (disk / "queue").mkdir(parents=True)
    (disk / "device").mkdir()
    part.mkdir()
    (disk / "queue" / "write_cache").write_text(cache + "\n")
    (disk / "queue" / "fua").write_text(fua + "\n")
    (disk / "queue" / "rotational").write_text("0\n")
    (disk / "size").write_text(str(3_840_000_000_000 // 512) + "\n")
    (disk / "device" / "model").write_text("FAKE NVMe 3.84TB   \n")
    (part / "partition").write_text("1\n")
    (sysfs / "dev" / "block").mkdir(parents=True)
    (sysfs / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}").symlink_to(part)
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        f"22 1 0:1 / / rw - rootfs rootfs rw\n"
        f"36 22 {os.major(dev)}:{os.minor(dev)} / {target} {options} shared:1 - {fstype} /dev/nvme0n1p1 rw\n"
    )
    return str(sysfs), str(mountinfo)


def test_a_partition_reads_its_disks_queue(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    sysfs, mountinfo = fake_tree(tmp_path, target, cache="write back", fua="1")
    info = device_info(target, sysfs=sysfs, mountinfo=mountinfo)
    assert (info.device, info.disk, info.nvme) == ("nvme0n1p1", "nvme0n1", True)
    assert (info.write_cache, info.fua, info.rotational) == ("write back", True, False)
    assert info.capacity_bytes == 3_840_000_000_000 and info.model == "FAKE NVMe 3.84TB"
    assert (info.fs_type, info.mount_point) == ("ext4", str(target))
    assert "volatile write cache" in info.durability and "FUA writes" in info.durability


def test_write_through_means_no_flush_needed(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    sysfs, mountinfo = fake_tree(tmp_path, target, cache="write through", fua="0")
    info = device_info(target, sysfs=sysfs, mountinfo=mountinfo)
    assert info.fua is False
    assert "no volatile write cache" in info.durability


def test_nobarrier_and_tmpfs_are_called_out(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    sysfs, mountinfo = fake_tree(tmp_path, target, cache="write back", fua="0", options="rw,nobarrier")
    assert "does NOT flush" in device_info(target, sysfs=sysfs, mountinfo=mountinfo).durability
    other = tmp_path / "other"
    other.mkdir()
    sysfs2, mountinfo2 = fake_tree(other, target, cache="write back", fua="0", fstype="tmpfs")
    assert "survives" in device_info(target, sysfs=sysfs2, mountinfo=mountinfo2).durability


def test_no_block_device(tmp_path: Path) -> None:
    info = device_info(tmp_path, sysfs=str(tmp_path / "empty-sys"), mountinfo=str(tmp_path / "none"))
    assert info.device is None and info.write_cache is None
    assert "not on a local block device" in info.durability
