"""``every="auto"``: what a Checkpointer measures, and the choice converging on known costs."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch

import fastpersist as fp
from fastpersist.advisor import history as history_module
from fastpersist.advisor.history import SaveHistory
from fastpersist.advisor.model import Costs, best_every
from fastpersist.format.layout import HISTORY_NAME


class FakeClock:
    """Stands in for the ``time`` module inside history.py: the test moves it."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return 1.8e9 + self.now


def simulate(
    h: SaveHistory, clock: FakeClock, steps: int, *, step_s: float, start_s: float, staged_s: float
) -> list[int]:
    """A loop whose step takes `step_s`, whose save() call costs `start_s` and whose next
    wait_staged() waits `staged_s`; each save commits 0.5 s after it starts (within the step)."""
    chosen = []
    staged_pending = False
    for step in range(steps):
        clock.now += step_s  # forward and backward
        if staged_pending:
            with h.waiting("staged"):
                clock.now += staged_s
            staged_pending = False
        if h.due(step):
            with h.waiting("commit"):
                pass  # the previous save committed long ago
            with h.waiting("start"):
                clock.now += start_s
            result = fp.SaveResult(f"/x/step-{step:08d}", 10**9, 0.5, start_s + staged_s, 2.0, "threads")
            h.committed(result)
            staged_pending = True
        chosen.append(h.every)
    return chosen


def test_auto_converges_on_a_simulated_loop(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    monkeypatch.setattr(history_module, "time", clock)
    h = SaveHistory("/nonexistent", every="auto", mtbf_s=3600.0, persist=False)
    with caplog.at_level(logging.INFO, logger="fastpersist"):
        chosen = simulate(h, clock, 3000, step_s=1.0, start_s=0.05, staged_s=0.15)
    costs = h.costs()
    assert costs is not None
    assert costs.step_s == pytest.approx(1.0) and costs.stall_s == pytest.approx(0.2)
    assert costs.write_s == pytest.approx(0.5) and costs.nbytes == 10**9
    want = best_every(Costs(stall_s=0.2, write_s=0.5, step_s=1.0), 3600.0)
    assert 30 <= want <= 45  # sqrt(2 * 0.2 * 3600) = 38 s of training between saves
    assert chosen[0] == 1 and chosen[-1] == want
    assert set(chosen[len(chosen) // 3 :]) == {want}  # settled, no flapping
    changes = [r.getMessage() for r in caplog.records if "every='auto'" in r.getMessage()]
    assert changes and changes[-1].startswith(f"Checkpointer(every='auto'): every 1 -> {want} steps")


def test_auto_is_bounded_by_max_every(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(history_module, "time", clock)
    h = SaveHistory("/nonexistent", every="auto", mtbf_s=3600.0, max_every=10, persist=False)
    assert simulate(h, clock, 400, step_s=1.0, start_s=0.05, staged_s=0.15)[-1] == 10


def test_auto_needs_an_mtbf(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mtbf_s"):
        fp.Checkpointer(tmp_path, every="auto")
    with pytest.raises(ValueError, match="every"):
        fp.Checkpointer(tmp_path, every="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group"):
        fp.Checkpointer(tmp_path, every="auto", failures=fp.Failures(process_mtbf_s=3600.0), group=object())


def test_a_real_checkpointer_measures_itself_and_keeps_history(tmp_path: Path) -> None:
    ck = fp.Checkpointer(tmp_path, every="auto", failures=fp.Failures(process_mtbf_s=60.0), max_every=50, keep=1)
    assert ck.every == 1
    state = {"w": torch.zeros(1 << 18)}  # 1 MiB
    for step in range(40):
        time.sleep(0.01)  # the step's compute
        ck.wait_staged()
        state["w"].add_(1)
        ck.save(step, state)
    ck.wait()
    costs = ck.history.costs()
    assert costs is not None
    assert 0.009 < costs.step_s < 0.2 and costs.nbytes == 1 << 20 and costs.write_s > 0
    assert 1 < ck.every <= 50  # a 10 ms step: a save every step costs more than it saves
    doc = json.loads((tmp_path / HISTORY_NAME).read_text())
    assert doc["version"] == 1 and doc["auto"] is True and doc["mtbf_s"] == 60.0
    saved = len(ck.history.write_s)
    assert sum(int(n) for n in doc["wear"]["hourly"][str(tmp_path)].values()) == saved << 20
    assert json.loads((tmp_path / "latest.json").read_text())["step"] == ck.steps()[-1]  # the index is unchanged
    # A later Checkpointer on the same root continues the wear log, and its load is timed.
    ck2 = fp.Checkpointer(tmp_path, every=1)
    ck2.load()
    assert len(ck2.history.load_s) == 1
    ck2.save(100, state)
    ck2.wait()
    doc = json.loads((tmp_path / HISTORY_NAME).read_text())
    assert sum(int(n) for n in doc["wear"]["hourly"][str(tmp_path)].values()) == (saved + 1) << 20
    assert os.path.exists(tmp_path / "step-00000100")


def test_fixed_every_keeps_its_meaning(tmp_path: Path) -> None:
    ck = fp.Checkpointer(tmp_path, every=3)
    due = [ck.save(s, {"w": torch.zeros(8)}) is not None for s in range(7)]
    ck.wait()
    assert due == [s % 3 == 0 for s in range(7)] and ck.every == 3
