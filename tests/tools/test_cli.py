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
from fastpersist.tools.bench import harness
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


def test_convert_unpickles_a_pt_file_only_with_unsafe_pickle(workdir: str, capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np

    pt, out = os.path.join(workdir, "numpy.pt"), os.path.join(workdir, "ckpt")
    torch.save({"w": torch.ones(3), "rng": np.arange(4)}, pt)
    assert cli.main(["convert", pt, "--to", "fastpersist", out]) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and pt in err and "--unsafe-pickle" in err
    assert not os.path.exists(out)
    assert cli.main(["convert", pt, "--to", "fastpersist", out, "--unsafe-pickle"]) == 0
    state = fp.load(out)
    assert torch.equal(state["w"], torch.ones(3)) and state["rng"].tolist() == [0, 1, 2, 3]


DEMO_SAVES = [
    "torch.save + fsync",
    "safetensors.save_file + fsync",
    "fastpersist.save (",
    "fastpersist.save_async: return",
    "fastpersist.save_async: staged (",
    "fastpersist.save_async: durable",
]
DEMO_LOADS = ["torch.load (weights_only)", "safetensors.load_file (mmap, pages touched)", "fastpersist.load"]


def _demo_rows(out: str) -> dict[str, list[str]]:
    """The demo table's rows: label -> [median, min-max, GB/s, ratio]."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("  ") and line.rstrip().endswith("x"):
            *label, median, spread, rate, ratio = line.split()
            rows[" ".join(label)] = [median, spread, rate, ratio]
    return rows


def test_demo_prints_every_method_with_numbers_and_removes_its_files(
    workdir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["demo", "--size", "4MiB", "--reps", "2", "--dir", workdir]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "reloaded bit-identical: True" in out and "2 round(s)" in out
    rows = _demo_rows(out)
    labels = list(rows)
    assert len(labels) == len(DEMO_SAVES) + len(DEMO_LOADS)
    for label, expected in zip(labels, DEMO_SAVES + DEMO_LOADS, strict=True):
        assert label.startswith(expected)
    for label, (median, spread, rate, ratio) in rows.items():
        low, high = (float(x) for x in spread.split("-"))
        assert 0 < low <= float(median) <= high, label
        assert float(ratio.removesuffix("x")) > 0, label
        assert (rate == "-") if label.endswith("return") else (float(rate) > 0), label
    assert rows["torch.save + fsync"][3] == rows["torch.load (weights_only)"][3] == "1.00x"
    assert ("page cache: dropped" in out) != ("not permitted" in out)  # dropped, or the output says why not
    assert "save 2/2: fastpersist.save_async" in captured.err  # progress, one line per step off a terminal
    assert os.listdir(workdir) == []


def test_demo_evicts_its_files_where_dropping_the_cache_is_refused(
    workdir: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    evicted: list[list[str]] = []
    monkeypatch.setattr(harness, "drop_caches", lambda: False)
    monkeypatch.setattr(harness, "evict_files", lambda dirs: evicted.append(list(dirs)))
    assert cli.main(["demo", "--size", "4MiB", "--reps", "1", "--dir", workdir]) == 0
    out = capsys.readouterr().out
    assert "page cache: dropped" not in out
    assert "not permitted" in out and "posix_fadvise" in out
    timed_saves = len(DEMO_SAVES) - 2  # save_async is one timed call with three rows
    assert len(evicted) == timed_saves + len(DEMO_LOADS)  # before each timed save and load
    assert all(dirs[0].startswith(workdir) for dirs in evicted)


def test_demo_keep_leaves_the_checkpoint_and_nothing_else(workdir: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--size", "4MiB", "--reps", "1", "--dir", workdir, "--keep"]) == 0
    kept = os.path.join(workdir, "fastpersist-demo-ckpt")
    assert f"kept at {kept}" in capsys.readouterr().out
    assert os.listdir(workdir) == ["fastpersist-demo-ckpt"]
    assert fp.load(kept)["step"] == 1000
    with pytest.raises(SystemExit, match="exists"):
        cli.main(["demo", "--size", "4MiB", "--reps", "1", "--dir", workdir, "--keep"])


def test_demo_refuses_bad_arguments(workdir: str) -> None:
    with pytest.raises(SystemExit, match="--reps"):
        cli.main(["demo", "--size", "4MiB", "--reps", "0", "--dir", workdir])
    with pytest.raises(SystemExit, match="free"):
        cli.main(["demo", "--size", "1000TiB", "--dir", workdir])


@pytest.mark.parametrize("command", ["demo", "bench", "inspect", "verify", "convert"])
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
