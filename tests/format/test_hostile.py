"""Hostile manifests: a clear error in bounded time and memory, never a crash or a huge allocation.

Each manifest here is re-sealed after editing (as an attacker would), so the checks past the
seal are what is tested. Hypothesis mutates a real manifest at random JSON paths with nasty
values; hand-written cases cover the named attacks. ``-s`` prints how many inputs were tried.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastpersist as fp
from fastpersist import _core
from fastpersist.format.seal import seal

from budget import examples

TRIED = {"generated": 0, "hand_written": 0}
#: Every input must be answered within this (generous on a shared 2-core machine).
BOUND_S = 5.0


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Any]]]:
    path = str(tmp_path_factory.mktemp("hostile") / "ck")
    state = {"w": torch.randn(64, 33), "b": torch.arange(7, dtype=torch.int16), "meta": {"step": 3, "t": (1.5, "x")}}
    fp.save(state, path, config=fp.Config(chunk_bytes=4096))
    doc = json.load(open(os.path.join(path, "manifest.json")))
    doc.pop("manifest_sha256")
    yield path, doc
    print(f"\nhostile manifests tried: {TRIED}")


def load_with(path: str, raw: bytes, spy: list[int]) -> object:
    """Writes `raw` as the manifest, loads, and records the size of every stream buffer allocated."""
    with open(os.path.join(path, "manifest.json"), "wb") as f:
        f.write(raw)
    real = _core.PagedBuffer

    def counting(nbytes: int) -> _core.PagedBuffer:
        spy.append(nbytes)
        return real(nbytes)

    _core.PagedBuffer = counting  # type: ignore[assignment,misc]
    try:
        return fp.load(path)
    finally:
        _core.PagedBuffer = real  # type: ignore[misc]


def on_disk_bytes(path: str) -> int:
    """Bytes on disk, rounded up to whole pages (a read buffer is whole pages for O_DIRECT)."""
    total = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    return -(-total // 4096) * 4096 + 4096


def check_bounded(path: str, raw: bytes) -> None:
    """Loading `raw` either works or raises a fastpersist error; quickly; allocating no more than is on disk."""
    spy: list[int] = []
    t = time.perf_counter()
    try:
        load_with(path, raw, spy)
    except (fp.FastPersistError, ValueError) as e:
        assert len(str(e)) < 2000, "an error message must stay readable"
    assert time.perf_counter() - t < BOUND_S
    assert all(n <= on_disk_bytes(path) for n in spy), f"allocated {spy} for {on_disk_bytes(path)} bytes on disk"


NASTY = st.one_of(
    st.sampled_from([-1, -(2**63), 2**63, 2**64 + 1, 10**30, 2**60 + 1, 0, 1, 4095, 1 << 30]),
    st.integers(),
    st.sampled_from(["..", "../../etc/passwd", "/etc/passwd", "a\x00b", "manifest.json", "", "\udcff", "x" * 10_000]),
    st.sampled_from(["float128", "object", "<U8", "|O", "bfloat16", "cuda:99", "meta", "pickle", "ntuple"]),
    st.text(max_size=20),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False),
    st.lists(st.integers(-(2**62), 2**62), max_size=70),
    st.just([[[[[[[[[[[]]]]]]]]]]]),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


def _paths(node: object, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


def _set(doc: Any, path: tuple[Any, ...], value: object) -> Any:
    if not path:
        return value
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


@settings(max_examples=examples(500), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_generated_hostile_manifests(base: tuple[str, dict[str, Any]], data: st.DataObject) -> None:
    path, doc = base
    doc = copy.deepcopy(doc)
    paths = _paths(doc)
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(paths))
        doc = _set(doc, where, copy.deepcopy(data.draw(NASTY)))
        paths = _paths(doc)
    TRIED["generated"] += 1
    check_bounded(path, seal(json.dumps(doc).encode()) if isinstance(doc, dict) and doc else json.dumps(doc).encode())


def _deep(n: int) -> dict[str, Any]:
    node: Any = None
    for _ in range(n):
        node = {"t": "list", "v": [node]}
    return {"spec_version": 1, "root": node}


HAND_WRITTEN = {
    "huge total": lambda d: (d.update(total_bytes=1 << 50), d["files"][0].update(len_bytes=1 << 50)),
    "huge, checksums off": lambda d: (
        d.update(checksum="off", total_bytes=1 << 40),
        d["files"][0].update(len_bytes=1 << 40, chunk_crc32c=[]),
    ),
    "huge file": lambda d: d["files"][0].update(len_bytes=(1 << 60) - 4096),
    "past 2**60": lambda d: d.update(total_bytes=1 << 70),
    "negative offset": lambda d: d["files"][0].update(stream_offset_bytes=-4096),
    # A file starting inside a chunk: an incremental save would link its chunks by the offset.
    "unaligned file": lambda d: d["files"][0].update(stream_offset_bytes=100),
    "negative blob": lambda d: d["blobs"][0].update(offset_bytes=-64),
    "overlapping blobs": lambda d: d["blobs"][1].update(offset_bytes=0),
    "overlapping files": lambda d: d["files"].append(dict(d["files"][0], name="data-w9-s0.bin")),
    "dotdot name": lambda d: d["files"][0].update(name="../ck/manifest.json"),
    "absolute name": lambda d: d["files"][0].update(name="/etc/passwd"),
    "nul name": lambda d: d["files"][0].update(name="data\x00.bin"),
    "unknown dtype": lambda d: d["tensors"][0].update(dtype="float128"),
    "object numpy dtype": lambda d: d["tensors"][0].update(kind="numpy", dtype="|O"),
    "shape overflow": lambda d: d["tensors"][0].update(shape=[2**62] * 64, stride=[1] * 64),
    "shape product overflow": lambda d: d["tensors"][0].update(shape=[2**31, 2**31, 2**31], stride=[0, 0, 0]),
    "negative stride": lambda d: d["tensors"][0].update(stride=[-1, 1]),
    "deep tree": lambda d: d.update(tree=_deep(300)),
    "deep json": lambda d: d.update(tree="__DEEP__"),
    "tree bomb": lambda d: d.update(tree={"spec_version": 1, "root": {"t": "int", "v": "9" * 100_000}}),
    "future major": lambda d: d.update(format_version=[2, 0]),
    "many chunks": lambda d: d["files"][0].update(chunk_crc32c=[0] * 1_000_000),
    "tensor index": lambda d: d.update(tree={"spec_version": 1, "root": {"t": "tensor", "i": 10**9}}),
    "shards escape": lambda d: d.update(shards=["../../x"]),
    "shard missing": lambda d: d.update(shards=["shard-00000"]),
    "big namedtuple": lambda d: d.update(
        tree={"spec_version": 1, "root": {"t": "ntuple", "module": "os", "name": "system", "fields": ["a"] * 10**5}}
    ),
}


@pytest.mark.parametrize("case", sorted(HAND_WRITTEN))
def test_hand_written_hostile_manifests(base: tuple[str, dict[str, Any]], case: str) -> None:
    path, doc = base
    doc = copy.deepcopy(doc)
    HAND_WRITTEN[case](doc)
    TRIED["hand_written"] += 1
    spy: list[int] = []
    t = time.perf_counter()
    with pytest.raises((fp.CorruptCheckpointError, ValueError)):
        text = json.dumps(doc).replace('"__DEEP__"', '{"t":"list","v":[' * 100_000 + "null" + "]}" * 100_000)
        load_with(path, seal(text.encode()), spy)
    assert time.perf_counter() - t < BOUND_S and not [n for n in spy if n > on_disk_bytes(path)]


def test_a_future_minor_version_loads_a_future_major_does_not(base: tuple[str, dict[str, Any]]) -> None:
    path, doc = base
    TRIED["hand_written"] += 3
    assert "w" in load_with(path, seal(json.dumps(dict(doc, format_version=[1, 99])).encode()), [])  # type: ignore[operator]
    with pytest.raises(fp.CorruptCheckpointError, match="upgrade fastpersist"):
        load_with(path, seal(json.dumps(dict(doc, format_version=[3, 0])).encode()), [])
    # 2.0 places the stream by each file's stream_chunks: a 1.x file list is not read as one
    with pytest.raises(fp.CorruptCheckpointError, match="stream_chunks"):
        load_with(path, seal(json.dumps(dict(doc, format_version=[2, 0])).encode()), [])


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xff\xfe{not json",
        b"{" * 100_000,
        b'{"format":"fastpersist","format_version":[1,0]}\xc3\x28',
        b"[]",
        b"{}",
    ],
)
def test_raw_garbage_manifests(base: tuple[str, dict[str, Any]], raw: bytes) -> None:
    path, _ = base
    TRIED["hand_written"] += 1
    with pytest.raises(fp.CorruptCheckpointError):
        load_with(path, raw, [])


def test_a_shard_that_is_itself_sharded_is_refused(tmp_path: Path) -> None:
    outer = tmp_path / "ck"
    outer.mkdir()
    fp.save({"w": torch.ones(3)}, str(outer / "shard-00000"))
    # Each level's manifest names a shard below it: fastpersist never writes such a layout.
    for level in (outer, outer / "shard-00000"):
        doc = json.load(open(outer / "shard-00000" / "manifest.json"))
        doc.pop("manifest_sha256")
        doc["shards"] = ["shard-00000"]
        (level / "manifest.json").write_bytes(seal(json.dumps(doc).encode()))
    with pytest.raises(fp.CorruptCheckpointError, match="may not itself be sharded"):
        fp.load(str(outer), shard=0)
