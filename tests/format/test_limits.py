"""Save and load apply the same manifest limits: nothing commits that load would refuse.

The manifest-size limit (1 GiB) is lowered here so the boundary is cheap to reach; save and
load read the one definition in fastpersist.format.limits, so both sides move together.
"""

from __future__ import annotations

import collections
import json
import os

import numpy as np
import pytest
import torch

import fastpersist as fp
from fastpersist.format import limits

SMALL_LIMIT = 64 << 10


@pytest.fixture
def small_limit(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(limits, "MAX_MANIFEST_BYTES", SMALL_LIMIT)
    return SMALL_LIMIT


def manifest_bytes(path: str) -> int:
    return os.path.getsize(os.path.join(path, "manifest.json"))


def test_a_manifest_of_exactly_the_limit_saves_and_loads_one_byte_more_does_not(
    workdir: str, config: fp.Config, small_limit: int
) -> None:
    path = os.path.join(workdir, "ck")
    fp.save({"w": torch.ones(8), "notes": "x"}, path, config=config)
    overhead = manifest_bytes(path) - 1  # everything but the one-character string
    fp.save({"w": torch.ones(8), "notes": "x" * (small_limit - overhead)}, path, config=config)
    assert manifest_bytes(path) == small_limit
    assert len(fp.load(path, config=config)["notes"]) == small_limit - overhead
    with pytest.raises(fp.UnsupportedValueError, match="MAX_MANIFEST_BYTES"):
        fp.save({"w": torch.ones(8), "notes": "y" * (small_limit - overhead + 1)}, path, config=config)
    assert fp.load(path, config=config)["notes"][0] == "x"  # the previous checkpoint is in place


def test_an_oversized_save_names_the_limit_and_the_largest_values_and_commits_nothing(
    workdir: str, config: fp.Config, small_limit: int
) -> None:
    path = os.path.join(workdir, "ck")
    fp.save({"step": 1}, path, config=config)
    state = {"model": {"w": torch.ones(4)}, "log": ["a" * 30_000, "b" * 50_000], "meta": {"name": "c" * 20_000}}
    with pytest.raises(fp.UnsupportedValueError) as caught:
        fp.save(state, path, config=config)
    message = str(caught.value)
    assert f"over the {small_limit}-byte limit (MAX_MANIFEST_BYTES)" in message and "nothing was committed" in message
    # Largest first, by key path: the 50 KB, the 30 KB, then the 20 KB string.
    assert message.index("'state.log[1]'") < message.index("'state.log[0]'") < message.index("'state.meta.name'")
    assert len(message) < 2000
    assert fp.load(path, config=config) == {"step": 1}
    assert sorted(os.listdir(workdir)) == ["ck"]  # no temporary directory left behind


def test_a_checkpointer_with_keep_1_keeps_the_previous_step(workdir: str, config: fp.Config, small_limit: int) -> None:
    ck = fp.Checkpointer(os.path.join(workdir, "run"), keep=1, config=config)
    ck.save(0, {"w": torch.ones(4), "notes": "ok"})
    ck.wait()
    ck.save(1, {"w": torch.ones(4), "notes": "z" * small_limit})
    with pytest.raises(fp.UnsupportedValueError, match="MAX_MANIFEST_BYTES"):
        ck.wait()
    assert ck.steps() == [0] and ck.load(0)["notes"] == "ok"


def test_load_refuses_what_save_refuses(workdir: str, config: fp.Config, small_limit: int) -> None:
    path = os.path.join(workdir, "ck")
    fp.save({"notes": "x" * 40_000}, path, config=config)
    manifest = os.path.join(path, "manifest.json")
    doc = json.load(open(manifest))
    doc["extra"] = {"padding": "p" * small_limit}  # not sealed either; the size is checked first
    open(manifest, "w").write(json.dumps(doc))
    with pytest.raises(fp.CorruptCheckpointError, match=f"over the {small_limit}-byte limit"):
        fp.load(path, config=config)


def test_large_bytes_do_not_count_against_the_manifest(workdir: str, config: fp.Config, small_limit: int) -> None:
    path = os.path.join(workdir, "ck")
    blob = os.urandom(4 * small_limit)
    fp.save({"tokenizer": blob}, path, config=config)  # base64 would be 5.3x the limit
    assert manifest_bytes(path) < 4096 and fp.load(path, config=config)["tokenizer"] == blob


# ----------------------------------------------------------------------------- field limits


def test_a_tensor_of_more_dimensions_than_load_accepts_is_refused_at_save(workdir: str, config: fp.Config) -> None:
    path = os.path.join(workdir, "ck")
    fp.save({"w": torch.zeros([1] * limits.MAX_DIMS)}, path, config=config)
    assert fp.load(path, config=config)["w"].dim() == limits.MAX_DIMS
    with pytest.raises(fp.UnsupportedValueError, match=r"'state\.deep'.*65 dimensions"):
        fp.save({"deep": torch.zeros([1] * (limits.MAX_DIMS + 1))}, path, config=config)


def test_a_size_of_more_dimensions_than_load_accepts_is_refused_at_save(workdir: str, config: fp.Config) -> None:
    path = os.path.join(workdir, "ck")
    fp.save({"s": torch.Size([2] * limits.MAX_DIMS)}, path, config=config)
    assert fp.load(path, config=config)["s"] == torch.Size([2] * limits.MAX_DIMS)
    with pytest.raises(fp.UnsupportedValueError, match=r"'state\.s'.*torch\.Size of at most 64"):
        fp.save({"s": torch.Size([2] * (limits.MAX_DIMS + 1))}, path, config=config)


def test_namedtuples_load_would_refuse_are_refused_at_save(workdir: str, config: fp.Config) -> None:
    renamed = collections.namedtuple("Renamed", ["ok", "def"], rename=True)  # type: ignore[misc]  # field "_1"
    wide = collections.namedtuple("Wide", [f"f{i}" for i in range(limits.MAX_NTUPLE_FIELDS + 1)])  # type: ignore[misc]
    path = os.path.join(workdir, "ck")
    for value in (renamed(1, 2), wide(*range(limits.MAX_NTUPLE_FIELDS + 1))):
        with pytest.raises(fp.UnsupportedValueError, match=r"'state\.t'.*namedtuple 'fields'"):
            fp.save({"t": value}, path, config=config)
    assert not os.path.exists(path)


def test_numpy_dtypes_load_would_refuse_are_refused_at_save(workdir: str, config: fp.Config) -> None:
    path = os.path.join(workdir, "ck")
    with pytest.raises(fp.UnsupportedValueError, match=r"'state\.text'.*<U1000000"):
        fp.save({"text": np.array(["a"], dtype="<U1000000")}, path, config=config)
    fp.save({"text": np.array(["a"], dtype="<U999")}, path, config=config)
    assert fp.load(path, config=config)["text"].dtype.str == "<U999"
