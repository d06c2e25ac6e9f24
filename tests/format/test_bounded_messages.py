"""Every value an error message quotes from a file or from the caller's state stays bounded.

A manifest (re-sealed after editing, as an attacker would) or a state may carry a 10 KB key
path, file name, dtype or stripe path; the message must stay short and still name the thing
by the start of what it quotes.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import fastpersist as fp
from fastpersist.format.quote import shown
from fastpersist.format.seal import seal

#: The bound test_hostile.py puts on every message.
MESSAGE_BOUND = 2000
HUGE = 10_000


def test_shown_keeps_head_and_tail_within_the_limit() -> None:
    text = shown("state." + "k" * HUGE + ".exp_avg")
    assert len(text) <= 80
    assert text.startswith("'state.kkk") and ".exp_avg'" in text and f"({HUGE + 16} chars)" in text
    assert shown("short") == "'short'"
    assert len(shown("x" * HUGE, limit=200)) == 200


def test_shown_never_raises() -> None:
    class Hostile:
        def __repr__(self) -> str:
            raise RuntimeError("no repr for you")

    assert shown(Hostile()) == "<Hostile>"
    assert shown(10**5000) == "<int>"  # past sys.get_int_max_str_digits()


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Any]]]:
    path = str(tmp_path_factory.mktemp("bounded") / "ck")
    fp.save({"w": torch.randn(4, 3), "step": 3}, path, config=fp.Config(chunk_bytes=4096))
    doc = json.load(open(os.path.join(path, "manifest.json")))
    doc.pop("manifest_sha256")
    yield path, doc


def _huge_key_path(d: dict[str, Any]) -> None:
    d["tensors"][0].update(key_path="state." + "k" * HUGE, blob=7)


def _huge_key_path_and_dims(d: dict[str, Any]) -> None:
    d["tensors"][0].update(key_path="state." + "k" * HUGE, shape=[2**61] * 64, stride=[1] * 63)


def _huge_dtype(d: dict[str, Any]) -> None:
    d["tensors"][0].update(dtype="float" + "9" * HUGE)


def _huge_numpy_dtype(d: dict[str, Any]) -> None:
    d["tensors"][0].update(kind="numpy", dtype="<f" + "4" * HUGE)


def _huge_file_name(d: dict[str, Any]) -> None:
    d["files"][0].update(name="data" + "d" * HUGE + ".bin")


def _huge_stripe_path(d: dict[str, Any]) -> None:
    d.update(stripes=["/" + "s" * HUGE + ".fpstripe"])


def _huge_tree_tag(d: dict[str, Any]) -> None:
    d["tree"]["root"]["v"][1] = {"t": "tag" + "t" * HUGE}


def _huge_namedtuple_name(d: dict[str, Any]) -> None:
    d["tree"]["root"]["v"][1] = {"t": "ntuple", "module": "m", "name": "n" * HUGE, "fields": [], "v": []}


def _huge_record_field(d: dict[str, Any]) -> None:
    d["tensors"][0]["f" * HUGE] = 1


# (how the manifest is edited, what the message must still start to quote)
CASES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "key path": (_huge_key_path, "'state.kkkk"),
    "key path with 64 dims": (_huge_key_path_and_dims, "[2305843009213693952, "),
    "dtype": (_huge_dtype, "'float999"),
    "numpy dtype": (_huge_numpy_dtype, "'<f444"),
    "file name": (_huge_file_name, "'datadddd"),
    "stripe path": (_huge_stripe_path, "'/sss"),
    "tree tag": (_huge_tree_tag, "'tagttt"),
    "record field": (_huge_record_field, "['ffff"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_manifest_messages_are_bounded_and_name_the_value(base: tuple[str, dict[str, Any]], case: str) -> None:
    path, doc = base
    edit, head = CASES[case]
    doc = copy.deepcopy(doc)
    edit(doc)
    with open(os.path.join(path, "manifest.json"), "wb") as f:
        f.write(seal(json.dumps(doc).encode()))
    with pytest.raises(fp.CorruptCheckpointError) as caught:
        fp.load(path)
    message = str(caught.value)
    assert len(message) < MESSAGE_BOUND, message[:300]
    assert head in message, message


def test_namedtuple_name_is_refused_in_bounded_words(base: tuple[str, dict[str, Any]]) -> None:
    path, doc = base
    doc = copy.deepcopy(doc)
    _huge_namedtuple_name(doc)
    with open(os.path.join(path, "manifest.json"), "wb") as f:
        f.write(seal(json.dumps(doc).encode()))
    with pytest.raises(fp.CorruptCheckpointError, match="namedtuple 'module' and 'name'") as caught:
        fp.load(path)
    assert len(str(caught.value)) < MESSAGE_BOUND


def test_unsupported_value_under_a_huge_key_is_bounded() -> None:
    with pytest.raises(fp.UnsupportedValueError) as caught:
        fp.save({"k" * HUGE: object()}, "/nonexistent/never-written")
    assert len(str(caught.value)) < MESSAGE_BOUND
    assert "'state.kkk" in str(caught.value)


def test_unsupported_huge_dict_key_is_bounded() -> None:
    with pytest.raises(fp.UnsupportedValueError) as caught:
        fp.save({frozenset(["a" * HUGE]): 1}, "/nonexistent/never-written")
    assert len(str(caught.value)) < MESSAGE_BOUND and "(frozenset({'aaa" in str(caught.value)


def test_out_fill_mismatch_under_a_huge_key_is_bounded(workdir: str, config: fp.Config) -> None:
    key = "k" * HUGE
    path = os.path.join(workdir, "ck")
    fp.save({key: torch.ones(3)}, path, config=config)
    with pytest.raises(ValueError, match=r"out= tensor 'state\.kkk") as caught:
        fp.load(path, out={key: torch.ones(4)}, config=config)
    assert len(str(caught.value)) < MESSAGE_BOUND


def test_checksum_mismatch_names_a_huge_key_path_in_bounded_words(workdir: str, config: fp.Config) -> None:
    path = os.path.join(workdir, "ck")
    fp.save({"k" * HUGE: torch.ones(1000)}, path, config=config)
    data = fp.inspect(path)["files"][0]["path"]
    raw = bytearray(Path(data).read_bytes())
    raw[100] ^= 0xFF
    Path(data).write_bytes(bytes(raw))
    with pytest.raises(fp.ChecksumMismatchError) as caught:
        fp.load(path, config=config)
    assert len(str(caught.value)) < MESSAGE_BOUND
    assert "tensors affected: 'state.kkk" in str(caught.value)
    assert caught.value.tensors == ["state." + "k" * HUGE]  # the attribute keeps the whole key path
