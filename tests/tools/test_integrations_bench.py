"""benches/integrations.py runs at its tiniest size (--tiny) for the one-process stacks: every
writer row is measured (a checkpoint's bytes on disk, a durable time, the checkpoints the loop
took), and the scratch directory is removed. DeepSpeed's 2 ranks take longer than this test
allows (two engines per writer, its async_io op built the first time): run
``python benches/integrations.py --tiny --stacks deepspeed`` by hand."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

BENCH = str(pathlib.Path(__file__).resolve().parent.parent.parent / "benches" / "integrations.py")


@pytest.mark.slow
def test_the_integrations_benchmark_runs_tiny(workdir: str) -> None:
    for package in ("lightning", "transformers"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed (pip install '.[test]' installs it)")
    out = os.path.join(workdir, "integrations.json")
    argv = [sys.executable, BENCH, "--tiny", "--stacks", "lightning,hf", "--dir", workdir, "--json", out]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "lost/ckpt s" in done.stdout and "disk of --dir" in done.stdout, done.stdout
    stacks = json.load(open(out))["stacks"]
    for stack, writers in (("lightning", 3), ("hf", 2)):
        rows = stacks[stack]["rows"]
        assert len(rows) == writers, rows
        for name, row in rows.items():
            assert row["ckpts"] == 2, (name, row)  # 4 steps, a checkpoint every 2
            assert row["bytes"] > 4_000_000, (name, row)  # 1M parameters and Adam's two moments, in fp32
            assert row["durable_s"] > 0 and row["gb_per_s"] > 0, (name, row)
    assert not [n for n in os.listdir(workdir) if n.startswith("fp-integrations-")]
