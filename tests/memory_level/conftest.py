"""The memory-level tests' root: a fresh directory under /dev/shm, removed after the test once
any spare being made for it (memory_level/spares.py) has been made or given up."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from fastpersist.memory_level.spares import wait_spare


@pytest.fixture
def shm_root() -> Iterator[str]:
    parent = tempfile.mkdtemp(prefix="fp-test-mem-", dir="/dev/shm")
    yield os.path.join(parent, "ck")
    wait_spare()
    shutil.rmtree(parent, ignore_errors=True)
