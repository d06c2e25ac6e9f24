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
