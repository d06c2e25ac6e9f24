"""engine.PartFile (the Rust PartFileWriter) through Python: a part file written from pieces
that come from elsewhere, each chunk checked on the way, on a disk and on /dev/shm; and the
copies that use it (the remote level's directory store) leave no file when they fail."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastpersist as fp
from fastpersist import _core
from fastpersist.engine import PartFile, check_part_file

CHUNK = 64 << 10


@pytest.fixture(params=["disk", "memory"])
def where(request: Any, tmp_path: Path) -> Any:
    if request.param == "disk":
        yield tmp_path
        return
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        yield Path(d)


def _data(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _crcs(data: bytes, chunk: int = CHUNK) -> list[int]:
    return [_core.crc32c(data[i : i + chunk]) for i in range(0, len(data), chunk)]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 600_000), cuts=st.lists(st.integers(0, 600_000), max_size=6))
def test_pieces_of_any_size_and_address_make_the_file_and_it_checks(
    tmp_path_factory: Any, n: int, cuts: list[int]
) -> None:
    data = _data(n)
    bounds = sorted({c for c in cuts if c < n} | {0, n})
    path = tmp_path_factory.mktemp("pf") / "part"
    pages = _core.PagedBuffer(max(n, 1) + 4096)  # page-aligned sources: the zero-copy path
    with PartFile(path, n, _crcs(data), CHUNK) as out:
        for lo, hi in itertools.pairwise(bounds):
            if (hi - lo) % 4096 == 0 and lo % 4096 == 0:
                view = memoryview(pages)[: hi - lo]
                view[:] = data[lo:hi]
                out.append(view)
            else:
                out.append(data[lo:hi])
    assert path.read_bytes() == data
    assert check_part_file(path, n, _crcs(data), CHUNK) == len(_crcs(data))


def test_a_damaged_piece_is_refused_naming_the_file_and_range_and_no_file_is_left(where: Path) -> None:
    data = _data(5 * CHUNK + 100)
    damaged = bytearray(data)
    damaged[3 * CHUNK + 5] ^= 0xFF
    path = where / "part"
    with pytest.raises(fp.ChecksumMismatchError) as e, PartFile(path, len(data), _crcs(data), CHUNK) as out:
        out.append(bytes(damaged[: 2 * CHUNK]))
        out.append(bytes(damaged[2 * CHUNK :]))
    assert str(path) in str(e.value) and f"[{3 * CHUNK}, {4 * CHUNK})" in str(e.value)
    assert (e.value.offset_bytes, e.value.len_bytes) == (3 * CHUNK, CHUNK)
    assert not path.exists()


def test_a_file_that_ends_short_fails_and_is_removed(where: Path) -> None:
    path = where / "part"
    with (
        pytest.raises(fp.CorruptCheckpointError, match="expected 100 bytes, found 99"),
        PartFile(path, 100, [], CHUNK) as out,
    ):
        out.append(b"x" * 99)
    assert not path.exists()


def test_an_existing_file_is_refused_and_left_alone_and_a_link_is_never_followed(where: Path) -> None:
    path = where / "part"
    path.write_bytes(b"someone else's")
    with pytest.raises(FileExistsError):
        PartFile(path, 3, [], CHUNK)
    assert path.read_bytes() == b"someone else's"
    link = where / "link"
    link.symlink_to(path)
    with pytest.raises(OSError):
        PartFile(link, 3, [], CHUNK, replace=True)
    assert path.read_bytes() == b"someone else's"
    with PartFile(path, 3, [], CHUNK, replace=True) as out:
        out.append(b"new")
    assert path.read_bytes() == b"new"


def test_check_part_file_names_the_first_bad_chunk(where: Path) -> None:
    data = _data(3 * CHUNK)
    path = where / "part"
    path.write_bytes(data[:CHUNK] + bytes([data[CHUNK] ^ 1]) + data[CHUNK + 1 :])
    seen: list[int] = []
    with pytest.raises(fp.ChecksumMismatchError) as e:
        check_part_file(path, len(data), _crcs(data), CHUNK, seen.append)
    assert e.value.offset_bytes == CHUNK


def test_a_download_that_meets_a_damaged_object_leaves_no_local_file(tmp_path: Path) -> None:
    from fastpersist.levels.remote_stores import DirStore, FileCopy

    data = _data(4 * CHUNK + 17)
    store = DirStore(str(tmp_path / "store"))
    (tmp_path / "store" / "step").mkdir()
    damaged = bytearray(data)
    damaged[-3] ^= 1
    (tmp_path / "store" / "step" / "part").write_bytes(bytes(damaged))
    local = tmp_path / "local" / "part"
    with pytest.raises(fp.ChecksumMismatchError):
        store.download("step/part", str(local), FileCopy("part", len(data), _crcs(data), CHUNK))
    assert not local.exists()
    (tmp_path / "store" / "step" / "part").write_bytes(data)
    store.download("step/part", str(local), FileCopy("part", len(data), _crcs(data), CHUNK))
    assert local.read_bytes() == data


def test_an_upload_writes_the_store_s_copy_through_the_engine_and_overwrites_one_there(tmp_path: Path) -> None:
    from fastpersist.levels.remote_stores import DirStore, FileCopy

    data = _data(3 * CHUNK + 4096 * 3 + 1)
    local = tmp_path / "part"
    local.write_bytes(data)
    store = DirStore(str(tmp_path / "store"))
    (tmp_path / "store" / "step").mkdir()
    (tmp_path / "store" / "step" / "part").write_bytes(b"an older, longer copy" * 100_000)
    store.upload("step/part", str(local), FileCopy("part", len(data), _crcs(data), CHUNK), lambda n: None)
    assert (tmp_path / "store" / "step" / "part").read_bytes() == data
    assert os.stat(tmp_path / "store" / "step" / "part").st_mode & 0o777 == 0o644
