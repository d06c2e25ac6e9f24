"""The ``fastpersist`` command line: demo, inspect, verify, convert, and --help everywhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import fastpersist as fp
from fastpersist.tools import cli
from fastpersist.tools.clitools import group_tensors, top_key


def _ckpt(workdir: str) -> str:
    path = os.path.join(workdir, "ckpt")
    state = {
        "model": {"layers.0.weight": torch.ones(4, 4), "layers.0.bias": torch.zeros(4)},
        "optimizer": {"state": {0: {"exp_avg": torch.ones(4, 4)}}, "param_groups": [{"lr": 0.1}]},
        "step": 3,
    }
    fp.save(state, path)
    return path


def test_top_key_and_groups() -> None:
    assert top_key("state.model['layers.0.weight']") == "model"
    assert top_key("state['a.b'].c") == "a.b"
    assert top_key("state[0].w") == "0"
    assert top_key("state") == "(root)"
    groups = group_tensors(
        [
            {"key": "state.model.a", "bytes": 4},
            {"key": "state.opt[0]", "bytes": 8},
            {"key": "state.model.b", "bytes": 2},
        ]
    )
    assert groups == [{"key": "model", "tensors": 2, "bytes": 6}, {"key": "opt", "tensors": 1, "bytes": 8}]


def test_inspect_groups_by_top_level_key(workdir: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = _ckpt(workdir)
    assert cli.main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "3 tensors" in out
    model_line = next(line for line in out.splitlines() if line.strip().startswith("model "))
    assert model_line.split()[1:3] == ["2", "80"]  # 2 tensors, 64 + 16 bytes
    assert "layers.0.weight" not in out and "--all" in out
    assert cli.main(["inspect", path, "--all"]) == 0
    assert "state.optimizer.state[0].exp_avg: float32[4, 4]" in capsys.readouterr().out


def test_inspect_json_lists_every_tensor(workdir: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = _ckpt(workdir)
    assert cli.main(["inspect", path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert len(info["tensor_list"]) == info["tensors"] == 3
    assert {g["key"]: g["tensors"] for g in info["groups"]} == {"model": 2, "optimizer": 1}


def test_verify_ok_and_corrupt(workdir: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = _ckpt(workdir)
    assert cli.main(["verify", path]) == 0
    assert capsys.readouterr().out.startswith("ok: 1 file(s)")
    data = next(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".bin"))
    with open(data, "r+b") as f:
        f.seek(3)
        byte = f.read(1)
        f.seek(3)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert cli.main(["verify", path]) == 1
    assert "checksum mismatch" in capsys.readouterr().err
    assert cli.main(["inspect", os.path.join(workdir, "missing")]) == 1


def test_convert_every_direction(workdir: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = _ckpt(workdir)
    pt, st = os.path.join(workdir, "a.pt"), os.path.join(workdir, "a.safetensors")
    back1, back2 = os.path.join(workdir, "back1"), os.path.join(workdir, "back2")
    assert cli.main(["convert", path, "--to", "torch", pt]) == 0
    assert cli.main(["convert", pt, "--to", "safetensors", st]) == 0
    assert cli.main(["convert", st, "--to", "fastpersist", back1]) == 0
    assert cli.main(["convert", pt, "--to", "fastpersist", back2]) == 0
    out = capsys.readouterr().out
    assert "converted fastpersist" in out and "3 tensors" in out
    for back in (back1, back2):
        state = fp.load(back)
        assert torch.equal(state["model"]["layers.0.weight"], torch.ones(4, 4)) and state["step"] == 3
    assert cli.main(["convert", os.path.join(workdir, "nope.pt"), "--to", "torch", pt]) == 1
    assert "FAILED" in capsys.readouterr().err


def test_demo_runs_small(workdir: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--size", "4MiB", "--reps", "1", "--dir", workdir]) == 0
    out = capsys.readouterr().out
    assert "reloaded bit-identical: True" in out and "torch.save + fsync" in out


@pytest.mark.parametrize("command", ["demo", "bench", "tune", "inspect", "verify", "convert"])
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: fastpersist " + command in capsys.readouterr().out


def test_module_entry_point_and_quiet_progress_off_a_terminal(workdir: str) -> None:
    path = _ckpt(workdir)
    done = subprocess.run(
        [sys.executable, "-m", "fastpersist", "verify", path], capture_output=True, text=True, check=True
    )
    assert done.stdout.startswith("ok:") and done.stderr == ""  # no progress bar when not a terminal


def test_verify_and_inspect_take_moved_stripe_roots(workdir: str, capsys: pytest.CaptureFixture[str]) -> None:
    old, new = os.path.join(workdir, "old"), os.path.join(workdir, "new")
    os.makedirs(old)
    os.makedirs(new)
    path = os.path.join(workdir, "striped")
    fp.save({"w": torch.ones(1000)}, path, config=fp.Config(stripes=[old]))
    for name in os.listdir(old):
        shutil.move(os.path.join(old, name), new)
    assert cli.main(["verify", path]) == 1
    assert "--stripes" in capsys.readouterr().err
    assert cli.main(["verify", path, "--stripes", new]) == 0
    assert capsys.readouterr().out.startswith("ok: 1 file(s)")
    assert cli.main(["inspect", path, "--json", "--stripes", new]) == 0
    assert json.loads(capsys.readouterr().out)["files"][0]["path"].startswith(new + os.sep)
