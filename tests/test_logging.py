"""The library logs (never prints): one INFO line per save and load, WARNING on fallbacks."""

from __future__ import annotations

import os
import re

import pytest
import torch

import fastpersist as fp
from fastpersist.interop import torchfile


def test_save_and_load_log_bytes_seconds_rate_backend_path(
    workdir: str, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    path = os.path.join(workdir, "ckpt")
    with caplog.at_level("INFO", logger="fastpersist"):
        res = fp.save({"w": torch.ones(1000)}, path)
        fp.save_async({"w": torch.ones(10)}, path + "-async").wait()
        fp.load(path)
        fp.torch_save({"w": torch.ones(3)}, os.path.join(workdir, "w.pt"))
    lines = [r.getMessage() for r in caplog.records if r.name == "fastpersist" and r.levelname == "INFO"]
    saved = [line for line in lines if line.startswith("saved ")]
    assert len(saved) == 2 and f"saved {res.path}: {res.nbytes} bytes in " in saved[0]
    pattern = r"(saved|loaded) \S+: \d+ bytes in [0-9.]+ s \([0-9.]+ GB/s, backend (io_uring|threads)\)"
    assert all(re.fullmatch(pattern, line) for line in saved)
    assert any(re.fullmatch(pattern, line) and line.startswith(f"loaded {res.path}") for line in lines)
    assert any(line.startswith("torch_save ") for line in lines)
    assert capsys.readouterr() == ("", "")  # nothing printed


def test_fallback_is_a_warning(workdir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def surprise(skel: torchfile.Skeleton) -> list[object]:
        raise ValueError("unexpected archive")

    monkeypatch.setattr(torchfile, "compose_extents", surprise)
    with caplog.at_level("INFO", logger="fastpersist"):
        fp.torch_save({"w": torch.ones(3)}, os.path.join(workdir, "w.pt"))
    assert [r.levelname for r in caplog.records if "fell back" in r.getMessage()] == ["WARNING"]


def test_no_print_calls_in_the_library() -> None:
    root = os.path.dirname(fp.__file__)
    offenders = []
    for folder, _dirs, files in os.walk(root):
        if os.path.relpath(folder, root).split(os.sep)[0] == "tools":
            continue  # the command-line programs print
        for name in files:
            if name.endswith(".py") and name != "__main__.py":
                text = open(os.path.join(folder, name)).read()
                offenders += [
                    f"{name}:{i + 1}" for i, line in enumerate(text.splitlines()) if re.match(r"\s*print\(", line)
                ]
    assert not offenders


def test_a_save_call_says_where_its_time_went(
    workdir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """INFO from SLOW_CALL_S on (lowered to 0 here), else DEBUG: walk, engine start, staging wait."""
    state = {f"t{i}": torch.zeros(4) for i in range(5000)}
    path = os.path.join(workdir, "many")
    with caplog.at_level("DEBUG", logger="fastpersist"):
        fp.save_async(state, path).wait()
        monkeypatch.setattr(fp.logs, "SLOW_CALL_S", 0.0)
        fp.save_async(state, path, config=fp.Config(guard="copy")).wait()
    calls = [(r.levelname, r.getMessage()) for r in caplog.records if "before returning" in r.getMessage()]
    assert [level for level, _ in calls] == ["DEBUG", "INFO"]
    pattern = (
        rf"the save of {re.escape(os.path.abspath(path))} took [0-9.]+ s before returning: [0-9.]+ s walking the "
        r"state \(5000 tensors\) and laying it out, .*; [0-9.]+ s starting the engine, which makes the early copy "
        r"of the small tensors before returning .*\(docs/overlap\.md\)(; [0-9.]+ s until every byte was staged .*)?"
    )
    assert all(re.fullmatch(pattern, message) for _, message in calls), calls
