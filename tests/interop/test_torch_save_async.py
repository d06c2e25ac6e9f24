"""fp.torch_save_async: fp.torch_save's file, written in the background behind a SaveFuture.

What it must keep: the file is the one torch.save writes (byte for byte, but for the
serialization id), wait_staged() frees the object, wait() means durable and in place, errors
come from wait(), and a process killed before the rename leaves nothing (or the previous
file) at the target, never a part of the new one.
"""

from __future__ import annotations

import errno
import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from typing import Any

import pytest
import torch
from test_interop import _state, assert_same
from test_torch_save import torch_bytes, without_serialization_id

import fastpersist as fp
from fastpersist.interop import torchfile

MIB = 1 << 20
#: Big enough that a bounded pool keeps staging busy while a test modifies the state.
BIG = (16 * MIB) // 4


def _bounded(backend: str) -> fp.Config:
    return fp.Config(backend=backend, chunk_bytes=64 << 10, pool_bytes=256 << 10, queue_depth=2)


def _leftovers(parent: str) -> list[str]:
    return [n for n in os.listdir(parent) if ".fptmp-" in n]


def _file_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_the_file_is_torch_saves_and_loads_back(workdir: str, config: fp.Config) -> None:
    state = _state()
    path = os.path.join(workdir, "state.pt")
    fut = fp.torch_save_async(state, path, config=config)
    assert isinstance(fut, fp.SaveFuture)
    fut.wait_staged()
    res = fut.wait()
    assert res.path == path and res.files == [path] and res.nbytes == os.path.getsize(path)
    assert res.backend == config.backend and 0 < res.staged_seconds <= res.seconds
    assert without_serialization_id(_file_bytes(path)) == without_serialization_id(torch_bytes(state))
    assert_same(torch.load(path, weights_only=True), state)
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # real CRC-32s, as fp.torch_save writes them
    assert _leftovers(workdir) == []


def test_the_file_is_the_one_torch_save_writes_for_the_same_arguments(workdir: str) -> None:
    state = {"w": torch.randn(300, 7), "tied": None, "n": 3}
    state["tied"] = state["w"][1:3]
    fp.torch_save_async(state, os.path.join(workdir, "a.pt"), pickle_protocol=4).wait()
    fp.torch_save(state, os.path.join(workdir, "b.pt"), pickle_protocol=4)
    a, b = (without_serialization_id(_file_bytes(os.path.join(workdir, n))) for n in ("a.pt", "b.pt"))
    assert a == b
    loaded = torch.load(os.path.join(workdir, "a.pt"), weights_only=False)  # (protocol 4: not weights_only)
    assert loaded["tied"].untyped_storage().data_ptr() == loaded["w"].untyped_storage().data_ptr()


def test_changes_after_wait_staged_do_not_reach_the_file(workdir: str, backend: str) -> None:
    state = {"a": torch.randn(BIG), "b": torch.randn(BIG), "small": torch.arange(10.0), "step": 5}
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    path = os.path.join(workdir, "state.pt")
    fut = fp.torch_save_async(state, path, config=_bounded(backend))
    fut.wait_staged()  # the bounded pool: only the last 256 KiB are still in memory, not yet written
    for t in (state["a"], state["b"], state["small"]):
        t.mul_(-1)
    state["step"] = 6
    fut.wait()
    assert_same(torch.load(path, weights_only=True), expected)


def test_small_tensors_are_copied_before_the_call_returns(workdir: str, backend: str) -> None:
    """What the next forward pass updates in place (BatchNorm statistics) before wait_staged."""
    state = {"big": torch.zeros(BIG), "running_mean": torch.zeros(256)}
    path = os.path.join(workdir, "state.pt")
    fut = fp.torch_save_async(state, path, config=_bounded(backend))
    state["running_mean"].add_(1)  # at once: staging of `big` has barely begun
    fut.wait()
    assert torch.load(path, weights_only=True)["running_mean"].sum() == 0


def test_a_tensor_changed_before_it_was_staged_fails_the_save_and_writes_nothing(workdir: str, backend: str) -> None:
    path = os.path.join(workdir, "state.pt")
    fp.torch_save({"a": torch.full((4,), 7.0)}, path)
    state = {"a": torch.zeros(BIG), "b": torch.zeros(BIG)}
    fut = fp.torch_save_async(state, path, config=_bounded(backend))
    state["b"][:1].add_(1)  # an optimizer.step() before wait_staged
    with pytest.raises(fp.SaveCancelledError, match=r"modified in place.*wait_staged\(\)") as staged:
        fut.wait_staged()
    with pytest.raises(fp.SaveCancelledError) as waited:
        fut.wait()
    assert waited.value is staged.value
    assert torch.load(path, weights_only=True)["a"][0] == 7.0  # the previous file, untouched
    assert _leftovers(workdir) == []


def test_an_io_error_surfaces_from_wait_and_nothing_is_at_the_target(workdir: str, backend: str) -> None:
    path = os.path.join(workdir, "state.pt")
    fut = fp.torch_save_async({"w": torch.randn(BIG)}, path, config=_bounded(backend))
    (tmp,) = _leftovers(workdir)
    os.remove(os.path.join(workdir, tmp))  # someone removes the temporary file: its rename must fail
    with pytest.raises(OSError) as caught:
        fut.wait(timeout=120)
    assert caught.value.errno == errno.ENOENT and tmp in str(caught.value.filename)
    assert fut.exception() is caught.value
    assert os.listdir(workdir) == []


def test_a_cancelled_save_writes_nothing(workdir: str, backend: str) -> None:
    path = os.path.join(workdir, "state.pt")
    fut = fp.torch_save_async({"a": torch.zeros(BIG)}, path, config=_bounded(backend))
    assert fut.cancel()
    with pytest.raises(fp.SaveCancelledError, match="cancelled"):
        fut.wait()
    assert fut.cancelled() and os.listdir(workdir) == []


def test_concurrent_saves_to_different_paths(workdir: str, backend: str) -> None:
    states = [{"i": i, "w": torch.randn(BIG // 4 + i), "b": torch.full((100 + i,), float(i))} for i in range(6)]
    paths = [os.path.join(workdir, f"s{i}.pt") for i in range(len(states))]
    futures: list[fp.SaveFuture] = []

    def start(i: int) -> None:
        futures.append(fp.torch_save_async(states[i], paths[i], config=_bounded(backend)))

    threads = [threading.Thread(target=start, args=(i,)) for i in range(3)]  # from several threads
    for t in threads:
        t.start()
    futures.extend(fp.torch_save_async(states[i], paths[i], config=_bounded(backend)) for i in range(3, 6))
    for t in threads:
        t.join()
    assert sorted(fut.wait().path for fut in futures) == sorted(paths)
    for state, path in zip(states, paths, strict=True):
        assert without_serialization_id(_file_bytes(path)) == without_serialization_id(torch_bytes(state))
    assert _leftovers(workdir) == []


# ---------------------------------------------------------------- what torch.save writes itself


def test_a_file_object_is_written_at_the_call_and_the_future_is_done(workdir: str) -> None:
    state = {"w": torch.arange(5.0)}
    buf = io.BytesIO()
    fut = fp.torch_save_async(state, buf)
    assert fut.staged() and fut.wait().backend == "torch.save"
    assert buf.getvalue() == torch_bytes(state)


def test_the_legacy_format_is_written_at_the_call_by_torch_save(workdir: str) -> None:
    path = os.path.join(workdir, "legacy.pt")
    fut = fp.torch_save_async({"w": torch.arange(5.0)}, path, _use_new_zipfile_serialization=False)
    assert fut.done() and fut.wait().backend == "torch.save"
    assert not zipfile.is_zipfile(path) and torch.equal(torch.load(path)["w"], torch.arange(5.0))


def _raised_by_torch_save(obj: object) -> BaseException:
    try:
        torch.save(obj, io.BytesIO())
    except Exception as e:
        return e
    raise AssertionError("torch.save accepted it")


def test_errors_of_the_call_are_raised_by_the_call_as_torch_save_raises_them(workdir: str) -> None:
    path = os.path.join(workdir, "a.pt")
    with pytest.raises(ValueError, match="pickle protocol"):
        fp.torch_save_async({"w": torch.ones(2)}, path, pickle_protocol=99)
    with pytest.raises(type(_raised_by_torch_save({"f": lambda: 0}))):  # a lambda does not pickle
        fp.torch_save_async({"f": lambda: 0}, path)
    with pytest.raises(RuntimeError, match="does not exist"):
        fp.torch_save_async({"w": torch.ones(2)}, os.path.join(workdir, "missing", "a.pt"))
    assert os.listdir(workdir) == []


def test_an_unexpected_skeleton_falls_back_to_torch_save_with_a_warning(
    workdir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(skel: torchfile.Skeleton) -> list[Any]:
        raise ValueError("simulated surprise")

    monkeypatch.setattr(torchfile, "compose_extents", broken)
    path = os.path.join(workdir, "x.pt")
    with caplog.at_level("WARNING", logger="fastpersist"):
        fut = fp.torch_save_async({"w": torch.ones(3)}, path)
    assert fut.done() and fut.wait().backend == "torch.save" and "simulated surprise" in caplog.text
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))


# -------------------------------------------------------------------------------- kill -9

_CHILD = textwrap.dedent(
    """
    import os, sys, time, torch
    import fastpersist as fp

    path, hold = sys.argv[1], sys.argv[2] == "hold"
    if hold:  # stop just before the rename, as a kill could: the temporary file is whole by then
        def replace(src, dst):
            print("renaming", flush=True)
            time.sleep(600)
        os.replace = replace
    state = {"w": torch.full(((64 << 20) // 4,), 2.0), "step": 2}
    fut = fp.torch_save_async(state, path, config=fp.Config(chunk_bytes=64 << 10, pool_bytes=1 << 20, queue_depth=2))
    print("started", flush=True)
    fut.wait()
    print("done", flush=True)
    """
)


def _child(path: str, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _CHILD, path, mode], stdout=subprocess.PIPE, text=True)


def _kill_when(proc: subprocess.Popen[str], line: str, delay_s: float = 0.0) -> None:
    assert proc.stdout is not None
    while (got := proc.stdout.readline()) and got.strip() != line:
        assert got, "the child ended before it printed " + line
    time.sleep(delay_s)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def test_a_kill_before_the_rename_leaves_no_file_at_the_target(workdir: str) -> None:
    path = os.path.join(workdir, "state.pt")
    proc = _child(path, "hold")
    _kill_when(proc, "renaming")
    assert proc.returncode == -signal.SIGKILL
    assert not os.path.exists(path)
    (tmp,) = _leftovers(workdir)  # the whole temporary file, under a lock that died with it
    assert fp.clean(workdir) == [os.path.join(workdir, tmp)]
    assert os.listdir(workdir) == []


@pytest.mark.slow
def test_kills_while_saving_leave_the_old_file_or_the_new_one_never_a_part(workdir: str) -> None:
    path = os.path.join(workdir, "state.pt")
    old = {"w": torch.full((16,), 1.0), "step": 1}
    fp.torch_save(old, path)
    outcomes = set()
    for delay_s in (0.0, 0.01, 0.03, 0.1, 0.3):
        proc = _child(path, "run")
        _kill_when(proc, "started", delay_s)
        loaded = torch.load(path, weights_only=True)  # whole: a torn archive would not load
        with zipfile.ZipFile(path) as z:
            assert z.testzip() is None
        outcomes.add(loaded["step"])
        assert loaded["step"] in (1, 2) and bool((loaded["w"] == loaded["step"]).all())
        fp.clean(workdir)  # what the killed save left: its temporary file
        assert os.listdir(workdir) == ["state.pt"]
    assert 1 in outcomes  # at least one kill landed before the rename
