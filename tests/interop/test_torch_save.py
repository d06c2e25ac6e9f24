"""fp.torch_save as a drop-in for torch.save: every kind of `f`, every argument, real zip CRCs.

Each test does the same thing through ``fp.torch_save`` and ``torch.save`` and compares what
comes out: the bytes (a path on the fast path is laid out byte for byte as torch.save lays out
a buffer, but for the serialization id torch derives from its own running CRC), what
``torch.load`` and ``zipfile`` make of them, and the exceptions.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import shutil
import stat
import struct
import subprocess
import types
import zipfile
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_interop import _state, assert_same

import fastpersist as fp
from fastpersist.interop import torchfile
from fastpersist.interop.ziprecords import zip_records

from budget import examples

SERIALIZATION_ID = ".data/serialization_id"


def torch_bytes(obj: object, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, **kwargs)
    return buf.getvalue()


def without_serialization_id(data: bytes) -> bytes:
    """`data` with the serialization id record's bytes and its CRC fields zeroed."""
    out = bytearray(data)
    records = zip_records(lambda at, n: data[at : at + n], len(data))
    (rec,) = [r for r in records if r.name.endswith(SERIALIZATION_ID)]
    out[rec.data_offset_bytes : rec.data_offset_bytes + rec.len_bytes] = bytes(rec.len_bytes)
    for at in rec.crc_offsets:
        out[at : at + 4] = bytes(4)
    return bytes(out)


@pytest.fixture
def crc_off() -> Iterator[None]:
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


@pytest.fixture
def debug_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="fastpersist")
    return caplog


# ----------------------------------------------------------------------------- paths: the fast path


def test_a_path_is_laid_out_as_torch_save_lays_it_out_with_real_crcs(workdir: str, config: fp.Config) -> None:
    state = _state()
    path = os.path.join(workdir, "state.pt")
    res = fp.torch_save(state, path, config=config)  # 64 KiB chunks: records and CRCs straddle them
    assert res.backend == config.backend and res.nbytes == os.path.getsize(path)
    data = open(path, "rb").read()
    assert without_serialization_id(data) == without_serialization_id(torch_bytes(state))
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
    for rec in zip_records(lambda at, n: data[at : at + n], len(data)):
        crc = zlib.crc32(data[rec.data_offset_bytes : rec.data_offset_bytes + rec.len_bytes])
        assert [struct.unpack_from("<L", data, at)[0] for at in rec.crc_offsets] == [crc] * len(rec.crc_offsets)
    assert_same(state, torch.load(path, weights_only=True))
    assert not [p for p in os.listdir(workdir) if p != "state.pt"]  # no temporary left behind


_DTYPES = [torch.uint8, torch.int16, torch.float32, torch.float64, torch.bfloat16, torch.bool]


@st.composite
def tensor_states(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """Tensors of random sizes around the 64-byte record alignment and the chunk size, some views."""
    state: dict[str, torch.Tensor] = {}
    for i in range(draw(st.integers(1, 8))):
        numel = draw(st.sampled_from([0, 1, 15, 16, 17, 63, 64, 65, 1000, 16383, 16384, 16385, 40000]))
        t = torch.arange(numel, dtype=torch.float64).to(draw(st.sampled_from(_DTYPES)))
        state[f"t{i}"] = t
        if numel > 2 and draw(st.booleans()):
            state[f"v{i}"] = t[1:-1]  # shares t's storage: one record
    return state


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=tensor_states())
def test_random_states_get_torch_saves_layout_and_valid_crcs(workdir: str, state: dict[str, torch.Tensor]) -> None:
    path = os.path.join(workdir, "r.pt")
    config = fp.Config(chunk_bytes=64 << 10, pool_bytes=1 << 20)  # records straddle chunks
    assert fp.torch_save(state, path, config=config).backend != "torch.save"
    data = open(path, "rb").read()
    assert without_serialization_id(data) == without_serialization_id(torch_bytes(state))
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
    assert_same(state, torch.load(path, weights_only=True))


def test_unzip_tests_the_file_clean(workdir: str, config: fp.Config) -> None:
    if shutil.which("unzip") is None:
        pytest.skip("unzip is not installed")
    path = os.path.join(workdir, "state.pt")
    fp.torch_save(_state(), path, config=config)
    done = subprocess.run(["unzip", "-t", path], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "No errors detected" in done.stdout, done.stdout + done.stderr


def test_set_crc32_options_false_is_honoured_as_torch_save_honours_it(workdir: str, crc_off: None) -> None:
    state = _state()
    path = os.path.join(workdir, "state.pt")
    res = fp.torch_save(state, path)
    assert res.backend != "torch.save"
    expected = torch_bytes(state)
    assert open(path, "rb").read() == expected  # CRCs 0 in both, and the same serialization id
    with zipfile.ZipFile(path) as ours, zipfile.ZipFile(io.BytesIO(expected)) as theirs:
        assert ours.testzip() == theirs.testzip() == "archive/data.pkl"  # the first bad CRC
    assert_same(state, torch.load(path, weights_only=True))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("protocol", [2, 3, 4, 5, -1])
def test_every_pickle_protocol_takes_the_fast_path(workdir: str, protocol: int) -> None:
    state = {"w": torch.arange(10.0), "n": [1, 2, (3, "x")]}
    path = os.path.join(workdir, "p.pt")
    assert fp.torch_save(state, path, pickle_protocol=protocol).backend != "torch.save"
    assert without_serialization_id(open(path, "rb").read()) == without_serialization_id(
        torch_bytes(state, pickle_protocol=protocol)
    )
    assert_same(state, torch.load(path, weights_only=False))  # weights_only reads protocol 2 only


def test_disable_byteorder_record_takes_the_fast_path(workdir: str) -> None:
    state = {"w": torch.arange(10.0)}
    path = os.path.join(workdir, "b.pt")
    res = fp.torch_save(state, path, _disable_byteorder_record=True)
    assert res.backend != "torch.save"
    data = open(path, "rb").read()
    expected = torch_bytes(state, _disable_byteorder_record=True)
    assert without_serialization_id(data) == without_serialization_id(expected)
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
    assert_same(state, torch.load(path, weights_only=True))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_arguments_are_taken_positionally_as_torch_save_takes_them(workdir: str) -> None:
    from pathlib import Path

    path = Path(workdir) / "pos.pt"
    res = fp.torch_save({"w": torch.ones(2)}, path, pickle, 3, True, False)
    assert res.backend != "torch.save" and res.path == str(path)
    assert torch.equal(torch.load(path, weights_only=False)["w"], torch.ones(2))
    with zipfile.ZipFile(path) as z:
        assert z.read("archive/data.pkl")[:2] == b"\x80\x03"  # pickled with protocol 3, as asked


@pytest.mark.parametrize("obj", [{}, {"n": 1, "s": "x"}, torch.ones(3), [torch.zeros(0), torch.ones(1)]])
def test_edge_states(workdir: str, obj: Any) -> None:
    path = os.path.join(workdir, "edge.pt")
    fp.torch_save(obj, path)
    assert_same(obj, torch.load(path, weights_only=True))
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None


def test_a_zip64_archive_gets_its_crc_fields_from_the_zip64_records(workdir: str) -> None:
    """A storage over 4 GiB: sizes and offsets move into zip64 extra fields and end records."""
    big = torch.empty(1 << 32 | 1, dtype=torch.uint8)  # never touched: no memory is used
    skel = torchfile.capture_skeleton({"big": big, "small": torch.arange(3)})
    sparse = os.path.join(workdir, "skeleton.zip")  # the skeleton, holes left sparse on disk
    with open(sparse, "wb") as f:
        for at, data in skel.pieces:
            f.seek(at)
            f.write(data)
        f.truncate(skel.total_bytes)
    with zipfile.ZipFile(sparse) as z:
        expected = {i.filename: (i.header_offset, i.compress_size) for i in z.infolist()}
    fields = torchfile.crc32_fields(skel)
    records = {r.name: r for r in zip_records(torchfile._skeleton_bytes(skel), skel.total_bytes)}
    assert expected["archive/data/0"][1] == 1 << 32 | 1  # the zip64 case indeed
    for name, (header, size) in expected.items():
        rec = records[name]
        assert rec.len_bytes == size and header < rec.data_offset_bytes < header + 4096
    assert (records["archive/data/0"].data_offset_bytes, 1 << 32 | 1) in [(f.start_bytes, f.len_bytes) for f in fields]


# ----------------------------------------------------------------------------- what torch.save writes


class WriteFlushOnly:
    """The least torch.save accepts: write and flush."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def write(self, b: Any) -> int:
        self.chunks.append(bytes(b))
        return len(self.chunks[-1])

    def flush(self) -> None:
        pass

    def getvalue(self) -> bytes:
        return b"".join(self.chunks)


class NoSeekable:
    """A file-like object without seekable() (as torch's own FilelikeMock)."""

    def __init__(self) -> None:
        self.bytesio = io.BytesIO()
        for name in ("read", "readline", "seek", "tell", "write", "flush", "getvalue"):
            setattr(self, name, getattr(self.bytesio, name))


def _file_objects(workdir: str) -> dict[str, Any]:
    return {
        "BytesIO": io.BytesIO,
        "write and flush only": WriteFlushOnly,
        "no seekable": NoSeekable,
        "open file": lambda: open(os.path.join(workdir, f"open-{len(os.listdir(workdir))}.pt"), "w+b"),
    }


@pytest.mark.parametrize("kind", ["BytesIO", "write and flush only", "no seekable", "open file"])
def test_file_objects_are_written_by_torch_save_itself(
    workdir: str, kind: str, debug_log: pytest.LogCaptureFixture
) -> None:
    state = _state()
    make = _file_objects(workdir)[kind]
    ours, theirs = make(), make()
    res = fp.torch_save(state, ours)
    torch.save(state, theirs)
    assert res.backend == "torch.save" and "hands" in debug_log.text and "not a path" in debug_log.text
    values = []
    for f in (ours, theirs):
        if hasattr(f, "getvalue"):
            values.append(f.getvalue())
        else:
            f.seek(0)
            values.append(f.read())
            f.close()
    assert values[0] == values[1]
    assert res.nbytes in (0, len(values[0]))  # 0 where the object cannot tell its position
    assert_same(state, torch.load(io.BytesIO(values[0]), weights_only=True))


class CallRecorder:
    """A file-like object that records which of its methods are called (torch's FilelikeMock)."""

    def __init__(self) -> None:
        self.calls: set[str] = set()
        self.bytesio = io.BytesIO()
        for name in ("read", "readline", "seek", "tell", "write", "flush"):
            setattr(self, name, self._traced(name))

    def _traced(self, name: str) -> Any:
        def call(*args: Any) -> Any:
            self.calls.add(name)
            return getattr(self.bytesio, name)(*args)

        return call


@pytest.mark.parametrize("use_zip", [True, False], ids=["zip", "legacy"])
def test_a_file_object_gets_only_the_calls_torch_save_makes(use_zip: bool) -> None:
    """torch's test_serialization_filelike_api_requirements, through fp.torch_save: given a
    duck-typed file object, nothing outside {write, flush} is called (no tell() to count bytes)."""
    ours, theirs = CallRecorder(), CallRecorder()
    t = torch.randn(3, 5)
    res = fp.torch_save(t, ours, _use_new_zipfile_serialization=use_zip)
    torch.save(t, theirs, _use_new_zipfile_serialization=use_zip)
    assert ours.calls == theirs.calls and ours.calls <= {"write", "flush"}
    assert ours.bytesio.getvalue() == theirs.bytesio.getvalue() and res.nbytes == 0


class serialization_method:  # torch's own name for it
    """What torch's test_serialization.py wraps ``torch.save`` with: it picks the format itself
    and refuses a call that sets it ("Cannot set method manually")."""

    def __init__(self, use_zip: bool) -> None:
        self.use_zip = use_zip
        self.torch_save = torch.save
        self.calls: list[dict[str, Any]] = []

    def __enter__(self) -> serialization_method:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(dict(kwargs))
            if "_use_new_zipfile_serialization" in kwargs:
                raise RuntimeError("Cannot set method manually")
            kwargs["_use_new_zipfile_serialization"] = self.use_zip
            return self.torch_save(*args, **kwargs)

        torch.save = wrapper  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        torch.save = self.torch_save


@pytest.mark.parametrize("use_zip", [True, False], ids=["zip", "legacy"])
def test_a_wrapped_torch_save_is_not_called_by_the_hand_over(workdir: str, use_zip: bool) -> None:
    """Given exactly the arguments its caller gave, what fp.torch_save hands over is written by
    torch's own save: a wrapper bound to torch.save (torch's tests refuse an explicit
    _use_new_zipfile_serialization there) is not called by fp.torch_save."""
    state = {"w": torch.arange(6.0), "n": 3}
    with serialization_method(use_zip) as wrapped:
        buf = io.BytesIO()  # a file object: written by torch's own save, in its default format
        assert fp.torch_save(state, buf).backend == "torch.save"
        path = os.path.join(workdir, "missing-dir", "x.pt")  # torch.save reports it, as itself
        with pytest.raises((RuntimeError, FileNotFoundError)):
            fp.torch_save(state, path)
        protocol_buf = io.BytesIO()
        fp.torch_save(state, protocol_buf, pickle_protocol=2, _disable_byteorder_record=True)
        legacy = io.BytesIO()
        fp.torch_save(state, legacy, _use_new_zipfile_serialization=False)
        fast = os.path.join(workdir, "fast.pt")
        assert fp.torch_save(state, fast).backend != "torch.save"
    assert wrapped.calls == []
    assert buf.getvalue() == torch_bytes(state) and not zipfile.is_zipfile(io.BytesIO(legacy.getvalue()))
    assert protocol_buf.getvalue() == torch_bytes(state, pickle_protocol=2, _disable_byteorder_record=True)
    for out in (protocol_buf, legacy):
        assert_same(state, torch.load(io.BytesIO(out.getvalue()), weights_only=True))
    assert_same(state, torch.load(fast, weights_only=True))


@pytest.mark.parametrize("use_zip", [True, False], ids=["zip", "legacy"])
def test_torch_save_bound_to_fp_torch_save_hands_over_without_recursion(
    workdir: str, use_zip: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``torch.save = fp.torch_save`` installs the drop-in for a whole program; every route
    works through it, and so does a wrapper around it (torch's tests wrap torch.save so)."""
    state = {"w": torch.arange(6.0), "n": 3}
    monkeypatch.setattr(torch, "save", fp.torch_save)
    outs = {"file object": io.BytesIO(), "legacy": io.BytesIO(), "custom pickle module": io.BytesIO()}
    torch.save(state, outs["file object"])
    torch.save(state, outs["legacy"], _use_new_zipfile_serialization=False)
    torch.save(state, outs["custom pickle module"], pickle_module=pickle)
    fast = os.path.join(workdir, "fast.pt")
    assert torch.save(state, fast).backend != "torch.save"
    with serialization_method(use_zip) as wrapped:  # wraps fp.torch_save now
        wrapped_out = io.BytesIO()
        torch.save(state, wrapped_out)
        wrapped_path = os.path.join(workdir, "wrapped.pt")
        torch.save(state, wrapped_path)
    assert wrapped.calls == [{}, {}]
    assert zipfile.is_zipfile(io.BytesIO(wrapped_out.getvalue())) == use_zip
    for out in [*outs.values(), wrapped_out]:
        assert_same(state, torch.load(io.BytesIO(out.getvalue()), weights_only=True))
    for path in (fast, wrapped_path):
        assert_same(state, torch.load(path, weights_only=True))


def test_the_legacy_format_is_written_by_torch_save(workdir: str, debug_log: pytest.LogCaptureFixture) -> None:
    state = {"w": torch.arange(6.0).reshape(2, 3), "n": 3}
    path = os.path.join(workdir, "legacy.pt")
    res = fp.torch_save(state, path, _use_new_zipfile_serialization=False)
    assert res.backend == "torch.save" and "legacy format" in debug_log.text
    assert not zipfile.is_zipfile(path)
    assert open(path, "rb").read() == torch_bytes(state, _use_new_zipfile_serialization=False)
    assert_same(state, torch.load(path, weights_only=True))
    buf = io.BytesIO()
    fp.torch_save(state, buf, _use_new_zipfile_serialization=False)
    assert buf.getvalue() == torch_bytes(state, _use_new_zipfile_serialization=False)


def test_a_custom_pickle_module_is_used_by_torch_save(workdir: str, debug_log: pytest.LogCaptureFixture) -> None:
    pickled: list[object] = []

    class Pickler(pickle.Pickler):
        def dump(self, obj: Any) -> None:
            pickled.append(obj)
            super().dump(obj)

    module = types.SimpleNamespace(Pickler=Pickler, Unpickler=pickle.Unpickler, __name__="counting_pickle")
    state = {"w": torch.ones(4)}
    path = os.path.join(workdir, "custom.pt")
    res = fp.torch_save(state, path, pickle_module=module)
    assert res.backend == "torch.save" and "counting_pickle" in debug_log.text
    assert pickled and pickled[0] is state  # torch.save pickled it with the module given
    assert_same(state, torch.load(path, weights_only=True))


def test_a_path_that_is_no_regular_file_is_written_by_torch_save(
    workdir: str, debug_log: pytest.LogCaptureFixture
) -> None:
    """Never renamed over: a device stays the device torch.save writes into.

    A null device of the test's own (never /dev/null: a regression must not break the machine).
    """
    null = os.path.join(workdir, "null")
    try:
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")
    res = fp.torch_save({"w": torch.ones(2)}, null)
    assert res.backend == "torch.save" and "regular file" in debug_log.text
    assert stat.S_ISCHR(os.stat(null).st_mode) and os.listdir(workdir) == ["null"]


def test_a_symlink_is_written_through_as_torch_save_writes_it(workdir: str) -> None:
    target, link = os.path.join(workdir, "step-1.pt"), os.path.join(workdir, "latest.pt")
    torch.save({"w": torch.zeros(2)}, target)
    os.symlink("step-1.pt", link)
    res = fp.torch_save({"w": torch.ones(2)}, link)
    assert res.backend != "torch.save" and os.path.islink(link) and os.readlink(link) == "step-1.pt"
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(2))
    dangling = os.path.join(workdir, "next.pt")
    os.symlink("step-2.pt", dangling)  # torch.save creates the file the link names
    fp.torch_save({"w": torch.full((2,), 2.0)}, dangling)
    assert os.path.islink(dangling)
    assert torch.equal(torch.load(os.path.join(workdir, "step-2.pt"), weights_only=True)["w"], torch.full((2,), 2.0))
    assert sorted(os.listdir(workdir)) == ["latest.pt", "next.pt", "step-1.pt", "step-2.pt"]


# ----------------------------------------------------------------------------- the same exceptions


def _raised(call: Any) -> tuple[type[BaseException], str]:
    with pytest.raises(BaseException) as info:
        call()
    return info.type, str(info.value)


@pytest.mark.parametrize("where", ["missing parent", "a directory", "empty", "an int", "None", "bytes"])
def test_a_bad_f_raises_what_torch_save_raises(workdir: str, where: str) -> None:
    os.makedirs(os.path.join(workdir, "adir"), exist_ok=True)
    f: Any = {
        "missing parent": os.path.join(workdir, "nope", "x.pt"),
        "a directory": os.path.join(workdir, "adir"),
        "empty": "",
        "an int": 3,
        "None": None,
        "bytes": os.path.join(workdir, "b.pt").encode(),
    }[where]
    state = {"w": torch.ones(2)}
    assert _raised(lambda: fp.torch_save(state, f)) == _raised(lambda: torch.save(state, f))


@pytest.mark.parametrize("case", ["unpicklable", "bad protocol"])
def test_a_bad_obj_or_protocol_raises_what_torch_save_raises(workdir: str, case: str) -> None:
    obj: Any = {"f": lambda: 1} if case == "unpicklable" else {"w": torch.ones(2)}
    kwargs = {"pickle_protocol": 99} if case == "bad protocol" else {}
    ours = _raised(lambda: fp.torch_save(obj, os.path.join(workdir, "a.pt"), **kwargs))
    theirs = _raised(lambda: torch.save(obj, io.BytesIO(), **kwargs))
    assert ours[0] is theirs[0]
    assert not os.path.exists(os.path.join(workdir, "a.pt"))  # unlike torch.save, nothing half-written


def test_falls_back_with_a_warning_when_the_skeleton_is_unexpected(
    workdir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(skel: torchfile.Skeleton) -> list[np.ndarray]:
        raise ValueError("simulated surprise")

    monkeypatch.setattr(torchfile, "compose_extents", broken)
    path = os.path.join(workdir, "x.pt")
    with caplog.at_level("WARNING", logger="fastpersist"):
        res = fp.torch_save({"w": torch.ones(3)}, path)
    assert res.backend == "torch.save" and "simulated surprise" in caplog.text
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
