"""Bytes values over 4 KiB travel in the data stream (format 1.2), not as base64 in the manifest.

They come back as ``bytes`` (type exact) from every load path: ``fp.load``, ``out=`` fills,
``map_location``, converting to and from safetensors and torch files (group loads: see
tests/loading/test_group_load.py, whose replicated state holds one). Small ones stay inline.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastpersist as fp
from fastpersist.format.flatten import flatten
from fastpersist.format.records import BYTES_INLINE_MAX_BYTES
from fastpersist.format.seal import seal
from fastpersist.interop.convert import convert

from budget import examples

LIMIT = BYTES_INLINE_MAX_BYTES


def manifest_of(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "manifest.json")) as f:
        doc: dict[str, Any] = json.load(f)
    return doc


def assert_same_values(a: object, b: object, where: str = "state") -> None:
    """Same structure and leaves, with bytes exactly bytes."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), where  # type: ignore[arg-type]
        for k in a:
            assert_same_values(a[k], b[k], f"{where}[{k!r}]")  # type: ignore[index]
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where  # type: ignore[arg-type]
        for i, (x, y) in enumerate(zip(a, b, strict=True)):  # type: ignore[call-overload]
            assert_same_values(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    else:
        assert a == b, where


def leaves_of(x: object) -> list[object]:
    if isinstance(x, dict):
        return [leaf for v in x.values() for leaf in leaves_of(v)]
    if isinstance(x, list):
        return [leaf for v in x for leaf in leaves_of(v)]
    return [x]


def sized_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


# Sizes around the threshold and well past it; the data stream checks them as it checks tensors.
byte_values = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([LIMIT - 1, LIMIT, LIMIT + 1, 3 * LIMIT + 7, 70_000]).map(lambda n: sized_bytes(n, n)),
    st.integers(LIMIT + 1, 5 * LIMIT).map(lambda n: sized_bytes(n, n)),
)
states = st.recursive(
    st.one_of(byte_values, st.integers(), st.text(max_size=5), st.just(torch.arange(5.0))),
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=4), kids, max_size=4)),
    max_leaves=10,
)


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=states)
def test_random_states_with_large_and_small_bytes_round_trip(backend: str, state: object) -> None:
    path = tempfile.mkdtemp(prefix="fp-bytes-", dir="/var/tmp")
    try:
        fp.save({"s": state}, os.path.join(path, "ck"), config=fp.Config(backend=backend, chunk_bytes=4096))
        back = fp.load(os.path.join(path, "ck"), config=fp.Config(backend=backend))
        assert_same_values({"s": state}, back)
        raw = Path(path, "ck", "manifest.json").read_bytes()
        for value in leaves_of(state):
            if isinstance(value, bytes) and len(value) > LIMIT:  # in the stream, not base64 in the manifest
                assert base64.b64encode(value[:96]) not in raw
    finally:
        shutil.rmtree(path)


def test_only_large_bytes_leave_the_manifest(workdir: str, config: fp.Config) -> None:
    big, edge = sized_bytes(LIMIT + 1, 1), sized_bytes(LIMIT, 2)
    path = os.path.join(workdir, "ck")
    fp.save({"big": big, "edge": edge, "again": big, "w": torch.ones(2)}, path, config=config)
    doc = manifest_of(path)
    records = {t["key_path"]: t for t in doc["tensors"]}
    assert records["state.big"]["kind"] == "numpy" and records["state.big"]["dtype"] == "|u1"
    assert records["state.big"]["shape"] == [LIMIT + 1]
    assert "state.edge" not in records and "state.again" not in records  # inline; the same object once
    assert doc["tree"]["spec_version"] == 2 and doc["format_version"] == [1, 2]
    back = fp.load(path, config=config)
    assert type(back["big"]) is bytes and back["big"] == big and back["edge"] == edge
    assert back["again"] is back["big"]  # one object per record, as saved


def test_a_tree_without_large_bytes_stays_spec_version_1(workdir: str, config: fp.Config) -> None:
    path = os.path.join(workdir, "ck")
    fp.save({"small": b"x" * LIMIT, "w": torch.ones(2)}, path, config=config)
    assert manifest_of(path)["tree"]["spec_version"] == 1  # a 1.1 reader loads it


def test_bytes_blob_in_a_version_1_tree_is_refused(workdir: str, config: fp.Config) -> None:
    path = os.path.join(workdir, "ck")
    fp.save({"big": sized_bytes(LIMIT + 1)}, path, config=config)
    doc = manifest_of(path)
    doc.pop("manifest_sha256")
    doc["tree"]["spec_version"] = 1
    Path(path, "manifest.json").write_bytes(seal(json.dumps(doc).encode()))
    with pytest.raises(fp.CorruptCheckpointError, match="unknown node tag 'bytes_blob'"):
        fp.load(path, config=config)


def test_a_bytes_blob_must_name_a_uint8_record(workdir: str, config: fp.Config) -> None:
    path = os.path.join(workdir, "ck")
    fp.save({"big": sized_bytes(LIMIT + 1), "w": torch.ones(2)}, path, config=config)
    doc = manifest_of(path)
    doc.pop("manifest_sha256")
    doc["tree"]["root"]["v"][0]["i"] = 1  # the float tensor
    Path(path, "manifest.json").write_bytes(seal(json.dumps(doc).encode()))
    with pytest.raises(fp.CorruptCheckpointError, match="does not name a 1-D uint8 record"):
        fp.load(path, config=config)


def test_damage_to_a_large_bytes_value_is_a_checksum_error_naming_it(workdir: str, config: fp.Config) -> None:
    path = os.path.join(workdir, "ck")
    fp.save({"blob": sized_bytes(70_000)}, path, config=config)
    data = fp.inspect(path)["files"][0]["path"]
    raw = bytearray(Path(data).read_bytes())
    raw[1000] ^= 0x01
    Path(data).write_bytes(bytes(raw))
    with pytest.raises(fp.ChecksumMismatchError, match=r"tensors affected: 'state\.blob'"):
        fp.load(path, config=config)


def test_out_fills_take_bytes_from_the_checkpoint(workdir: str, config: fp.Config) -> None:
    big = sized_bytes(3 * LIMIT)
    path = os.path.join(workdir, "ck")
    fp.save({"w": torch.arange(4.0), "blob": big, "step": 3}, path, config=config)
    w = torch.zeros(4)
    state = fp.load(path, out={"w": w, "blob": b"stale" * 2000, "step": 0}, config=config)
    assert state["w"] is w and torch.equal(w, torch.arange(4.0))
    assert type(state["blob"]) is bytes and state["blob"] == big and state["step"] == 3
    assert fp.load(path, out={"w": torch.zeros(4)}, config=config)["blob"] == big


@pytest.mark.parametrize("location", ["cpu", {"cpu": "cpu"}, lambda storage, _where: storage])
def test_map_location_leaves_bytes_as_bytes(workdir: str, config: fp.Config, location: object) -> None:
    big = sized_bytes(LIMIT * 2)
    path = os.path.join(workdir, "ck")
    fp.save({"w": torch.ones(3), "blob": big}, path, config=config)
    state = fp.load(path, location, config=config)  # type: ignore[arg-type]
    assert type(state["blob"]) is bytes and state["blob"] == big


@pytest.mark.parametrize("via", ["safetensors", "torch"])
def test_conversions_keep_large_bytes(workdir: str, via: str) -> None:
    state = {"w": torch.arange(3.0), "blob": sized_bytes(3 * LIMIT), "small": b"ab", "nest": [sized_bytes(LIMIT + 5)]}
    src, mid, out = (os.path.join(workdir, n) for n in ("src", f"mid.{via}", "out"))
    fp.save(state, src)
    convert(src, via, mid)  # type: ignore[arg-type]
    convert(mid, "fastpersist", out)
    assert_same_values(state, fp.load(out))
    if via == "safetensors":
        import safetensors.torch

        assert set(safetensors.torch.load_file(mid)) == {"w", "blob", "nest.0"}


def test_flatten_views_large_bytes_without_copying() -> None:
    big = sized_bytes(LIMIT * 4)
    flat = flatten({"blob": big})
    (blob,) = flat.blobs
    assert blob.nbytes == len(big) and blob.version is None and blob.source is big
    assert blob.data.ctypes.data == np.frombuffer(big, dtype=np.uint8).ctypes.data
