"""Replaced checkpoint trees are removed after the commit, by the background remover."""

from __future__ import annotations

import os

import pytest
import torch

import fastpersist as fp
from fastpersist.format.layout import tmp_dir_for
from fastpersist.saving import remover
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


def _held(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, tuple[object, ...], dict[str, object]]]:
    """Holds queued removals back (as a crash before the remover ran them would)."""
    held: list[tuple[object, tuple[object, ...], dict[str, object]]] = []
    monkeypatch.setattr(remover, "run_later", lambda fn, *a, **k: held.append((fn, a, k)))
    return held


def test_a_retired_step_leaves_sight_at_once_and_its_bytes_go_later(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, stripe = str(tmp_path / "root"), str(tmp_path / "stripe")
    os.mkdir(stripe)
    ck = fp.Checkpointer(root, keep=1, config=fp.Config(stripes=[stripe]))
    ck.save(1, {"w": torch.zeros(1000)})
    ck.wait()
    held = _held(monkeypatch)
    ck.save(2, {"w": torch.ones(1000)})
    ck.wait()
    assert ck.steps() == [2] and len(held) == 1
    hidden = _hidden(root)
    assert len(hidden) == 1 and ".fptmp-" in hidden[0]  # step 1, renamed, not yet deleted
    assert len(os.listdir(stripe)) == 2
    assert fp.clean(root, stripes=[stripe]) == []  # held by this process until deleted
    # A crash here (the lock goes with the process) leaves exactly what clean removes: the
    # hidden tree and its stripe directory.
    held[0][1][0].release()  # type: ignore[attr-defined]
    removed = fp.clean(root, stripes=[stripe])
    assert hidden[0] in {os.path.basename(p) for p in removed} and len(removed) == 2
    assert _hidden(root) == [] and len(os.listdir(stripe)) == 1
    assert torch.equal(ck.load(ck.latest())["w"], torch.ones(1000))  # type: ignore[index]


def test_close_waits_for_the_retired_steps(tmp_path: pytest.TempPathFactory) -> None:
    root = str(tmp_path / "root")
    with fp.Checkpointer(root, keep=1) as ck:
        for step in range(1, 5):
            ck.save(step, {"w": torch.full((1000,), float(step))})
    assert ck.steps() == [4] and _hidden(root) == []


def test_a_failed_removal_is_logged_and_the_remover_goes_on(
    tmp_path: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture
) -> None:
    def boom() -> None:
        raise OSError("disk went away")

    tree = tmp_path / ".ck.fptmp-0123456789ab"
    tree.mkdir()
    remover.run_later(boom)
    remove_later(str(tree), None, owner_path=str(tmp_path / "ck"))
    assert wait_removed(timeout=60)
    assert not tree.exists() and "disk went away" in caplog.text
