"""Clear errors and ways out on the load side: a CUDA device this machine lacks, stripe
directories moved to other roots, and a checkpoint path that is a symbolic link."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
import torch

import fastpersist as fp
from fastpersist.format.seal import seal, unseal
from fastpersist.loading import reading


def _state() -> dict[str, Any]:
    torch.manual_seed(5)
    return {"model": {"w": torch.randn(64 << 10), "b": torch.randn(10)}, "step": 3}


def _assert_same(loaded: dict[str, Any], expected: dict[str, Any]) -> None:
    assert loaded["step"] == expected["step"]
    for key in ("w", "b"):
        assert torch.equal(loaded["model"][key], expected["model"][key]), key


def _record_device(path: str, device: str) -> None:
    """Rewrites the manifest as if every tensor had been saved from `device` (resealed)."""
    manifest = os.path.join(path, "manifest.json")
    with open(manifest, "rb") as f:
        body, _ = unseal(f.read(), manifest)
    doc = json.loads(body)
    for rec in doc["tensors"]:
        rec["device"] = device
    with open(manifest, "wb") as f:
        f.write(seal(json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()))


@pytest.fixture
def no_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any read of tensor data fails the test: the errors below come before any read."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("data was read before the device was checked")

    monkeypatch.setattr(reading._core, "read_ranges_into", refuse)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize(
    ("saved_on", "location"),
    [("cpu", "cuda:7"), ("cpu", torch.device("cuda", 7)), ("cuda:0", {"cuda:0": "cuda:7"}), ("cuda:7", None)],
)
def test_a_cuda_device_this_machine_lacks_is_named_before_any_read(
    workdir: str, config: fp.Config, saved_on: str, location: Any, no_reads: None
) -> None:
    path = os.path.join(workdir, "ck")
    fp.save(_state(), path, config=config)
    _record_device(path, saved_on)
    with pytest.raises(fp.FastPersistError, match="no CUDA device") as info:
        fp.load(path, map_location=location)
    message = str(info.value)
    assert "cuda:7" in message and "'state.model.w'" in message and path in message and "map_location=" in message


def test_a_cuda_index_past_the_device_count_is_named(
    workdir: str, config: fp.Config, monkeypatch: pytest.MonkeyPatch, no_reads: None
) -> None:
    path = os.path.join(workdir, "ck")
    fp.save(_state(), path, config=config)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(fp.FastPersistError, match=r"cuda:2 .*only 2 CUDA device\(s\) \(cuda:0..cuda:1\)"):
        fp.load(path, map_location="cuda:2")
    # out= names the device too when a tensor `out` lacks would go there
    with pytest.raises(fp.FastPersistError, match=r"'state\.model\.w'.*cuda:5"):
        fp.load(path, map_location="cuda:5", out={"model": {"b": torch.zeros(10)}})


def test_out_covering_every_tensor_needs_no_device(workdir: str, config: fp.Config) -> None:
    path = os.path.join(workdir, "ck")
    fp.save(_state(), path, config=config)
    _record_device(path, "cuda:7")  # saved on a GPU this machine lacks: out= says where they go
    out = {"model": {"w": torch.zeros(64 << 10), "b": torch.zeros(10)}}
    _assert_same(fp.load(path, out=out, config=config), _state())


def _moved(workdir: str, config: fp.Config) -> tuple[str, list[str], list[str]]:
    """A checkpoint saved over two stripe roots whose stripe directories were then moved to two
    other roots; returns its path, the old roots and the new ones."""
    old = [os.path.join(workdir, f"nvme{i}") for i in range(2)]
    new = [os.path.join(workdir, f"new{i}") for i in range(2)]
    for d in old + new:
        os.makedirs(d)
    path = os.path.join(workdir, "ck")
    fp.save(_state(), path, config=fp.Config(backend=config.backend, chunk_bytes=64 << 10, stripes=old))
    for src, dst in zip(old, new, strict=True):
        for name in os.listdir(src):
            shutil.move(os.path.join(src, name), dst)
    return path, old, new


def test_moved_stripes_fail_with_the_fix_and_load_with_the_new_roots(workdir: str, config: fp.Config) -> None:
    path, _, new = _moved(workdir, config)
    for operation in (fp.load, fp.verify):
        with pytest.raises(fp.CorruptCheckpointError, match=r"is missing .*config=fp\.Config\(stripes=\[") as info:
            operation(path)
        assert path in str(info.value)
    moved = fp.Config(backend=config.backend, stripes=new)
    _assert_same(fp.load(path, config=moved), _state())
    assert fp.verify(path, config=moved)["files"] == 2
    files = [f["path"] for f in fp.inspect(path, config=moved)["files"]]
    assert len(files) == 2 and all(os.path.dirname(os.path.dirname(f)) in new for f in files)
    # the save named its stripe directories alike in both roots: the order of the roots says which
    # is which, and a third root leaves that open
    extra = os.path.join(workdir, "empty")
    os.mkdir(extra)
    with pytest.raises(fp.CorruptCheckpointError, match=r"in several of the stripe roots.*in the same order"):
        fp.load(path, config=fp.Config(stripes=[*new, extra]))


def test_stripes_are_only_looked_up_directly_inside_the_given_roots(workdir: str, config: fp.Config) -> None:
    path, _, new = _moved(workdir, config)
    # one root short: both stripe directories would be the one in that root
    with pytest.raises(fp.CorruptCheckpointError, match=r"would both be read from .*new0.*same order"):
        fp.load(path, config=fp.Config(stripes=[new[0]]))
    # a directory of the right name deeper down is not found
    deeper = os.path.join(workdir, "deeper")
    os.makedirs(os.path.join(deeper, "sub"))
    name = os.listdir(new[1])[0]
    shutil.move(os.path.join(new[1], name), os.path.join(deeper, "sub"))
    with pytest.raises(fp.CorruptCheckpointError, match="in none of the configured stripe roots"):
        fp.load(path, config=fp.Config(stripes=[deeper, os.path.join(workdir, "nowhere")]))
    # a link of that name inside a root is refused, not followed
    os.symlink(os.path.join(deeper, "sub", name), os.path.join(new[1], name))
    with pytest.raises(fp.CorruptCheckpointError, match="not a plain directory"):
        fp.load(path, config=fp.Config(stripes=new))
    os.remove(os.path.join(new[1], name))
    # the same stripe directory in two roots is ambiguous
    shutil.copytree(os.path.join(deeper, "sub", name), os.path.join(new[1], name))
    shutil.copytree(os.path.join(deeper, "sub", name), os.path.join(deeper, name))
    with pytest.raises(fp.CorruptCheckpointError, match="in several of the stripe roots"):
        fp.load(path, config=fp.Config(stripes=[*new, deeper]))
    _assert_same(fp.load(path, config=fp.Config(stripes=new)), _state())


def test_a_symlink_to_a_checkpoint_is_read_through_and_never_saved_through(workdir: str, config: fp.Config) -> None:
    real = os.path.join(workdir, "step-3")
    link = os.path.join(workdir, "latest")
    fp.save(_state(), real, config=config)
    os.symlink("step-3", link)
    _assert_same(fp.load(link, config=config), _state())
    assert fp.verify(link)["files"] == 1
    info = fp.inspect(link)
    assert info["path"] == link and info["tensors"] == 2
    before = fp.inspect(real)["checkpoint_id"]
    with pytest.raises(FileExistsError, match="is a symbolic link to 'step-3'") as raised:
        fp.save({"other": torch.ones(1)}, link, config=config)
    assert raised.value.filename == link and real in str(raised.value) and "re-point the link" in str(raised.value)
    assert os.readlink(link) == "step-3" and fp.inspect(real)["checkpoint_id"] == before
    with pytest.raises(FileExistsError, match="symbolic link"):
        fp.save_async({"other": torch.ones(1)}, link, config=config).wait()
    # a link whose target is gone: no checkpoint there
    os.symlink("step-9", os.path.join(workdir, "dangling"))
    with pytest.raises(fp.CheckpointNotFoundError, match="symbolic link to 'step-9'"):
        fp.load(os.path.join(workdir, "dangling"))
