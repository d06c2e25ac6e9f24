"""The torch.distributed.checkpoint plug-in, with real gloo process groups."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fastpersist as fp
from fastpersist.integrations.dcp import FastPersistReader, FastPersistWriter

from dcp_workers import full_state, full_weight, run
from gloo import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def saved_by_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    """Two gloo ranks save a Shard(0) state (sync and async), then load it resharded to Shard(1)."""
    workdir = str(tmp_path_factory.mktemp("dcp"))
    results = run_ranks(run, 2, (workdir,), workdir, timeout_s=180)
    for res in results:
        assert "traceback" not in res, res
    return workdir, results


def test_two_ranks_save_and_load_resharded(saved_by_two_ranks: tuple[str, list[dict[str, Any]]]) -> None:
    workdir, results = saved_by_two_ranks
    for rank, res in enumerate(results):
        for mode in ("sync", "async"):
            got = res[mode]
            assert got["w"] and got["b"] and got["nested"] and got["step"] == 5, (rank, mode, got)
            assert got["local_cols"] == [8, 3]  # Shard(1) over 2 ranks
    names = sorted(os.listdir(os.path.join(workdir, "dcp")))
    assert names[0] == ".metadata" and sum(n.endswith(".fpdcp") for n in names) == 2  # one file per rank


@pytest.mark.parametrize("which", ["dcp", "dcp-async"])
def test_one_process_loads_what_two_ranks_saved(
    saved_by_two_ranks: tuple[str, list[dict[str, Any]]], which: str
) -> None:
    workdir, _ = saved_by_two_ranks
    target = {
        "w": torch.zeros(8, 6),
        "b": torch.zeros(5, dtype=torch.bfloat16),
        "step": 0,
        "nested": {"x": torch.zeros(3, dtype=torch.int16), "name": ""},
    }
    dcp.load(target, storage_reader=FastPersistReader(os.path.join(workdir, which)))
    expected = full_state()
    assert torch.equal(target["w"], full_weight()) and torch.equal(target["b"], expected["b"])
    assert target["step"] == 5 and torch.equal(target["nested"]["x"], expected["nested"]["x"])


def test_single_process_round_trip_and_a_flipped_byte_is_caught(tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    state = {"w": torch.randn(300, 70), "i": torch.arange(10)}
    dcp.save(state, storage_writer=FastPersistWriter(path, fp.Config(chunk_bytes=16 << 10)))
    dcp.save(state, storage_writer=FastPersistWriter(path))  # a second save replaces the first's files
    assert sum(n.endswith(".fpdcp") for n in os.listdir(path)) == 1
    target = {"w": torch.zeros(300, 70), "i": torch.zeros(10, dtype=torch.int64)}
    dcp.load(target, storage_reader=FastPersistReader(path))
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["i"], state["i"])
    data = next(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".fpdcp"))
    with open(data, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 1]))
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises((CheckpointException, fp.ChecksumMismatchError)) as info:
        dcp.load(target, storage_reader=FastPersistReader(path))
    # DCP wraps each rank's error (exception + traceback)
    failures = list(getattr(info.value, "failures", {}).values()) or [info.value]
    assert "ChecksumMismatchError" in repr(failures) and "fpdcp bytes [0, " in repr(failures)


def test_empty_tensors_and_values_only(tmp_path: Any) -> None:
    path = str(tmp_path / "empty")
    state = {"e": torch.zeros(0, 3), "step": 4}
    dcp.save(state, storage_writer=FastPersistWriter(path))
    target = {"e": torch.ones(0, 3), "step": 0}
    dcp.load(target, storage_reader=FastPersistReader(path))
    assert target["step"] == 4 and target["e"].shape == (0, 3)


def test_metadata_reader_refuses_foreign_globals(tmp_path: Any) -> None:
    import pickle

    path = tmp_path / "evil"
    path.mkdir()
    (path / ".metadata").write_bytes(pickle.dumps(os.system))
    with pytest.raises(fp.CorruptCheckpointError, match="never needs"):
        FastPersistReader(str(path)).read_metadata()
