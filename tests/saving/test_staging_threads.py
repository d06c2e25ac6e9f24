"""Host staging on several threads, and the staging pool faulted in ahead of the first save.

The contract: the number of staging threads changes nothing on disk (the same data files, the
same per-chunk crc32c in the manifest) on every path that stages host bytes (the pool on a
drive, a memory root's mapped files, a bounded pool that is reused while writes drain), and
``fp.prepare`` faults the pool in without a save.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
import torch

import fastpersist as fp
from fastpersist.config import MAX_STAGING_THREADS
from fastpersist.saving.pools import pool_for

CHUNK = 8 << 20  # shares of at least 2 MiB: 2 and 3 threads split each chunk


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5)
    return {
        "big": torch.randn(5 << 20, generator=gen),  # 20 MiB: chunks across a tensor
        "small": [torch.randn(n, generator=gen) for n in (1, 300, 70_000)],
        "odd": torch.arange(3 << 20, dtype=torch.int8),
        "step": 7,
    }


def _files(path: str) -> dict[str, bytes]:
    found = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            found[os.path.relpath(full, path)] = open(full, "rb").read()
    return found


@pytest.mark.parametrize("pool_bytes", [CHUNK * 2, 64 << 20], ids=["bounded", "snapshot"])
@pytest.mark.parametrize("place", ["disk", "memory"])
def test_the_thread_count_changes_no_byte_and_no_checksum(tmp_path: Any, place: str, pool_bytes: int) -> None:
    if place == "memory" and not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    base = str(tmp_path) if place == "disk" else str(tmp_path).replace("/tmp", "/dev/shm", 1)
    state = _state()
    saved = {}
    try:
        for threads in (1, 2, 3):
            config = fp.Config(chunk_bytes=CHUNK, pool_bytes=pool_bytes, staging_threads=threads)
            path = os.path.join(base, f"t{threads}")
            fp.save(state, path, config=config)
            files = _files(path)
            manifest = json.loads(files.pop("manifest.json"))
            saved[threads] = (files, manifest["files"])
            out = fp.load(path)
            assert torch.equal(out["big"], state["big"]) and torch.equal(out["odd"], state["odd"])
    finally:
        if place == "memory":
            import shutil

            shutil.rmtree(base, ignore_errors=True)
    assert saved[2] == saved[1] and saved[3] == saved[1]


def test_staging_threads_is_checked_and_resolved(monkeypatch: Any) -> None:
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match=r"Config\.staging_threads"):
            fp.Config(staging_threads=bad)  # type: ignore[arg-type]
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert fp.Config().resolved_staging_threads == max(1, min(cores - 1, MAX_STAGING_THREADS))
    assert fp.Config(staging_threads=1).resolved_staging_threads == 1
    assert fp.Config(staging_threads=10_000).resolved_staging_threads == cores  # an integer caps
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 4))  # more ranks than cores: one each
    assert fp.Config().resolved_staging_threads == 1


def _wait_allocated(pool: Any, nbytes: int) -> None:
    deadline = time.monotonic() + 60
    while pool.allocated_bytes < nbytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.allocated_bytes == nbytes


def test_prepare_faults_the_pool_in_before_the_first_save(tmp_path: Any) -> None:
    config = fp.Config(chunk_bytes=1 << 20, pool_bytes=24 << 20)
    path = str(tmp_path / "ck")
    fp.prepare(path, config=config)
    pool = pool_for(config.resolved_for(path))
    _wait_allocated(pool, 24 << 20)  # every slot made and touched, no save yet
    assert not os.path.exists(path)  # nothing written
    fp.save({"w": torch.ones(3 << 20)}, path, config=config)
    assert pool_for(config.resolved_for(path)) is pool and pool.allocated_bytes == 24 << 20  # the save used it
    with pytest.raises(ValueError, match=r"fastpersist\.prepare"):
        fp.prepare("")
    with pytest.raises(TypeError, match="config"):
        fp.prepare(path, config={"pool_bytes": 1})  # type: ignore[arg-type]
