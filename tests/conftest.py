"""Shared fixtures: every save/load test runs on each backend this machine offers.

The S3 fixtures (``s3_server``, ``s3_bucket``) live in tests/helpers/s3server.py. Also loads the
hypothesis profile (``HYPOTHESIS_PROFILE=ci``, the default, or ``soak``; see tests/helpers/budget.py)
before any test module is imported, and installs tests/helpers/netguard.py: no test reaches anything
but this machine, nor an object store it did not name (``no_traffic_beyond_loopback``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

import fastpersist as fp
from fastpersist.gpu import pinned
from fastpersist.memory_level.spares import wait_spare

import netguard
from backends import available_backends
from budget import register_profiles
from fake_cuda import FakeRuntime
from s3server import s3_bucket, s3_server  # noqa: F401 (fixtures: a real S3-compatible server)

register_profiles()
netguard.install()

# Saves resolve Config "auto" from the tuning cache: point every test (and every worker process
# it starts) at a file nobody writes, so a developer's own `fastpersist tune` cannot change them.
os.environ["FASTPERSIST_TUNE_CACHE"] = os.path.join(
    tempfile.gettempdir(), f"fastpersist-tests-{os.getpid()}", "no-tune-cache.json"
)


#: The GPU check (scripts/gpu_check.sh, docs/gpu.md) sets FASTPERSIST_GPU_CHECK=1 to run only the
#: tests that need CUDA (a skip reason naming CUDA), those named for it, and the device path's
#: modules (test_device*.py, through the fakes).
GPU_CHECK = os.environ.get("FASTPERSIST_GPU_CHECK") == "1"


def _for_gpu_check(item: pytest.Item) -> bool:
    if item.path.name == "test_gpu_check.py":  # runs the GPU check itself
        return False
    names_cuda = any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))
    return names_cuda or "cuda" in item.nodeid.lower() or item.path.name.startswith("test_device")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not GPU_CHECK:
        return
    kept = [item for item in items if _for_gpu_check(item)]
    config.hook.pytest_deselected(items=[item for item in items if not _for_gpu_check(item)])
    items[:] = kept


@pytest.fixture(autouse=True)
def no_traffic_beyond_loopback() -> Iterator[None]:
    """Fails a test that reached beyond this machine, or an object store it did not name
    (tests/helpers/netguard.py): its trap, or a Python socket to a non-loopback address."""
    yield
    found = netguard.take()
    if found:
        pytest.fail("this test reached beyond what it configured (tests/helpers/netguard.py): " + "; ".join(found[:5]))


@pytest.fixture(params=available_backends())
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def config(backend: str) -> fp.Config:
    """Small chunks so that small states still span several chunks and files."""
    return fp.Config(backend=backend, chunk_bytes=64 << 10, pool_bytes=1 << 20, queue_depth=4)


@pytest.fixture
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A directory on a disk that accepts O_DIRECT (pytest's tmp dir is on the root ext4 here)."""
    path = tmp_path_factory.mktemp("ckpt")
    yield str(path)


@pytest.fixture
def shm_root() -> Iterator[str]:
    """A fresh root under /dev/shm (the memory-level tests), removed after the test once any
    spare being made for it (memory_level/spares.py) has been made or given up."""
    parent = tempfile.mkdtemp(prefix="fp-test-mem-", dir="/dev/shm")
    yield os.path.join(parent, "ck")
    wait_spare()
    shutil.rmtree(parent, ignore_errors=True)


def is_root() -> bool:
    return os.geteuid() == 0


@pytest.fixture
def fake_runtime() -> Iterator[FakeRuntime]:
    """Pinning (fastpersist.gpu.pinned) goes through a FakeRuntime; the once-per-process warning is
    reset."""
    runtime = FakeRuntime()
    previous = pinned.use_runtime(runtime)
    warned, pinned._warned = pinned._warned, False
    try:
        yield runtime
    finally:
        pinned.use_runtime(previous)
        pinned._warned = warned
