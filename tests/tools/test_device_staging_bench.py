"""benches/device_staging.py runs at a tiny size: the fake copy engine stages every tensor of the
state, the engine's baselines are printed beside the save's figures, and the Python calls per
save do not grow with the chunks."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

BENCH = str(pathlib.Path(__file__).resolve().parent.parent.parent / "benches" / "device_staging.py")


@pytest.mark.parametrize("layout", ["adam", "large"])
def test_the_device_staging_benchmark_runs_small(workdir: str, layout: str) -> None:
    argv = ["--size", "32MiB", "--reps", "1", "--dir", workdir, "--layout", layout]
    argv += ["--paths"] if layout == "adam" else []
    done = subprocess.run([sys.executable, BENCH, *argv], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    for line in ("one memcpy by the engine (1 thread)", "copies, one per tensor", "checksums off", "crc32c"):
        assert line in out, out
    assert "Python calls per save" in out and "GROWS" not in out, out
    assert "save_async returns in" in out, out
    if layout == "adam":
        for door in ("fp.save", "fp.torch_save", "dcp.save(FastPersistWriter)"):
            assert f"    {door} " in out, out
    assert not [n for n in os.listdir(workdir) if n.startswith("fp-device-staging-")]  # its root is removed
