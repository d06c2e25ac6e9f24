"""benches/levels.py runs at a tiny size: the partner copies' bytes on the wire equal what the
manifests say (sharded: each share once per replica; replicated: none, each partner writes its
copies from its own state), and every restore is bit-identical."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

BENCH = str(pathlib.Path(__file__).resolve().parent.parent.parent / "benches" / "levels.py")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "mib", "fake_device"), [("sharded", 2, False), ("replicated", 2, False), ("sharded", 2, True)]
)
def test_the_levels_benchmark_runs_small(workdir: str, mode: str, mib: int, fake_device: bool) -> None:
    out = os.path.join(workdir, "levels.json")
    argv = ["--mode", mode, "--mib", str(mib), "--iters", "2", "--rounds", "1", "--repeats", "1"]
    argv += ["--device-seconds", "0.05", "--dir", workdir, "--json", out]
    argv += ["--fake-device", "--iters", "4"] if fake_device else []
    done = subprocess.run([sys.executable, BENCH, *argv], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "replicas=1" in done.stdout and "restore, node1 lost" in done.stdout
    report = json.load(open(out))
    traffic = report["overhead"]["traffic"]
    for rank in traffic:
        # Sharded shard manifests differ by a byte or two from step to step (the step number).
        assert abs(rank["sent"] - rank["expected_sent"]) <= 8
        assert abs(rank["received"] - rank["expected_received"]) <= 8
    # Every byte once per replica (replicated at 2 MiB, one writer holds every chunk): over the
    # wire when sharded, written from the partner's own state when replicated.
    if mode == "sharded":
        assert sum(rank["expected_sent"] for rank in traffic) >= 2 << 20
    else:
        assert sum(rank["expected_sent"] + rank["sent"] for rank in traffic) == 0
        assert sum(rank["copied"] for rank in traffic) >= 2 << 20
    rows = report["overhead"]["rows"]
    # A GPU state's steps are skipped while a rank's save still writes (the first of each
    # measurement always saves); a host state saves every step.
    assert all(1 <= rows[m]["saved"] <= (4 if fake_device else 2) for m in ("replicas=0", "replicas=1")), rows
    if not fake_device:
        assert rows["replicas=1"]["saved"] == 2, rows
    assert report["recovery"]["bit_identical"] is True
    assert not [n for n in os.listdir(workdir) if n.startswith("fp-levels-")]  # the roots are removed
