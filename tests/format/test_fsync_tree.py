"""format.layout.fsync_tree: the one walk that makes a directory tree durable (the Trainer's
staging directory, an Accelerate folder)."""

from __future__ import annotations

import os
import pathlib

import pytest

import fastpersist.format.layout as layout


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """The fsyncs fsync_tree makes, in order: ("file" | "dir", path)."""
    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(layout._core, "fsync_path", lambda p: calls.append(("file", os.fspath(p))))
    monkeypatch.setattr(layout._core, "fsync_dir", lambda p: calls.append(("dir", os.fspath(p))))
    return calls


def _tree(root: pathlib.Path) -> None:
    (root / "a" / "b").mkdir(parents=True)
    (root / "done" / "deep").mkdir(parents=True)
    (root / "top.bin").write_bytes(b"1")
    (root / "a" / "mid.bin").write_bytes(b"2")
    (root / "a" / "b" / "leaf.bin").write_bytes(b"3")
    (root / "done" / "deep" / "kept.bin").write_bytes(b"4")
    (root / "link.bin").symlink_to(root / "top.bin")
    os.mkfifo(root / "fifo")


def test_every_file_then_every_directory_deepest_first(tmp_path: pathlib.Path, synced: list[tuple[str, str]]) -> None:
    root = tmp_path / "t"
    _tree(root)
    layout.fsync_tree(str(root))
    files = {p for kind, p in synced if kind == "file"}
    dirs = [p for kind, p in synced if kind == "dir"]
    assert files == {str(root / n) for n in ("top.bin", "a/mid.bin", "a/b/leaf.bin", "done/deep/kept.bin")}
    assert sorted(dirs) == sorted([str(root)] + [str(root / d) for d in ("a", "a/b", "done", "done/deep")])
    assert all(kind == "file" for kind, _ in synced[: len(files)]), "a directory was synced before a file under it"
    assert dirs.index(str(root / "a" / "b")) < dirs.index(str(root / "a")) < dirs.index(str(root))


def test_trees_already_durable_and_links_are_left_out(tmp_path: pathlib.Path, synced: list[tuple[str, str]]) -> None:
    root = tmp_path / "t"
    _tree(root)
    layout.fsync_tree(str(root), durable_already=[os.path.join(str(root), "done")])
    touched = [p for _, p in synced]
    assert not [p for p in touched if "/done" in p]
    assert str(root / "link.bin") not in touched and str(root / "fifo") not in touched
    assert synced[-1] == ("dir", str(root))
