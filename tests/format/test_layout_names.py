"""format/layout.py: each on-disk name is recognised by its own pattern, and the small-file write is atomic."""

from __future__ import annotations

import os
import pathlib
import threading

import pytest

from fastpersist.format import layout


def test_each_name_is_recognised_by_its_pattern() -> None:
    tmp = os.path.basename(layout.tmp_dir_for("/ckpt/step-00000007", "0123456789abcdef"))
    assert layout.parse_tmp_dir(tmp) == ("step-00000007", "0123456789ab")
    for tag in ("", layout.stripe_tag(rank=12), layout.stripe_tag(writer=3)):
        stripe = layout.stripe_dir_name("step-00000007", "0123456789abcdef", tag)
        assert layout.parse_stripe_dir(stripe) == ("step-00000007", "0123456789ab")
    assert layout.parse_step_dir(layout.step_dir_name(120)) == 120
    assert layout.SHARD_DIR.match(layout.shard_name(3))
    assert layout.DATA_FILE.match(layout.data_file_name(writer=2, stripe=1))
    assert layout.dcp_data_file_name(1, "0123456789ab").endswith(layout.DCP_DATA_SUFFIX)


def test_names_of_other_things_are_not_taken_for_ours() -> None:
    assert layout.parse_tmp_dir("step-7.fptmp-0123456789ab") is None  # not hidden
    assert layout.parse_tmp_dir(".step-7.fptmp-0123") is None
    assert layout.parse_stripe_dir("step-7.0123456789ab.fpstripe.bak") is None
    assert layout.parse_step_dir("step-7") is None
    assert layout.INDEX_TMP.match(".other.json.tmp-12-34") is None


@pytest.mark.parametrize("name", [layout.INDEX_NAME, layout.HISTORY_NAME])
def test_the_cleaner_recognises_the_temporary_file_of_an_index_write(tmp_path: pathlib.Path, name: str) -> None:
    seen: list[str] = []
    with pytest.raises(RuntimeError), layout.atomic_file(str(tmp_path / name), durable=False) as tmp:
        seen.append(os.path.basename(tmp))
        raise RuntimeError("the writer dies here")
    assert layout.parse_tmp_dir(seen[0]) is not None and layout.parse_tmp_dir(seen[0])[0] == name  # type: ignore[index]
    assert os.listdir(tmp_path) == []  # the writer that raised removed it; a killed one: tests/format/test_tmp_files.py


@pytest.mark.parametrize("durable", [True, False])
def test_write_small_file_replaces_the_file_and_leaves_nothing_else(tmp_path: pathlib.Path, durable: bool) -> None:
    path = tmp_path / layout.INDEX_NAME
    layout.write_small_file(str(path), b"old", durable=durable)
    layout.write_small_file(str(path), b"new", durable=durable)
    assert path.read_bytes() == b"new"
    assert os.listdir(tmp_path) == [layout.INDEX_NAME]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "x.json"
    path.write_bytes(b"old")
    with pytest.raises(OSError), layout.atomic_file(str(path), durable=True) as tmp:
        pathlib.Path(tmp).write_bytes(b"half")
        raise OSError("disk full")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["x.json"]


def test_concurrent_writers_each_replace_the_file_whole(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / layout.HISTORY_NAME)
    payloads = [bytes([65 + i]) * 100_000 for i in range(4)]
    threads = [
        threading.Thread(target=layout.write_small_file, args=(path, p), kwargs={"durable": False}) for p in payloads
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pathlib.Path(path).read_bytes() in payloads
    assert os.listdir(tmp_path) == [layout.HISTORY_NAME]
