"""Replaced checkpoint trees are removed after the commit, by the background remover."""

from __future__ import annotations

import os

import pytest
import torch

import fastpersist as fp
from fastpersist.format.layout import tmp_dir_for
from fastpersist.saving.remover import remove_later, wait_removed


def _hidden(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("."))


def test_replacing_save_removes_the_old_tree_and_its_stripes(tmp_path: pytest.TempPathFactory) -> None:
    root, stripe = str(tmp_path / "root"), str(tmp_path / "stripe")
    os.mkdir(root)
    os.mkdir(stripe)
    path = os.path.join(root, "ck")
    cfg = fp.Config(stripes=[stripe])
    fp.save({"w": torch.zeros(1000)}, path, config=cfg)
    first_stripes = os.listdir(stripe)
    result = fp.save({"w": torch.ones(1000)}, path, config=cfg)
    wait_removed()
    assert _hidden(root) == []
    assert [n for n in os.listdir(stripe) if n in first_stripes] == []
    assert len(os.listdir(stripe)) == 1
    assert torch.equal(fp.load(path, config=cfg)["w"], torch.ones(1000))
    assert result.phases["commit"] >= 0


def test_the_remover_outlives_a_tree_that_is_already_gone(tmp_path: pytest.TempPathFactory) -> None:
    """`clean` may delete an unlocked replaced tree first; the remover then goes on serving."""
    owner = str(tmp_path / "ck")
    remove_later(str(tmp_path / ".ck.fptmp-0123456789ab"), None, owner_path=owner)
    tree = tmp_path / ".ck.fptmp-ba9876543210"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "data.w0.s0").write_bytes(b"x" * 4096)
    remove_later(str(tree), None, owner_path=owner)
    wait_removed()
    assert not tree.exists()


def test_a_crash_before_removal_leaves_what_clean_removes(tmp_path: pytest.TempPathFactory) -> None:
    root, stripe = str(tmp_path / "root"), str(tmp_path / "stripe")
    os.mkdir(root)
    os.mkdir(stripe)
    path = os.path.join(root, "ck")
    cfg = fp.Config(stripes=[stripe])
    fp.save({"w": torch.zeros(1000)}, path, config=cfg)
    old_id = fp.inspect(path, config=cfg)["checkpoint_id"]
    # What a crash between the exchange and the removal leaves: the old tree at the temporary
    # name (unlocked, its save is gone), its stripe directory, and the new checkpoint in place.
    os.rename(path, tmp_dir_for(path, old_id))
    fp.save({"w": torch.ones(1000)}, path, config=cfg)
    assert len(os.listdir(stripe)) == 2
    removed = fp.clean(root, stripes=[stripe])
    assert len(removed) == 2
    assert _hidden(root) == [] and len(os.listdir(stripe)) == 1
    assert torch.equal(fp.load(path, config=cfg)["w"], torch.ones(1000))
