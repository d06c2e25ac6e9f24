"""`fastpersist bench`: the synthetic state, the flatten+plan timer, and a tiny end-to-end run."""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import math
import mmap
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from fastpersist.format.flatten import flatten
from fastpersist.tools import bench, cli
from fastpersist.tools.bench import state as bench_state
from fastpersist.tools.bench import system
from fastpersist.tools.bench.report import flatten_plan_line, miss_bound

from backends import uring_available

MiB = 1 << 20


@pytest.mark.parametrize("size", [8 * MiB, 32 * MiB])
def test_state_is_about_14_bytes_per_parameter_and_the_requested_size(size: int) -> None:
    state = bench.build_state(size)
    summary = bench.state_summary(state)
    shape = bench.gpt_shape(size)
    assert abs(summary["bytes"] / size - 1) < 0.03
    assert 13.9 < summary["bytes"] / shape.params < 14.1
    assert summary["tensors"] >= 200  # hundreds of tensors, of varied sizes
    sizes = {t.numel() for t in state["model"].values()}
    assert len(sizes) >= 5 and min(sizes) <= shape.hidden and max(sizes) >= shape.vocab * shape.hidden
    # the parts of a mixed-precision Adam state
    assert state["model"]["h.0.attn.c_attn.weight"].dtype == torch.bfloat16
    assert state["optimizer"]["fp32_master"][0].dtype == torch.float32
    assert set(state["optimizer"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["model"]["lm_head.weight"] is state["model"]["wte.weight"]  # tied
    assert isinstance(state["step"], int) and isinstance(state["lr"], float)
    assert state["optimizer"]["param_groups"][0]["params"] == list(state["optimizer"]["state"])


def test_safetensors_view_is_flat_and_unshared() -> None:
    state = bench.build_state(8 * MiB)
    tensors, metadata = bench_state.safetensors_view(state)
    assert "model.lm_head.weight" in tensors and "optimizer.state.0.exp_avg" in tensors
    ptrs = [t.untyped_storage().data_ptr() for t in tensors.values()]
    assert len(set(ptrs)) == len(ptrs)
    assert json.loads(metadata["values"])["step"] == state["step"]
    assert len(tensors) == len(flatten(state).tensors) + 1  # the tied head, cloned


def test_flatten_plan_of_10k_tensors_is_measured() -> None:
    result = bench.flatten_plan_seconds(10_000, runs=3)
    assert result["tensors"] == 10_000
    assert len(result["seconds"]) == 3
    assert 0 < result["min_s"] <= result["median_s"] <= result["max_s"] < 5
    assert 0 < result["attribute_reads_median_s"] < 5  # the part that is torch's own entry points
    # The native walk by default, and the Python walk (the reference) timed in the same run.
    assert result["walk"] == "native"
    assert len(result["python_seconds"]) == 3 and 0 < result["python_min_s"] <= result["python_median_s"] < 5
    assert "(native walk)" in flatten_plan_line(result) and "the Python walk interleaved" in flatten_plan_line(result)


def _resident_pages(path: str) -> int:
    """How many of `path`'s pages are in the page cache (mincore of a read-only mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw)


def test_evict_files_empties_the_page_cache_of_a_runs_files(workdir: str) -> None:
    nested = os.path.join(workdir, "ckpt")
    os.makedirs(nested)
    paths = [os.path.join(workdir, "a.bin"), os.path.join(nested, "b.bin")]
    for p in paths:
        with open(p, "wb") as f:
            f.write(os.urandom(4 * MiB))
        with open(p, "rb") as f:
            f.read()
    if _resident_pages(paths[0]) == 0:
        pytest.skip("this file system keeps no page cache for the files (nothing to evict)")
    system.evict_files([workdir])
    assert [_resident_pages(p) for p in paths] == [0, 0]


def test_reps_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bench", "--size", "8MiB", "--reps", "0", "--dir", str(tmp_path), "--json", str(tmp_path / "b.json")])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, str]:
    """One `fastpersist bench --size 8MiB --reps 1` through the CLI, shared by the tests below."""
    root = tmp_path_factory.mktemp("bench")
    argv = ["bench", "--size", "8MiB", "--reps", "1", "--dir", str(root / "data"), "--json", str(root / "b.json")]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        argv += ["--plot", str(root / "b.png")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(argv) == 0
    return json.loads((root / "b.json").read_text()), root, out.getvalue()


def test_tiny_run_reports_every_method_with_sane_numbers(tiny_run: tuple[dict[str, Any], Path, str]) -> None:
    report, root, stdout = tiny_run
    results = report["results"]
    expected = {
        "write_limit_engine",
        "fastpersist_save_threads",
        "fastpersist_save_async_return",
        "fastpersist_save_async_staged",
        "fastpersist_save_async_durable",
        "fastpersist_torch_save",
        "torch_save",
        "safetensors_save",
        "dcp_save_t1",
        "dcp_save_t4",
        "read_limit_engine",
        "read_fresh_engine",
        "fastpersist_load",
        "torch_load",
        "safetensors_load_mmap",
        "safetensors_load_pread",
    }
    if shutil.which("fio"):
        expected.add("write_limit_fio")
    if uring_available():
        expected.add("fastpersist_save_io_uring")
    config = report["config"]
    if config["chunk_bytes"] != 64 * MiB:
        expected.add("write_limit_engine_64m")
    if (config["chunk_bytes"], config["read_queue_depth"]) != (64 * MiB, 2):
        expected.add("read_limit_engine_64m")
    assert expected <= set(results), expected - set(results)
    nbytes = report["state"]["bytes"]
    assert abs(nbytes / (8 * MiB) - 1) < 0.03
    for key, r in results.items():
        assert len(r["seconds"]) == 1, key
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"] < 60, key
        if key != "fastpersist_save_async_return":
            assert 0 < r["gb_per_s"] < 1000 and math.isfinite(r["gb_per_s"]), key
            assert r["ratio_to_limit"] > 0, key
    _check_limits_are_the_fastest_rows(report, stdout)
    durable = results["fastpersist_save_async_durable"]["median_s"]
    assert results["fastpersist_save_async_return"]["median_s"] <= durable
    assert results["fastpersist_save_async_staged"]["median_s"] <= durable
    assert report["flatten_plan"]["tensors"] == 10_000
    rss = report["rss"]
    assert rss["mode"] == "bounded" and rss["pool_bytes"] < nbytes and rss["delta_bytes"] >= 0, rss
    # what a save_async would hold besides its pool (fp.save, which waits, makes no early copy)
    assert 0 < rss["async_early_copy_bytes"] <= 64 * MiB and rss["async_early_copy_tensors"] > 0, rss
    assert report["speedups"] and report["targets"]
    # A missed target says what bounded it, from the same run's phases.
    lines = stdout.splitlines()
    for i, line in enumerate(lines):
        if "[MISS]" in line:
            assert lines[i + 1].strip().startswith("bound: "), lines[i : i + 2]
    for key in ("save_vs_limit", "save_vs_safetensors", "torch_save_vs_torch", "load_vs_limit", "flatten_plan", "rss"):
        assert "no phase measured" not in miss_bound(key, report), key
    for key, phases in report["save_phases"].items():
        assert key.startswith("fastpersist_save_") and key in results, key
        assert set(phases) == {"flatten_plan", "staging", "write_fsync", "commit"}, phases
        assert phases["write_fsync"] <= results[key]["max_s"], (key, phases)
    load_phases = report["load_phases"]["fastpersist_load"]
    assert {"manifest", "read", "crc32c", "build", "place", "unflatten"} <= set(load_phases), load_phases
    assert load_phases["read"] <= results["fastpersist_load"]["max_s"], load_phases
    assert all(count >= report["state"]["tensors"] for count in report["loaded_tensors"].values())
    # the table, and nothing left behind
    headings = ("SAVE", "LOAD", "WHERE A SAVE'S TIME GOES", "WHERE A LOAD'S TIME GOES", "SPEEDUPS", "TARGETS")
    for word in (*headings, "torch.save + fsync"):
        assert word in stdout
    assert not [p for p in os.listdir(root / "data") if p.startswith(".fastpersist-bench-")]


def _check_limits_are_the_fastest_rows(report: dict[str, Any], stdout: str) -> None:
    """`write_limit`/`read_limit` name the fastest limit row of their kind; every ratio is over it."""
    results = report["results"]
    assert "64 MiB x 2" in results.get("write_limit_engine_64m", {"label": "64 MiB x 2"})["label"]
    assert "as the save" in results["write_limit_engine"]["label"]
    for kind, ref in (("save", report["write_limit"]), ("load", report["read_limit"])):
        limits = {k: r["median_s"] for k, r in results.items() if r["kind"] == kind and r["role"] == "limit"}
        assert len(limits) >= 2 and ref == min(limits, key=limits.__getitem__), (ref, limits)
        for key, r in results.items():
            if r["kind"] == kind and "gb_per_s" in r:
                assert r["ratio_to_limit"] == pytest.approx(r["gb_per_s"] / results[ref]["gb_per_s"]), key
        assert results[ref]["ratio_to_limit"] == pytest.approx(1.0)
        assert all(results[k]["ratio_to_limit"] <= 1 + 1e-9 for k in limits)
        assert results[ref]["label"] in stdout.split("x limit: GB/s over the fastest limit row, ")[1].splitlines()[0]
    targets = {t["key"]: t for t in report["targets"]}
    fp_save = report["fastpersist_save"]
    assert targets["save_vs_limit"]["value"] == results[fp_save]["ratio_to_limit"]
    assert results[report["write_limit"]]["label"] in targets["save_vs_limit"]["name"]
    assert results[report["read_limit"]]["label"] in targets["load_vs_limit"]["name"]
    assert ("save_vs_engine" in targets) == (report["write_limit"] != "write_limit_engine")


def _fake_bench(medians: dict[str, tuple[str, str, float]]) -> Any:
    """A stand-in for `Bench` that `summarise` reads: rows (kind, role, median s) and the byte count."""
    from types import SimpleNamespace

    from fastpersist.tools.bench.measure import Row

    rows = {k: Row(k, f"{k} label", kind, role, seconds=[s]) for k, (kind, role, s) in medians.items()}
    return SimpleNamespace(rows=rows, nbytes=1 << 30)


def test_the_limits_are_the_fastest_limit_rows_and_a_miss_names_them() -> None:
    from fastpersist.tools.bench.report import summarise

    bench_rows = {
        "write_limit_engine": ("save", "limit", 0.50),
        "write_limit_engine_64m": ("save", "limit", 0.35),
        "write_limit_fio": ("save", "limit", 0.40),
        "fastpersist_save_io_uring": ("save", "fastpersist", 0.49),
        "safetensors_save": ("save", "peer", 0.60),
        "fastpersist_torch_save": ("save", "fastpersist", 0.52),
        "torch_save": ("save", "peer", 1.20),
        "read_limit_engine": ("load", "limit", 0.60),
        "read_fresh_engine": ("load", "limit", 0.55),
        "read_limit_engine_64m": ("load", "limit", 0.45),
        "fastpersist_load": ("load", "fastpersist", 0.50),
    }
    summary = summarise(_fake_bench(bench_rows), {})
    results = summary["results"]
    assert summary["write_limit"] == "write_limit_engine_64m" and summary["read_limit"] == "read_limit_engine_64m"
    assert results["fastpersist_save_io_uring"]["ratio_to_limit"] == pytest.approx(0.35 / 0.49)
    assert results["write_limit_fio"]["ratio_to_limit"] == pytest.approx(0.35 / 0.40)
    assert results["fastpersist_load"]["ratio_to_limit"] == pytest.approx(0.45 / 0.50)
    targets = {t["key"]: t for t in summary["targets"]}
    assert targets["save_vs_limit"]["ok"] is False
    assert "write_limit_engine_64m label" in targets["save_vs_limit"]["name"]
    # the save against the engine at its own settings, printed too
    assert targets["save_vs_engine"]["value"] == pytest.approx(0.50 / 0.49) and targets["save_vs_engine"]["ok"]
    assert targets["load_vs_limit"]["value"] == pytest.approx(0.9) and targets["load_vs_limit"]["ok"]
    # the save matches the drive at its own settings, so those settings are what the miss names
    phases = {"flatten_plan": 0.01, "staging": 0.3, "write_fsync": 0.47, "commit": 0.01}
    bound = miss_bound("save_vs_limit", {**summary, "save_phases": {"fastpersist_save_io_uring": phases}})
    assert "at them in 0.500 s (write_limit_engine label) against 0.350 s" in bound and "fastpersist tune" in bound
    # fio wins where it is the fastest; without the 64 MiB rows the limits are the old ones
    bench_rows["write_limit_fio"] = ("save", "limit", 0.30)
    assert summarise(_fake_bench(bench_rows), {})["write_limit"] == "write_limit_fio"
    del bench_rows["write_limit_fio"], bench_rows["write_limit_engine_64m"], bench_rows["read_limit_engine_64m"]
    summary = summarise(_fake_bench(bench_rows), {})
    assert summary["write_limit"] == "write_limit_engine" and summary["read_limit"] == "read_fresh_engine"
    assert "save_vs_engine" not in {t["key"] for t in summary["targets"]}
    # a missed save target is bounded by the save's phases, measured against the fastest limit
    phases = {"flatten_plan": 0.01, "staging": 0.3, "write_fsync": 0.45, "commit": 0.01}
    report = {**summary, "save_phases": {"fastpersist_save_io_uring": phases}}
    bound = miss_bound("save_vs_safetensors", report)
    assert "write_fsync 0.450 s" in bound and "at the drive's limit (write_limit_engine label)" in bound
    assert f"{0.60 / 0.50:.2f}x" in bound
    # fp.torch_save's miss is bounded by the same limit
    torch_bound = miss_bound("torch_save_vs_torch", report)
    assert "fp.torch_save took 0.520 s against 0.500 s" in torch_bound and "would be 2.40x" in torch_bound


def test_tiny_run_draws_the_chart(tiny_run: tuple[dict[str, Any], Path, str]) -> None:
    pytest.importorskip("matplotlib")
    _, root, _ = tiny_run
    png = (root / "b.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_advise_reads_a_real_bench_report(tiny_run: tuple[dict[str, Any], Path, str]) -> None:
    report, root, _ = tiny_run
    out = io.StringIO()
    argv = ["advise", "--from-bench", str(root / "b.json"), "--step-seconds", "1", "--mtbf-hours", "1000", "--json"]
    with contextlib.redirect_stdout(out):
        assert cli.main(argv) == 0
    advice = json.loads(out.getvalue())
    results = report["results"]
    assert advice["costs"]["stall_s"] == results["fastpersist_save_async_staged"]["median_s"]
    assert advice["costs"]["write_s"] == results["fastpersist_save_async_durable"]["median_s"]
    assert advice["costs"]["restart_s"] == results["fastpersist_load"]["median_s"]
    assert advice["costs"]["nbytes"] == report["state"]["bytes"]
    assert advice["best"]["every"] >= 1 and advice["devices"][0]["path"] == str((root / "data").resolve())


def test_null_sink_probe_times_a_real_save_pipeline_and_leaves_nothing(tmp_path: Path) -> None:
    from fastpersist.tools.bench.nullsink import null_sink_save, null_sink_vs_memcpy

    state = bench.build_state(8 * MiB)
    result = null_sink_vs_memcpy(str(tmp_path), state, runs=2)
    assert result["bytes"] == sum(b.nbytes for b in flatten(state).blobs)
    assert 0 < result["memcpy_s"] and 0 < result["null_sink_s"] < 60
    assert result["ratio"] == pytest.approx(result["memcpy_s"] / result["null_sink_s"])
    assert result["phases"]["staging"] > 0
    assert list(tmp_path.iterdir()) == []  # never committed, and its empty files are gone
    (tmp_path / "stripe").mkdir()
    one = null_sink_save({"w": torch.ones(1000)}, str(tmp_path), stripes=[str(tmp_path / "stripe")])
    assert one["seconds"] > 0 and [p.name for p in tmp_path.iterdir()] == ["stripe"]
    assert list((tmp_path / "stripe").iterdir()) == []
