"""Accelerate's ``total_limit`` rotation and folder life cycle with FastPersistStateHooks
(fastpersist.integrations.hf_accelerate): a real ``Accelerator(cpu=True)``.

By default ``save_state`` keeps Accelerate's contract: its folder is complete on return, so it
can be copied or removed at once. The rotation must delete the folders Accelerate's own would,
in its order, but only once the new folder is durable: with ``background=True`` a folder whose
save is in flight, or the last loadable one, is never deleted; a failed save deletes nothing;
``load_state`` waits for the save in flight; what a killed save left inside a folder is refused
by ``load_state`` and cleaned by the next save.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

import fastpersist as fp
from fastpersist.format.layout import tmp_dir_for
from fastpersist.integrations import hf_accelerate
from fastpersist.integrations.hf_accelerate import FastPersistStateHooks, model_dir_name

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _accelerator(project_dir: Path, total_limit: int | None, *, iteration: int = 0, seed: int = 0) -> Any:
    project = ProjectConfiguration(
        project_dir=str(project_dir), automatic_checkpoint_naming=True, total_limit=total_limit, iteration=iteration
    )
    accelerator = Accelerator(cpu=True, project_config=project)
    torch.manual_seed(seed)
    model = torch.nn.Linear(16, 8)
    accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return accelerator


def _folders(project_dir: Path) -> list[str]:
    return sorted(os.listdir(project_dir / "checkpoints"), key=lambda n: int(n.rsplit("_", 1)[1]))


def _loadable(folder: Path) -> bool:
    try:
        fp.verify(str(folder / model_dir_name(0)))
    except Exception:
        return False
    return True


def test_save_state_returns_with_its_folder_complete_so_it_can_be_copied_or_removed_at_once(tmp_path: Path) -> None:
    """Accelerate's own suite removes its project directory right after the last ``save_state``
    (test_checkpoint_deletion): a write still in flight then made that removal fail, or lost the
    weights of a copy taken at once."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    stock = _accelerator(theirs, total_limit=2)
    accelerator = _accelerator(ours, total_limit=2)
    hooks = FastPersistStateHooks().install(accelerator)
    for n in range(4):
        accelerator.save_state()
        stock.save_state()
        assert hooks.saves_in_flight == []
        assert _folders(ours) == _folders(theirs)  # rotated on return, as Accelerate's own
        copy = tmp_path / f"copy_{n}"
        shutil.copytree(ours / "checkpoints" / f"checkpoint_{n}", copy)
        assert _loadable(copy)
        weights = _weights(accelerator)
        _step(accelerator)
        accelerator.load_state(str(copy))
        assert all(torch.equal(v, weights[k]) for k, v in _weights(accelerator).items())
    shutil.rmtree(ours)  # nothing of ours writes into it any more
    assert not ours.exists()


def test_background_true_is_validated(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="background='yes'"):
        FastPersistStateHooks(background="yes")  # type: ignore[arg-type]


def test_rotation_deletes_what_accelerate_would_but_only_behind_a_durable_successor(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for project in (ours, theirs):
        for n in (7, 10):  # numeric order differs from the names' order: Accelerate sorts by number
            (project / "checkpoints" / f"checkpoint_{n}").mkdir(parents=True)
    stock = _accelerator(theirs, total_limit=2, iteration=11)
    accelerator = _accelerator(ours, total_limit=2, iteration=11)
    hooks = FastPersistStateHooks(background=True).install(accelerator)
    for _ in range(3):
        before = _folders(ours)
        accelerator.save_state()
        stock.save_state()
        newest = ours / "checkpoints" / f"checkpoint_{accelerator.save_iteration - 1}"
        assert {os.path.dirname(f.path) for f in hooks.saves_in_flight} == {str(newest)}
        assert _folders(ours) == [*before, newest.name]  # nothing deleted while the save is in flight
        assert accelerator.project_configuration.total_limit == 2  # given back after the call
        hooks.wait()
        assert _folders(ours) == _folders(theirs)  # the same folders left as Accelerate's own rotation
        assert _loadable(newest)
    assert _folders(ours) == ["checkpoint_12", "checkpoint_13"]


def test_total_limit_one_back_to_back_keeps_a_loadable_checkpoint(tmp_path: Path) -> None:
    accelerator = _accelerator(tmp_path, total_limit=1)
    hooks = FastPersistStateHooks(background=True).install(accelerator)
    accelerator.save_state()
    accelerator.save_state()  # the first save may still be in flight: it is waited for, not deleted
    assert _folders(tmp_path) == ["checkpoint_0", "checkpoint_1"]
    assert _loadable(tmp_path / "checkpoints" / "checkpoint_0")
    hooks.wait()
    assert _folders(tmp_path) == ["checkpoint_1"] and _loadable(tmp_path / "checkpoints" / "checkpoint_1")


class _FailedSave:
    """What save_async returns for a save that fails in its commit (a full disk)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def wait_staged(self, timeout: float | None = None) -> None:
        pass

    def wait(self, timeout: float | None = None) -> Any:
        raise OSError(28, "No space left on device", self.path)

    def cancel(self) -> bool:
        return False  # failed already: a SaveFuture's verdict is final


def test_a_failed_save_deletes_nothing_and_the_next_one_catches_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    accelerator = _accelerator(tmp_path, total_limit=1)
    hooks = FastPersistStateHooks(background=True).install(accelerator)
    accelerator.save_state()
    hooks.wait()
    monkeypatch.setattr(hf_accelerate, "save_async", lambda state, path, config: _FailedSave(path))
    accelerator.save_state()
    with pytest.raises(OSError, match="No space left"):
        hooks.wait()
    assert _folders(tmp_path) == ["checkpoint_0", "checkpoint_1"] and _loadable(
        tmp_path / "checkpoints" / "checkpoint_0"
    )
    monkeypatch.undo()
    accelerator.save_state()
    hooks.wait()
    assert _folders(tmp_path) == ["checkpoint_2"] and _loadable(tmp_path / "checkpoints" / "checkpoint_2")


def _step(accelerator: Any) -> None:
    model, optimizer = accelerator._models[0], accelerator._optimizers[0]
    model(torch.ones(2, 16)).square().sum().backward()
    optimizer.step()  # waits until the weights in flight are staged, then changes them
    optimizer.zero_grad()


def _weights(accelerator: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in accelerator._models[0].state_dict().items()}


def test_load_state_waits_for_the_save_in_flight_and_loads_the_newest(tmp_path: Path) -> None:
    accelerator = _accelerator(tmp_path, total_limit=1)
    FastPersistStateHooks(background=True).install(accelerator)
    accelerator.save_state()
    _step(accelerator)
    accelerator.save_state()
    saved = _weights(accelerator)
    _step(accelerator)
    assert not all(torch.equal(v, saved[k]) for k, v in _weights(accelerator).items())
    accelerator.load_state()  # the save of checkpoint_1 may be in flight: waited for, then picked
    assert _folders(tmp_path) == ["checkpoint_1"]
    for name, tensor in _weights(accelerator).items():
        assert torch.equal(tensor, saved[name]), name


def test_a_killed_save_is_refused_by_load_state_and_cleaned_by_the_next_save(tmp_path: Path) -> None:
    accelerator = _accelerator(tmp_path, total_limit=None)
    hooks = FastPersistStateHooks().install(accelerator)
    accelerator.save_state()
    hooks.wait()
    killed = tmp_path / "checkpoints" / "checkpoint_0"
    # What a kill -9 during the weights' save leaves: the hidden temporary tree, no checkpoint.
    shutil.rmtree(killed / model_dir_name(0))
    leftover = Path(tmp_dir_for(str(killed / model_dir_name(0)), "0123456789abcdef"))
    leftover.mkdir()
    (leftover / "data-0").write_bytes(b"partial")
    with pytest.raises(FileNotFoundError, match=r"save of \['model_fastpersist'\] into this folder never committed"):
        accelerator.load_state(str(killed))
    accelerator.save_state()
    hooks.wait()
    assert not leftover.exists() and "optimizer.bin" in os.listdir(killed)  # only the leftover is gone
    assert _loadable(tmp_path / "checkpoints" / "checkpoint_1")


def test_remove_gives_back_accelerate_s_own_save_state(tmp_path: Path) -> None:
    accelerator = _accelerator(tmp_path, total_limit=1)
    hooks = FastPersistStateHooks().install(accelerator)
    assert "save_state" in vars(accelerator) and "load_state" in vars(accelerator)
    hooks.remove()
    assert "save_state" not in vars(accelerator) and "load_state" not in vars(accelerator)
    accelerator.save_state()
    assert "model.safetensors" in os.listdir(tmp_path / "checkpoints" / "checkpoint_0")
