"""The torch.distributed.checkpoint plug-in, with real gloo process groups."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fastpersist as fp
from fastpersist.integrations.dcp import FastPersistReader, FastPersistWriter, ItemInfo
from fastpersist.integrations.dcp_metadata import ITEM_INFO

from dcp_workers import (
    WIDE_CHUNK_BYTES,
    WIDE_SHAPE,
    full_state,
    full_weight,
    load_wide_counting,
    run,
    save_rank_local,
    save_wide,
)
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
        assert res["staged_dtensor"] and res["arenas_free"], (rank, res)  # async_save staged it in an arena
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
    # the allow-list names the writer's item record where it really lives
    assert (ItemInfo.__module__, ItemInfo.__qualname__) == ITEM_INFO


def test_four_ranks_read_only_their_share_of_what_two_ranks_saved(tmp_path: Any) -> None:
    """Saved by 2 ranks (row shards), loaded by 4 (row shards, then column shards): each rank's
    reads, counted at the engine's read function, come to about its share, not whole files."""
    path = str(tmp_path / "ckpt")
    for world, worker in ((2, save_wide), (4, load_wide_counting)):
        workdir = tmp_path / f"run-{world}"
        workdir.mkdir()
        for res in run_ranks(worker, world, (str(workdir), path), str(workdir), timeout_s=240):
            assert "traceback" not in res, res
    results = [json.loads((tmp_path / "run-4" / f"result-{r}.json").read_text()) for r in range(4)]
    tensor_bytes = WIDE_SHAPE[0] * WIDE_SHAPE[1] * 4
    for rank, res in enumerate(results):
        for layout in ("rows", "cols"):
            got = res[layout]
            assert got["equal"] and got["step"] == 9, (rank, layout, got)
            share, read = got["share_bytes"], got["bytes_read"]
            assert share == tensor_bytes // 4
            # each file starts with its row shard, so row and column blocks both fall on chunk
            # boundaries; the slack is the chunk holding "step" (and room for a shard's cut ends)
            assert share <= read <= share + 4 * WIDE_CHUNK_BYTES, (rank, layout, share, read)
    assert sum(r["rows"]["bytes_read"] for r in results) <= tensor_bytes + 16 * WIDE_CHUNK_BYTES


class _BoxPlanner:
    """The planner side of one ReadItem: receives the box the reader copies out."""

    def __init__(self, target: torch.Tensor) -> None:
        self.target = target
        self.committed: list[torch.Tensor] = []

    def resolve_tensor(self, item: Any) -> torch.Tensor:
        return self.target

    def commit_tensor(self, item: Any, tensor: torch.Tensor) -> None:
        self.committed.append(tensor)


def _flip(path: str, offset_bytes: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset_bytes)
        byte = f.read(1)
        f.seek(offset_bytes)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.fixture
def two_matrices(tmp_path: Any) -> tuple[str, dict[str, torch.Tensor]]:
    """Two (64, 1024) float32 matrices (4 KiB rows) in one file of 4 KiB chunks."""
    path = str(tmp_path / "ckpt")
    state = {"a": torch.randn(64, 1024), "b": torch.randn(64, 1024)}
    dcp.save(state, storage_writer=FastPersistWriter(path, fp.Config(chunk_bytes=4096)))
    return path, state


def _read_box(
    path: str, fqn: str, offsets: list[int], lengths: list[int], init: torch.Tensor | None = None
) -> tuple[torch.Tensor, FastPersistReader]:
    """Reads one box of `fqn` through the reader into `init` (default: float32 NaNs)."""
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    reader = FastPersistReader(path)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    key = next(k for k in reader.storage if k.fqn == fqn)
    zeros = torch.Size([0] * len(offsets))
    item = ReadItem(LoadItemType.TENSOR, key, zeros, key, torch.Size(offsets), torch.Size(lengths))
    planner = _BoxPlanner(torch.full(lengths, float("nan")) if init is None else init.clone())
    reader.read_data(LoadPlan([item]), planner).wait()  # type: ignore[arg-type]
    assert len(planner.committed) == 1
    return planner.target, reader


def _file_offset(path: str, fqn: str, row: int, col: int) -> tuple[str, int]:
    reader = FastPersistReader(path)
    info = next(v for k, v in reader.read_metadata().storage_data.items() if k.fqn == fqn)
    return os.path.join(path, info.relative_path), info.offset_bytes + (row * 1024 + col) * 4


def test_a_box_reads_only_its_chunks(two_matrices: tuple[str, dict[str, torch.Tensor]]) -> None:
    path, state = two_matrices
    rows, reader = _read_box(path, "b", [10, 0], [3, 1024])
    assert torch.equal(rows, state["b"][10:13]) and reader.read_stats["bytes"] == 3 * 4096
    block, reader = _read_box(path, "a", [5, 256], [40, 512])  # half of each row: every chunk under it
    assert torch.equal(block, state["a"][5:45, 256:768]) and reader.read_stats["bytes"] == 40 * 4096


def test_damage_is_caught_in_a_needed_chunk_and_ignored_elsewhere(
    two_matrices: tuple[str, dict[str, torch.Tensor]],
) -> None:
    path, state = two_matrices
    data, where = _file_offset(path, "a", 40, 7)
    _flip(data, where)
    box, _ = _read_box(path, "a", [10, 0], [20, 1024])  # rows 10..29: the damaged row 40 is not read
    assert torch.equal(box, state["a"][10:30])
    with pytest.raises(fp.ChecksumMismatchError, match=rf"bytes \[{where // 4096 * 4096}, "):
        _read_box(path, "a", [40, 512], [1, 512])  # the damaged byte is outside the box but in its chunk
    with pytest.raises(fp.ChecksumMismatchError):
        _read_box(path, "a", [38, 0], [4, 1024])
    # through dcp.load: a state that needs only "b" loads; one that needs "a" fails
    target = {"b": torch.zeros(64, 1024)}
    dcp.load(target, storage_reader=FastPersistReader(path))
    assert torch.equal(target["b"], state["b"])
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises((CheckpointException, fp.ChecksumMismatchError)) as info:
        dcp.load({"a": torch.zeros(64, 1024)}, storage_reader=FastPersistReader(path))
    failures = list(getattr(info.value, "failures", {}).values()) or [info.value]
    assert "ChecksumMismatchError" in repr(failures)


# FileSystemWriter's and FileSystemReader's arguments


def test_sync_files_is_the_durable_switch(tmp_path: Any) -> None:
    assert FastPersistWriter(tmp_path).config.durable and FastPersistWriter(tmp_path).sync_files
    off = FastPersistWriter(tmp_path, fp.Config(chunk_bytes=8192), sync_files=False)
    assert not off.config.durable and off.config.chunk_bytes == 8192 and not off.sync_files
    assert not FastPersistWriter(tmp_path, fp.Config(durable=False)).sync_files
    with pytest.raises(ValueError, match=r"sync_files=True.*durable=False"):
        FastPersistWriter(tmp_path, fp.Config(durable=False), sync_files=True)


def test_sync_files_false_skips_the_metadata_fsyncs(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The data files' fsync is the engine's (``durable``, set above); these are Python's."""
    from fastpersist import _core

    synced: list[str] = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(str(fd)))
    monkeypatch.setattr(_core, "fsync_dir", lambda path: synced.append(str(path)))
    monkeypatch.setattr(_core, "fsync_path", lambda path: synced.append(str(path)))
    state = {"w": torch.randn(32, 32)}
    dcp.save(state, storage_writer=FastPersistWriter(tmp_path / "c", sync_files=False))
    assert synced == []
    dcp.save(state, storage_writer=FastPersistWriter(tmp_path / "d"))  # the default syncs (.metadata, its dir)
    assert synced
    target = {"w": torch.zeros(32, 32)}
    dcp.load(target, storage_reader=FastPersistReader(tmp_path / "c"))
    assert torch.equal(target["w"], state["w"])


def test_thread_count_and_copy_ahead_are_taken_and_checked(tmp_path: Any) -> None:
    state = {"w": torch.randn(64, 64), "v": torch.arange(7)}
    writer = FastPersistWriter(tmp_path / "c", thread_count=8, per_thread_copy_ahead=0)
    dcp.save(state, storage_writer=writer)
    assert writer.checkpoint_id == str(tmp_path / "c") == FastPersistReader(tmp_path / "c").checkpoint_id
    assert writer.thread_count == 8 and sum(n.endswith(".fpdcp") for n in os.listdir(tmp_path / "c")) == 1
    target = {"w": torch.zeros(64, 64), "v": torch.zeros(7, dtype=torch.int64)}
    dcp.load(target, storage_reader=FastPersistReader(tmp_path / "c"))
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["v"], state["v"])
    with pytest.raises(ValueError, match="thread_count=0"):
        FastPersistWriter(tmp_path, thread_count=0)
    with pytest.raises(ValueError, match="per_thread_copy_ahead=-1"):
        FastPersistWriter(tmp_path, per_thread_copy_ahead=-1)


def test_single_file_per_rank_false_writes_one_file_per_item(tmp_path: Any) -> None:
    state = {"w": torch.randn(40, 30), "v": torch.arange(7), "step": 3}
    dcp.save(state, storage_writer=FastPersistWriter(tmp_path / "c", single_file_per_rank=False))
    files = [n for n in os.listdir(tmp_path / "c") if n.endswith(".fpdcp")]
    assert len(files) == 3, files
    target = {"w": torch.zeros(40, 30), "v": torch.zeros(7, dtype=torch.int64), "step": 0}
    dcp.load(target, storage_reader=FastPersistReader(tmp_path / "c"))
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["v"], state["v"]) and target["step"] == 3
    dcp.save(state, storage_writer=FastPersistWriter(tmp_path / "c"))  # a later save removes the old files
    assert sum(n.endswith(".fpdcp") for n in os.listdir(tmp_path / "c")) == 1


def test_overwrite_false_refuses_an_existing_checkpoint(tmp_path: Any) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    state = {"w": torch.randn(8, 8)}
    dcp.save(state, storage_writer=FastPersistWriter(tmp_path / "c", overwrite=False))  # a new directory: fine
    before = sorted(os.listdir(tmp_path / "c"))
    with pytest.raises((CheckpointException, RuntimeError)) as info:
        dcp.save({"w": torch.zeros(8, 8)}, storage_writer=FastPersistWriter(tmp_path / "c", overwrite=False))
    assert "already exists and self.overwrite=False" in repr(getattr(info.value, "failures", info.value))
    assert sorted(os.listdir(tmp_path / "c")) == before
    target = {"w": torch.zeros(8, 8)}
    dcp.load(target, storage_reader=FastPersistReader(tmp_path / "c"))
    assert torch.equal(target["w"], state["w"])
    dcp.save({"w": torch.ones(8, 8)}, storage_writer=FastPersistWriter(tmp_path / "c", overwrite=True))
    dcp.load(target, storage_reader=FastPersistReader(tmp_path / "c"))
    assert torch.equal(target["w"], torch.ones(8, 8))


def test_stream_transforms_are_refused_by_name(tmp_path: Any) -> None:
    from torch.distributed.checkpoint._extension import StreamTransformExtension, ZStandard

    # ZStandard() itself needs the zstandard module; its class is what a user would pass
    zstd = ZStandard.__new__(ZStandard)
    assert isinstance(zstd, StreamTransformExtension)
    with pytest.raises(NotImplementedError, match=r"_extensions=\[ZStandard\].*FileSystemWriter"):
        FastPersistWriter(tmp_path, _extensions=[zstd])
    assert FastPersistWriter(tmp_path, _extensions=[]).path == str(tmp_path)


def test_serialization_format_and_extension_registry_are_taken(tmp_path: Any) -> None:
    from torch.distributed.checkpoint._extension import ExtensionRegistry
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    state = {"w": torch.randn(5, 5)}
    for fmt in SerializationFormat:
        dcp.save(state, storage_writer=FastPersistWriter(tmp_path / fmt.name, serialization_format=fmt))
        target = {"w": torch.zeros(5, 5)}
        reader = FastPersistReader(tmp_path / fmt.name, _extension_registry=ExtensionRegistry())
        dcp.load(target, storage_reader=reader)
        assert torch.equal(target["w"], state["w"])


def test_positional_torch_arguments_get_a_clear_type_error(tmp_path: Any) -> None:
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    with pytest.raises(TypeError, match=r"config must be a fastpersist\.Config, not bool.*by keyword"):
        FastPersistWriter(tmp_path, True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"not ExtensionRegistry.*FileSystemReader"):
        FastPersistReader(tmp_path, ExtensionRegistry())  # type: ignore[arg-type]


def test_async_save_with_cache_staged_state_dict_reuses_its_copy(tmp_path: Any) -> None:
    writer = FastPersistWriter(tmp_path / "c", cache_staged_state_dict=True)
    state = {"w": torch.randn(16, 16)}
    dcp.async_save(state, storage_writer=writer).result()
    cached = writer.state_dict_cache
    assert cached is not None
    state["w"].add_(1)
    dcp.async_save(state, storage_writer=writer).result()
    assert writer.state_dict_cache is cached  # copied into, not made again
    target = {"w": torch.zeros(16, 16)}
    dcp.load(target, storage_reader=FastPersistReader(tmp_path / "c"))
    assert torch.equal(target["w"], state["w"])


def test_random_boxes_of_every_dtype_come_back_bit_identical(tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    g = torch.Generator().manual_seed(25)
    state = {
        "f64": torch.randn(5, 7, 300, generator=g, dtype=torch.float64),
        "bf16": torch.randn(33, 129, generator=g).to(torch.bfloat16),
        "c128": torch.randn(9, 70, generator=g, dtype=torch.complex128),
        "i8": torch.randint(-128, 127, (3, 1000), generator=g, dtype=torch.int8),
        "bool": torch.rand(17, 61, generator=g) > 0.5,
        "scalar": torch.tensor(2.5),
    }
    dcp.save(state, storage_writer=FastPersistWriter(path, fp.Config(chunk_bytes=4096)))
    for name, tensor in state.items():
        for _ in range(8):
            offsets = [int(torch.randint(0, n, (1,), generator=g)) for n in tensor.shape]
            shape = list(tensor.shape)
            lengths = [int(torch.randint(1, n - o + 1, (1,), generator=g)) for n, o in zip(shape, offsets, strict=True)]
            expected = tensor[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))]
            unlike = ~expected if expected.dtype == torch.bool else expected + 1  # differs everywhere
            box, _ = _read_box(path, name, offsets, lengths, unlike)
            assert torch.equal(box, expected), (name, offsets, lengths)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(target, storage_reader=FastPersistReader(path))
    for name, tensor in state.items():
        assert target[name].dtype == tensor.dtype and torch.equal(target[name], tensor), name


def test_rank_local_metadata_is_refused_on_several_ranks(tmp_path: Any) -> None:
    """use_collectives=False would have each rank commit .metadata alone (and drop the others' files)."""
    path = str(tmp_path / "ckpt")
    for res in run_ranks(save_rank_local, 2, (str(tmp_path), path), str(tmp_path), timeout_s=120):
        assert "use_collectives=False" in str(res.get("error")) and "traceback" not in res, res
    assert not os.path.exists(os.path.join(path, ".metadata"))
    # one process without a group: the one rank's metadata is the checkpoint's
    dcp.save({"w": torch.arange(4.0)}, storage_writer=FastPersistWriter(path), use_collectives=False)
    target = {"w": torch.zeros(4)}
    dcp.load(target, storage_reader=FastPersistReader(path))
    assert torch.equal(target["w"], torch.arange(4.0))
