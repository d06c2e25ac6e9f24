"""Shared fixtures: every save/load test runs on each backend this machine offers.

The S3 fixtures (``s3_server``, ``s3_bucket``) live in tests/s3server.py. Also loads the
hypothesis profile (``HYPOTHESIS_PROFILE=ci``, the default, or ``soak``; see tests/budget.py)
before any test module is imported.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
from s3server import s3_bucket, s3_server  # noqa: F401 (fixtures: a real S3-compatible server)

import fastpersist as fp

from backends import available_backends
from budget import register_profiles

register_profiles()

# Saves resolve Config "auto" from the tuning cache: point every test (and every worker process
# it starts) at a file nobody writes, so a developer's own `fastpersist tune` cannot change them.
os.environ["FASTPERSIST_TUNE_CACHE"] = os.path.join(
    tempfile.gettempdir(), f"fastpersist-tests-{os.getpid()}", "no-tune-cache.json"
)


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


def is_root() -> bool:
    return os.geteuid() == 0
