"""benches/dcp_staging.py runs at a tiny size and times every writer it names."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

BENCH = str(pathlib.Path(__file__).resolve().parent.parent.parent / "benches" / "dcp_staging.py")


def test_the_dcp_staging_benchmark_runs_small(workdir: str) -> None:
    argv = ["--size", "16MiB", "--reps", "1", "--dir", workdir]
    done = subprocess.run([sys.executable, BENCH, *argv], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    for name in ("one memcpy", "DCP stager (FileSystemWriter)", "arena (FastPersistWriter)", "arena, cached"):
        assert name in done.stdout, done.stdout
    assert not [n for n in os.listdir(workdir) if n.startswith("fp-dcp-staging-")]
