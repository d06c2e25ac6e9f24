"""scripts/gpu_check.sh without a GPU: its stage list, its dry run (when a wheel was built), and
the CPU smoke mode of the scripts it runs (benches/gpu_check.py, benches/gpu_preflight.py)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent.parent
SCRIPT = str(REPO / "scripts" / "gpu_check.sh")
STAGES = ["install", "preflight", "tests", "bench"]


def _list(*flags: str) -> list[str]:
    done = subprocess.run(["bash", SCRIPT, *flags, "--list"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def _stage_limits(lines: list[str]) -> dict[str, int]:
    limits = {}
    for line in lines:
        match = re.match(r"stage (\w+), timeout (\d+) s: ", line)
        if match:
            limits[match.group(1)] = int(match.group(2))
    return limits


def test_the_stages_run_in_order_within_six_minutes() -> None:
    lines = _list()
    limits = _stage_limits(lines)
    assert list(limits) == STAGES
    total = int(re.fullmatch(r"at most (\d+) s in all", lines[-1]).group(1))  # type: ignore[union-attr]
    assert sum(limits.values()) < total <= 360


def test_the_gpu_run_requires_cuda_and_the_dry_run_needs_none() -> None:
    run = "\n".join(_list("--size", "1GiB"))
    assert "gpu_preflight.py" in run and "--require-cuda" in run
    assert "FASTPERSIST_GPU_CHECK=1" in run and "tests/saving/test_device.py" in run
    assert "--collect-only" not in run and "fails if a test that needs a CUDA device is skipped" in run
    assert "test_gpu_check.py" not in run  # the check does not run itself
    assert "benches/gpu_check.py --size 1GiB" in run and "--device cpu" not in run
    dry = "\n".join(_list("--dry-run"))
    assert _stage_limits(dry.splitlines()).keys() == set(STAGES)
    assert "--require-cuda" not in dry
    assert "pytest --collect-only" in dry
    assert "benches/gpu_check.py --device cpu" in dry
    for text in (run, dry):
        assert "--no-index" in text  # the install never reaches the network


def test_the_gpu_check_selection_keeps_the_cuda_tests_and_drops_the_rest() -> None:
    env = {**os.environ, "FASTPERSIST_GPU_CHECK": "1"}
    files = ["tests/format/test_flatten.py", "tests/saving/test_device.py", "tests/tools/test_gpu_check.py"]
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:]
    kept = [line for line in done.stdout.splitlines() if "::" in line]
    assert "tests/format/test_flatten.py::test_device_tensors_stay_on_their_device_until_staged[cuda]" in kept
    assert not any("[fake]" in line or "test_gpu_check.py" in line for line in kept)
    assert any(line.startswith("tests/saving/test_device.py::") for line in kept)  # the fakes' device tests
    assert not any("test_flatten_of_10k_tensors_is_fast" in line for line in kept)


def test_an_unknown_option_is_refused() -> None:
    done = subprocess.run(["bash", SCRIPT, "--gpu"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "usage:" in done.stderr


def test_without_a_wheel_the_install_fails_and_nothing_runs_against_it(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "logs"
    env = {**os.environ, "OUT": str(out), "FASTPERSIST_GPU_CHECK_WHEELS": str(tmp_path / "none")}
    done = subprocess.run(
        ["bash", SCRIPT, "--dry-run", "--dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 1
    assert "no manylinux wheel in target/wheels: run scripts/build_gpu_wheel.sh" in (out / "install.log").read_text()
    lines = (out / "summary.txt").read_text().splitlines()[1:]
    assert [tuple(line.split()[:2]) for line in lines] == [("install", "1"), *((s, "skipped") for s in STAGES[1:])]
    assert all(line.endswith("s  not run: the install failed") for line in lines[1:])
    assert not (out / "bench.log").exists()


@pytest.mark.slow
def test_the_dry_run_installs_the_wheel_offline_and_runs_every_stage(tmp_path: pathlib.Path) -> None:
    if not list((REPO / "target" / "wheels").glob("fastpersist-*-abi3-manylinux*.whl")):
        pytest.skip("no wheel in target/wheels (scripts/build_gpu_wheel.sh builds one)")
    out = tmp_path / "logs"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out)}
    env.pop("PYTHONPATH", None)  # every stage must import the installed wheel
    done = subprocess.run(
        ["bash", SCRIPT, "--dry-run", "--dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split()[:2] for line in summary[1:]] == [[stage, "0"] for stage in STAGES]
    install = (out / "install.log").read_text()
    assert re.search(r"imported /\S+/fastpersist/__init__\.py", install)
    assert str(REPO / "python") not in install.split("imported ", 1)[1].split()[0]
    preflight = (out / "preflight.log").read_text()
    assert "ok: save and load with backend=threads (the save used threads)" in preflight
    assert "wheel tag: cp311-abi3-manylinux" in preflight
    tests = (out / "tests.log").read_text()
    assert re.search(r"\d+/\d+ tests collected \(\d+ deselected\)", tests)
    assert "test_flatten.py::test_device_tensors_stay_on_their_device_until_staged[cuda]" in tests
    assert "test_flatten.py::test_device_tensors_stay_on_their_device_until_staged[fake]" not in tests
    bench = (out / "bench.log").read_text()
    assert "round trip, loaded to cpu: ok" in bench and "optimizer state loaded into a fresh AdamW: ok" in bench
    assert "overlap:" in bench
    assert not (tmp_path / "fastpersist-gpu-check").exists()  # the checkpoints were removed


@pytest.mark.slow
def test_the_bench_smoke_mode_checks_the_round_trip_on_the_cpu(tmp_path: pathlib.Path) -> None:
    bench = str(REPO / "benches" / "gpu_check.py")
    argv = [sys.executable, bench, "--device", "cpu", "--size", "8MiB", "--reps", "1", "--dir", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    lines = done.stdout
    assert "round trip, loaded to cpu: ok (model on {'cpu'})" in lines
    assert "optimizer state loaded into a fresh AdamW: ok" in lines
    assert "load to map_location='cpu': ok" in lines
    assert re.search(r"checksum off: .* save_async returned in [\d.]+ ms", lines)
    assert re.search(r"checksum crc32c: .* save_async returned in [\d.]+ ms", lines)
    assert re.search(r"one warmed Checkpointer\(every=\d+\)", lines)
    assert re.search(r"fp.torch_save from cpu: .* fp.save \(target >= 0.8x\)", lines)
    assert re.search(r"dcp.save\(FastPersistWriter\) from cpu: .* fp.save", lines)
    # benches/gpu_targets.py's sections, each measured (or saying why not)
    assert re.search(r"staging 0.0 GiB in \d+ fp32 tensors: save_async -> wait_staged", lines)
    assert re.search(r"training loop( \(GPT-2|: not measured)", lines)
    if "training loop (GPT-2" in lines:  # a host state in the smoke mode: every step saved
        assert re.search(r"every=1 in a group \(1 gloo rank\): .* 25 of 25 steps saved", lines)
    assert "pinned memory over 100 saves" in lines
    assert os.listdir(tmp_path) == []


def test_the_bench_describes_its_sections_and_options() -> None:
    bench = str(REPO / "benches" / "gpu_check.py")
    done = subprocess.run([sys.executable, bench, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for words in ("round trip", "device-to-host", "load to the device", "overlap", "--size", "--device {cuda,cpu}"):
        assert words in done.stdout


def test_the_bench_refuses_cuda_without_a_device(tmp_path: pathlib.Path) -> None:
    if _cuda_available():
        pytest.skip("this machine has a CUDA device")
    bench = str(REPO / "benches" / "gpu_check.py")
    done = subprocess.run([sys.executable, bench, "--dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "torch sees no CUDA device" in done.stderr


def test_the_preflight_fails_when_cuda_is_required_and_absent(tmp_path: pathlib.Path) -> None:
    if _cuda_available():
        pytest.skip("this machine has a CUDA device")
    preflight = str(REPO / "benches" / "gpu_preflight.py")
    argv = [sys.executable, preflight, "--dir", str(tmp_path), "--require-cuda"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ok: save and load with backend=threads (the save used threads)" in done.stdout
    assert "FAIL: torch sees no CUDA device" in done.stdout
    assert os.listdir(tmp_path) == []


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
