"""``fastpersist advise`` on a bench JSON and on a Checkpointer's root; ``fp.advise`` sources."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import fastpersist as fp
from fastpersist.advisor.model import Costs, best_every, job_mtbf_s
from fastpersist.tools import cli


def bench_report(tmp_path: Path) -> Path:
    """The parts of a ``fastpersist bench --json`` report that advise reads (shape as bench writes it)."""

    def row(median: float, label: str) -> dict[str, Any]:
        return {"label": label, "kind": "save", "role": "fastpersist", "median_s": median, "seconds": [median]}

    doc = {
        "created": "2026-12-01T06:30:00+0000",
        "config": {"reps": 1, "dirs": [str(tmp_path)], "pool_bytes": 256 << 20, "chunk_bytes": 8 << 20},
        "state": {"bytes": 1 << 30, "tensors": 300, "params": 76_000_000},
        "results": {
            "fastpersist_save_io_uring": row(0.63, "fastpersist.save (io_uring)"),
            "fastpersist_save_async_staged": row(0.48, "fastpersist.save_async: staged (bounded)"),
            "fastpersist_save_async_durable": row(0.65, "fastpersist.save_async: durable"),
            "fastpersist_load": {**row(0.48, "fastpersist.load"), "kind": "load"},
        },
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    return path


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def test_advise_on_a_bench_json(tmp_path: Path) -> None:
    bench = bench_report(tmp_path)
    argv = ["advise", "--from-bench", str(bench), "--step-seconds", "2", "--mtbf-hours", "1000", "--nodes", "16"]
    code, out, _ = run([*argv, "--every", "1", "--tbw-tb", "600", "--until", "2099-01-01"])
    assert code == 0
    for text in ("stall per save", "0.480 s", "save_async until staged", "recommended", "every step", "current"):
        assert text in out
    assert "what 'durable' means here" in out and "lasts to 2099-01-01" in out
    code, out, _ = run([*argv, "--json"])
    doc = json.loads(out)
    mtbf = job_mtbf_s(1000 * 3600.0, 16)
    assert doc["mtbf_s"] == pytest.approx(mtbf)
    assert doc["costs"] == {"stall_s": 0.48, "write_s": 0.65, "step_s": 2.0, "restart_s": 0.48, "nbytes": 1 << 30}
    assert doc["best"]["every"] == best_every(Costs(0.48, 0.65, 2.0, 0.48, 1 << 30), mtbf)
    assert doc["every_step"]["every"] == 1 and doc["current"] is None
    assert doc["devices"][0]["path"] == str(tmp_path.resolve())


def test_advise_explains_what_is_missing(tmp_path: Path) -> None:
    bench = bench_report(tmp_path)
    code, _, err = run(["advise", "--from-bench", str(bench), "--mtbf-hours", "1000"])
    assert code == 2 and "step_s" in err and "--step-seconds" in err
    with pytest.raises(SystemExit, match="mtbf"):
        run(["advise", "--from-bench", str(bench), "--step-seconds", "1"])
    with pytest.raises(SystemExit, match="capacity"):
        costs = ["--step-seconds", "1", "--stall-seconds", "0", "--write-seconds", "1", "--bytes", "1e9"]
        run(["advise", *costs, "--mtbf-hours", "9", "--dwpd", "1"])
    code, _, err = run(["advise", "--from-root", str(tmp_path / "nothing"), "--mtbf-hours", "9"])
    assert code == 2 and "history.json" in err


def test_advise_from_a_checkpointer_and_its_root(tmp_path: Path) -> None:
    ck = fp.Checkpointer(tmp_path, every=2)
    state = {"w": torch.zeros(1 << 16)}
    for step in range(12):
        ck.wait_staged()
        ck.save(step, state)
    ck.wait()
    live = fp.advise(ck, failures=fp.Failures(process_mtbf_s=3600.0), costs=fp.CostOverrides(restart_overhead_s=30.0))
    assert live.current is not None and live.current.every == 2
    assert live.costs.nbytes == 1 << 18 and live.costs.restart_s == pytest.approx(30.0)
    assert "Checkpointer(" in live.where["stall_s"]
    code, out, _ = run(["advise", "--from-root", str(tmp_path), "--job-mtbf-hours", "1", "--dwpd", "1"])
    assert code == 0 and "1 DWPD x" in out  # the capacity came from sysfs
    code, out, _ = run(["advise", "--from-root", str(tmp_path), "--job-mtbf-hours", "1", "--json"])
    assert code == 0
    doc = json.loads(out)
    assert doc["current"]["every"] == 2 and doc["costs"]["nbytes"] == 1 << 18
    assert doc["observed_bytes_per_day"] > 0 and doc["drives"] == 1
    assert sum(doc["observed_daily"].values()) == 6 << 18  # six saves of 256 KiB
    code, out, _ = run(["advise", "--from-root", str(tmp_path), "--job-mtbf-hours", "1"])
    assert code == 0 and "written per UTC day: " in out and str(tmp_path.resolve()) in out
