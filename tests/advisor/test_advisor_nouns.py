"""``fp.advise`` takes its inputs as nouns: ``Failures``, ``CostOverrides``, ``Wear``.

The table below holds the keywords ``advise`` took before the nouns, and a digest of the
``Advice.to_json()`` that call gave (computed with the keyword form, before the change): the
call in nouns must give exactly the same advice.
"""

from __future__ import annotations

import datetime
import hashlib
import inspect
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import fastpersist as fp
from fastpersist.advisor.sources import Measured
from fastpersist.advisor.wear import Endurance, WearLog

D = datetime.date
TBW = Endurance.from_tbw
DWPD = Endurance.from_dwpd
T0 = datetime.datetime(2026, 11, 1, tzinfo=datetime.UTC).timestamp()


def _wear_log() -> WearLog:
    log = WearLog()
    for i in range(40):
        log.add("/mnt/nvme0/ck", 3 * 10**9, when_s=T0 + i * 1800.0)
        log.add("/mnt/nvme1/ck", 3 * 10**9, when_s=T0 + i * 1800.0)
    return log


def _history(*, mtbf_s: float | None, overhead_s: float, load: bool) -> dict[str, Any]:
    """A ``history.json`` as a Checkpointer writes it (the fields advise reads)."""

    def stat(*samples: float) -> dict[str, Any]:
        return {"median": sorted(samples)[len(samples) // 2], "samples": list(samples)}

    return {
        "version": 1,
        "every": 4,
        "auto": False,
        "mtbf_s": mtbf_s,
        "restart_overhead_s": overhead_s,
        "stall_s": stat(0.11, 0.12, 0.13),
        "step_s": stat(0.9, 1.1, 1.0),
        "write_s": stat(2.1, 2.2, 2.3),
        "nbytes": stat(6e9, 6e9, 6e9),
        "load_s": stat(4.0, 5.0, 6.0) if load else None,
        "wear": _wear_log().to_json(),
    }


def _bench(tmp: Path, name: str, *, durable: bool, pool: int, dirs: list[str]) -> str:
    def row(median: float, label: str) -> dict[str, Any]:
        return {"label": label, "median_s": median, "seconds": [median]}

    results = {
        "fastpersist_save_io_uring": row(0.63, "fastpersist.save (io_uring)"),
        "fastpersist_save_async_staged": row(0.48, "fastpersist.save_async: staged"),
    }
    if durable:
        results["fastpersist_save_async_durable"] = row(0.65, "fastpersist.save_async: durable")
        results["fastpersist_load"] = row(0.48, "fastpersist.load")
    doc = {
        "created": "2026-12-01T06:30:00+0000",
        "config": {"reps": 3, "dirs": dirs, "pool_bytes": pool},
        "state": {"bytes": 1 << 30},
        "results": results,
    }
    path = tmp / name
    path.write_text(json.dumps(doc))
    return str(path)


def sources(tmp: Path) -> dict[str, object]:
    """Every kind of source advise reads, under `tmp`."""
    roots = {}
    for name, doc in (
        ("root", _history(mtbf_s=86_400.0, overhead_s=25.0, load=True)),
        ("root2", _history(mtbf_s=None, overhead_s=0.0, load=False)),
    ):
        (tmp / name).mkdir()
        (tmp / name / "history.json").write_text(json.dumps(doc))
        roots[name] = str(tmp / name)
    doc = _history(mtbf_s=7200.0, overhead_s=10.0, load=True)
    live = SimpleNamespace(root="/runs/exp1", history=SimpleNamespace(costs=None, to_json=lambda: doc))
    measured = Measured(0.2, 1.5, 0.7, 3.0, 20.0, 2 * 10**9, 5, None, ["/a", "/b", "/c"], None, {"step_s": "told"})
    return {
        "none": None,
        "bench": _bench(tmp, "bench.json", durable=True, pool=256 << 20, dirs=["/nonexistent/nvme0"]),
        "bench2": _bench(
            tmp, "bench2.json", durable=False, pool=2 << 30, dirs=[f"/nonexistent/d{i}" for i in range(4)]
        ),
        **roots,
        "live": live,
        "measured": measured,
        "measured_mtbf": Measured(0.0, 0.4, 0.3, None, None, 10**8, None, 3e5, [], _wear_log()),
    }


FULL = {"step_s": 1.0, "stall_s": 0.05, "write_s": 0.6, "restart_s": 30.0, "nbytes": 1 << 30}
WEAR = {"step_s": 10.0, "stall_s": 1e-4, "write_s": 1.0, "nbytes": 10**11, "drives": 10, "mtbf_s": 1e4}
ENDURE = {"endurance": TBW(7000.0), "until": D(2031, 12, 1), "today": D(2026, 12, 1)}

#: (source, the keywords advise took before the nouns).
CASES: list[tuple[str, dict[str, Any]]] = [
    ("none", {"mtbf_s": 3600.0, **FULL}),
    ("none", {"mtbf_s": 3600.0, **FULL, "every": 1}),
    ("none", {"mtbf_s": 3600.0, **FULL, "every": 0}),
    ("none", {"node_mtbf_s": 1000 * 3600.0, "nodes": 16, **FULL, "every": 500}),
    (
        "none",
        {
            "node_mtbf_s": 6330 * 3600.0,
            "nodes": 16,
            "step_s": 2.0,
            "stall_s": 0.3,
            "write_s": 4.0,
            "restart_overhead_s": 60.0,
            "nbytes": 5 * 10**9,
        },
    ),
    ("none", {"node_mtbf_s": 5 * 365 * 86_400.0, "nodes": 1000, **FULL}),
    ("none", {"node_mtbf_s": 3600.0, **FULL}),
    ("none", {"mtbf_s": 86_400.0, "step_s": 1.0, "stall_s": 0.0, "write_s": 0.5, "restart_s": 10.0, "nbytes": 0}),
    ("none", {"mtbf_s": 7200.0, "step_s": 1.0, "stall_s": 0.0, "write_s": 3.5, "nbytes": 10**9, "every": 2}),
    ("none", {"mtbf_s": 50.0, "step_s": 1.0, "stall_s": 100.0, "write_s": 100.0, "restart_s": 5.0, "nbytes": 1}),
    ("none", {"mtbf_s": 3000.0, "step_s": 10.0, "stall_s": 1.0, "write_s": 1.0, "restart_s": 300.0, "nbytes": 7}),
    ("none", {"mtbf_s": 3600.0, "step_s": 0.01, "stall_s": 1.0, "write_s": 1.0, "nbytes": 10**6, "every": 7}),
    (
        "none",
        {
            "mtbf_s": 16.5 * 86_400,
            "step_s": 6.0,
            "stall_s": 0.48,
            "write_s": 0.65,
            "restart_s": 0.48,
            "nbytes": 1 << 30,
        },
    ),
    ("none", {**WEAR, **ENDURE, "every": 1}),
    ("none", {**WEAR, "endurance": TBW(7000.0)}),
    ("none", {**WEAR, "endurance": TBW(7000.0), "until": D(2030, 1, 1), "today": D(2031, 1, 1)}),
    ("none", {**WEAR, "until": D(2031, 12, 1), "today": D(2026, 12, 1)}),
    (
        "none",
        {
            **FULL,
            "mtbf_s": 3600.0,
            "endurance": TBW(50.0, used_fraction=0.25),
            "until": D(2027, 6, 30),
            "today": D(2026, 12, 1),
            "every": 3,
        },
    ),
    (
        "none",
        {
            **FULL,
            "mtbf_s": 3600.0,
            "drives": 4,
            "every": 10,
            "until": D(2029, 12, 1),
            "today": D(2026, 1, 1),
            "endurance": DWPD(1.0, capacity_bytes=3.84e12, warranty_years=5, used_fraction=0.3),
        },
    ),
    ("bench", {"step_s": 2.0, "node_mtbf_s": 1000 * 3600.0, "nodes": 16}),
    (
        "bench",
        {
            "step_s": 2.0,
            "mtbf_s": 86_400.0,
            "every": 1,
            "endurance": TBW(600.0),
            "until": D(2099, 1, 1),
            "today": D(2026, 12, 1),
        },
    ),
    ("bench", {"step_s": 0.5, "mtbf_s": 3600.0, "stall_s": 0.1, "restart_overhead_s": 45.0}),
    ("bench", {"step_s": 1.0, "mtbf_s": 3600.0, "restart_s": 200.0, "write_s": 2.5}),
    ("bench", {"step_s": 1.0, "mtbf_s": 3600.0, "nbytes": 123_456_789, "drives": 8}),
    ("bench", {"step_s": 1.0, "mtbf_s": 3600.0, "restart_s": 9.0, "restart_overhead_s": 45.0}),
    ("bench2", {"step_s": 3.0, "node_mtbf_s": 2000 * 3600.0, "nodes": 64}),
    (
        "bench2",
        {
            "step_s": 3.0,
            "mtbf_s": 2e5,
            "until": D(2028, 3, 1),
            "today": D(2026, 3, 1),
            "endurance": DWPD(3.0, capacity_bytes=1.6e12, warranty_years=3),
        },
    ),
    ("root", {}),
    ("root", {"mtbf_s": 7200.0}),
    ("root", {"node_mtbf_s": 3e6, "nodes": 8, "restart_overhead_s": 5.0}),
    ("root", {"every": 50, "drives": 1, "endurance": TBW(300.0), "until": D(2027, 12, 31), "today": D(2026, 12, 1)}),
    ("root", {"step_s": 0.2, "stall_s": 0.01, "write_s": 0.3, "restart_s": 12.0, "nbytes": 10**8}),
    ("root2", {"mtbf_s": 3600.0}),
    ("root2", {"node_mtbf_s": 7e5, "nodes": 4, "restart_overhead_s": 90.0, "every": 1}),
    ("live", {"mtbf_s": 3600.0, "restart_overhead_s": 30.0}),
    ("live", {"every": 3}),
    ("measured", {"mtbf_s": 16.5 * 86_400}),
    (
        "measured",
        {
            "mtbf_s": 86_400.0,
            "drives": 6,
            "endurance": TBW(3000.0, used_fraction=0.1),
            "until": D(2028, 1, 1),
            "today": D(2026, 6, 1),
        },
    ),
    ("measured", {"node_mtbf_s": 1e6, "nodes": 32, "restart_s": 0.0, "every": 1000}),
    ("measured_mtbf", {}),
    ("measured_mtbf", {"endurance": TBW(1.0), "until": D(2026, 12, 2), "today": D(2026, 12, 1)}),
]

#: Keywords the old form refused with a ValueError; the nouns refuse them too.
REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("bench", {"mtbf_s": 3600.0}),  # a bench measures no step
    ("none", {"mtbf_s": 3600.0, "step_s": 1.0, "stall_s": 0.1, "write_s": 1.0}),  # no size
    ("bench", {"step_s": 1.0}),  # no failure model
    ("root2", {}),  # nor a measured one
]


def digest(advice: Any, tmp: Path) -> str:
    """What the advice says, with `tmp` spelled ``<tmp>``, hashed."""
    text = json.dumps(advice.to_json(), sort_keys=True).replace(str(tmp), "<tmp>")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def in_nouns(old: dict[str, Any]) -> dict[str, Any]:
    """The old keywords as nouns (docs/advisor.md's mapping): ``mtbf_s``, the job's MTBF, is
    ``Failures.process_mtbf_s``; ``node_mtbf_s`` and ``nodes`` keep their names."""
    groups: dict[str, dict[str, Any]] = {"failures": {}, "costs": {}, "wear": {}}
    new: dict[str, Any] = {}
    for k, v in old.items():
        if k in ("mtbf_s", "node_mtbf_s", "nodes"):
            groups["failures"]["process_mtbf_s" if k == "mtbf_s" else k] = v
        elif k in ("step_s", "stall_s", "write_s", "restart_s", "restart_overhead_s", "nbytes"):
            groups["costs"][k] = v
        elif k in ("drives", "endurance", "until", "today"):
            groups["wear"][k] = v
        else:
            new[k] = v
    nouns = {"failures": fp.Failures, "costs": fp.CostOverrides, "wear": fp.Wear}
    return new | {name: nouns[name](**fields) for name, fields in groups.items() if fields}


#: `digest` of each case in CASES, computed by the keyword form before the nouns.
OLD_DIGESTS = [
    "5c7813d4d64f5001", "da1e5148c1c8f958", "5c7813d4d64f5001", "448545efd0c88c6a", "c12e5436c56761d7",
    "1e36d256c19bb240", "802eec569caa35f0", "c742e08a38453a4d", "746702892b050c9b", "ee7f3e51a10b0de4",
    "cacca848807c7a59", "d659784d472a6aaa", "4d69fa0610146ca5", "ef8fb9bb95039bf3", "76f0f5bf678b532d",
    "c140a4905c445635", "b7d8018b5e0c0ab7", "ed1080610cf7a7d8", "97c5b3d90bbc21d2", "dea884e8990b459a",
    "d8380beb3fe250f1", "481dd5d1fe4052de", "2398a7512074d78c", "2eed4d97680b9a6b", "6e195967beff96d5",
    "d9b281f42a42bedb", "ac3b4c13373a6d0f", "84c9039f78b31b70", "0fe99a06facdfe87", "68c85a923dbc1b34",
    "f6b54d57365a9fff", "d37367200b71fab5", "500264180da040ba", "7c47c14c51c0f2f1", "117e264df2998609",
    "b58308349defab37", "abf8bd7f628b0d2c", "8574e13e3b0c88c6", "6146c38de03a3e36", "b351581a0c856ca9",
    "b42bf781f9c61d67",
]  # fmt: skip


@pytest.mark.parametrize(
    ("source", "old", "expected"), [(s, k, d) for (s, k), d in zip(CASES, OLD_DIGESTS, strict=True)]
)
def test_the_nouns_give_the_advice_the_keywords_gave(
    tmp_path: Path, source: str, old: dict[str, Any], expected: str
) -> None:
    advice = fp.advise(sources(tmp_path)[source], probe_devices=False, **in_nouns(old))
    assert digest(advice, tmp_path) == expected


@pytest.mark.parametrize(("source", "old"), REFUSED)
def test_what_the_keywords_refused_the_nouns_refuse_naming_the_noun(
    tmp_path: Path, source: str, old: dict[str, Any]
) -> None:
    with pytest.raises(ValueError, match=r"pass costs=fastpersist\.CostOverrides\(|failures=fastpersist\.Failures\("):
        fp.advise(sources(tmp_path)[source], probe_devices=False, **in_nouns(old))


def test_advise_takes_at_most_eight_parameters() -> None:
    assert len(inspect.signature(fp.advise).parameters) <= 8


def test_the_old_keywords_raise_a_type_error_that_shows_the_new_call() -> None:
    with pytest.raises(TypeError) as e:
        fp.advise("bench.json", node_mtbf_s=3600.0, nodes=16, step_s=1.0, drives=4)  # type: ignore[call-arg]
    assert str(e.value) == (
        "advise(node_mtbf_s=3600.0, nodes=16, step_s=1.0, drives=4): these keywords became objects; write "
        "fastpersist.advise(..., failures=fastpersist.Failures(node_mtbf_s=3600.0, nodes=16), "
        "costs=fastpersist.CostOverrides(step_s=1.0), wear=fastpersist.Wear(drives=4))"
    )
    with pytest.raises(TypeError, match=r"failures=fastpersist\.Failures\(process_mtbf_s=86400\.0\)"):
        fp.advise(mtbf_s=86_400.0)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"^advise\(\) got an unexpected keyword argument 'mtbf_hours'$"):
        fp.advise(mtbf_hours=24.0, step_s=1.0)  # type: ignore[call-arg]


@pytest.mark.parametrize(("source", "old"), [(s, k) for s, k in CASES if set(k) - {"every"}])
def test_the_form_the_error_shows_runs_and_gives_the_same_advice(
    tmp_path: Path, source: str, old: dict[str, Any]
) -> None:
    """What the TypeError says to write is a call that works, and means what the keywords did."""
    moved = {k: v for k, v in old.items() if k != "every"}
    with pytest.raises(TypeError) as e:
        fp.advise(None, **moved)
    shown = str(e.value).split("write fastpersist.advise(..., ", 1)[1].removesuffix(")")
    names = {"fastpersist": fp, "datetime": datetime, "Endurance": Endurance}
    nouns = eval(f"dict({shown})", names)  # our own message, with the names it uses
    src = sources(tmp_path)[source]
    again = fp.advise(src, every=old.get("every"), probe_devices=False, **nouns)
    assert again == fp.advise(src, probe_devices=False, **in_nouns(old))


@pytest.mark.parametrize(
    ("make", "error", "field"),
    [
        (lambda: fp.CostOverrides(step_s=0.0), ValueError, "CostOverrides.step_s=0.0"),
        (lambda: fp.CostOverrides(step_s=True), ValueError, "CostOverrides.step_s=True"),
        (lambda: fp.CostOverrides(stall_s=-0.1), ValueError, "CostOverrides.stall_s=-0.1"),
        (lambda: fp.CostOverrides(write_s=math.nan), ValueError, "CostOverrides.write_s=nan"),
        (lambda: fp.CostOverrides(restart_s=math.inf), ValueError, "CostOverrides.restart_s=inf"),
        (lambda: fp.CostOverrides(restart_overhead_s=-30.0), ValueError, "CostOverrides.restart_overhead_s=-30.0"),
        (lambda: fp.CostOverrides(restart_s="30"), ValueError, "CostOverrides.restart_s='30'"),
        (lambda: fp.CostOverrides(nbytes=1e9), ValueError, "CostOverrides.nbytes=1000000000.0"),
        (lambda: fp.CostOverrides(nbytes=-1), ValueError, "CostOverrides.nbytes=-1"),
        (lambda: fp.Wear(drives=0), ValueError, "Wear.drives=0"),
        (lambda: fp.Wear(drives=4.0), ValueError, "Wear.drives=4.0"),
        (lambda: fp.Wear(endurance=7008.0), TypeError, "Wear.endurance=7008.0"),
        (lambda: fp.Wear(until="2027-12-31"), TypeError, "Wear.until='2027-12-31'"),
        (lambda: fp.Wear(today=datetime.datetime(2026, 12, 1)), TypeError, "Wear.today=datetime.datetime"),
        (lambda: fp.Failures(process_mtbf_s=0.0), ValueError, "Failures.process_mtbf_s=0.0"),
        (lambda: fp.Failures(node_mtbf_s=-1.0), ValueError, "Failures.node_mtbf_s=-1.0"),
        (lambda: fp.Failures(cluster_mtbf_s=math.inf), ValueError, "Failures.cluster_mtbf_s=inf"),
        (lambda: fp.Failures(node_mtbf_s=3600.0, nodes=0), ValueError, "Failures.nodes=0"),
    ],
)
def test_each_noun_refuses_a_bad_value_naming_the_field(make: Any, error: type[Exception], field: str) -> None:
    with pytest.raises(error, match=f"^{re.escape(field)}.*: expected "):
        make()


def test_advise_refuses_what_is_not_its_noun() -> None:
    with pytest.raises(TypeError, match=r"advise\(failures=3600\.0\): expected a fastpersist\.Failures"):
        fp.advise(failures=3600.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"advise\(costs=\{'step_s': 1\.0\}\): expected a fastpersist\.CostOverrides"):
        fp.advise(costs={"step_s": 1.0})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"advise\(wear=4\): expected a fastpersist\.Wear"):
        fp.advise(wear=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"advise\(failures=Failures\(.*\)\): needs a failure model"):
        fp.advise(failures=fp.Failures(nodes=16), costs=fp.CostOverrides(1.0, 0.1, 1.0, nbytes=1))


def test_several_failure_classes_add_their_rates() -> None:
    """Every failure stops a job with one level: the job's MTBF is one over the rates' sum."""
    costs = fp.CostOverrides(step_s=1.0, stall_s=0.1, write_s=1.0, nbytes=1 << 30)
    failures = fp.Failures(process_mtbf_s=7 * 86_400.0, node_mtbf_s=30 * 86_400.0, nodes=16, cluster_mtbf_s=9e6)
    a = fp.advise(failures=failures, costs=costs, probe_devices=False)
    assert a.mtbf_s == pytest.approx(1 / (1 / (7 * 86_400) + 16 / (30 * 86_400) + 1 / 9e6))
    assert a.where["mtbf_s"] == (
        "given: process MTBF 168 h, node MTBF 720 h / 16 node(s), cluster MTBF 2500 h, any of them stops the job"
    )
    alone = fp.advise(failures=fp.Failures(cluster_mtbf_s=9e6), costs=costs, probe_devices=False)
    assert alone.mtbf_s == 9e6 and alone.where["mtbf_s"] == "given: cluster MTBF 2500 h"
    assert fp.Failures().job_mtbf_s() is None
