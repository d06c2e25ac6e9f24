"""load speaks torch.load: map_location in every form (also positional), weights_only, mmap."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

import fastpersist as fp
from fastpersist.format.seal import seal


def _saved(workdir: str) -> tuple[str, dict[str, Any]]:
    w = torch.nn.Parameter(torch.randn(4, 3))
    big = torch.randn(1 << 19)  # 2 MiB: stays a view of the read buffer
    state = {"w": w, "tied": w, "view": big[10:20], "big": big, "n": 3}
    path = os.path.join(workdir, "ckpt")
    fp.save(state, path)
    return path, state


@pytest.mark.parametrize("location", ["cpu", torch.device("cpu"), {"cpu": "cpu"}, {"cuda:0": "cpu"}])
def test_map_location_forms_and_positional(workdir: str, location: Any) -> None:
    path, state = _saved(workdir)
    for loaded in (fp.load(path, location), fp.load(path, map_location=location)):
        assert torch.equal(loaded["big"], state["big"]) and loaded["n"] == 3
        assert isinstance(loaded["w"], torch.nn.Parameter) and loaded["w"] is loaded["tied"]


def test_callable_gets_storage_and_location_once_per_storage(workdir: str) -> None:
    path, state = _saved(workdir)
    calls: list[tuple[type, str]] = []

    def to_copy(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        calls.append((type(storage), location))
        return storage.clone()  # a new storage, as storage.cuda() would give

    loaded = fp.load(path, to_copy)
    assert calls and all(c == (torch.UntypedStorage, "cpu") for c in calls)
    assert torch.equal(loaded["view"], state["big"][10:20]) and torch.equal(loaded["w"], state["w"])
    assert isinstance(loaded["w"], torch.nn.Parameter) and loaded["w"].requires_grad
    # tensors that shared a storage share the mapped one
    assert loaded["view"].untyped_storage().data_ptr() == loaded["big"].untyped_storage().data_ptr()
    assert len(calls) == 2  # one call per storage: w's, and the one big and view share


def test_callable_like_torch_idioms(workdir: str) -> None:
    path, state = _saved(workdir)
    same = fp.load(path, map_location=lambda storage, loc: storage)
    assert torch.equal(same["big"], state["big"])
    default = fp.load(path, map_location=lambda storage, loc: None)  # None: the default placement
    assert torch.equal(default["w"], state["w"])
    # torch warns of TypedStorage once per process unless told to always: an earlier test may have had it.
    always = torch.storage._get_always_warn_typed_storage_removal()
    torch.storage._set_always_warn_typed_storage_removal(True)
    try:
        with pytest.warns(UserWarning, match="TypedStorage is deprecated"):
            typed = fp.load(
                path, map_location=lambda s, loc: torch.TypedStorage(wrap_storage=s.clone(), dtype=torch.uint8)
            )
    finally:
        torch.storage._set_always_warn_typed_storage_removal(always)
    assert torch.equal(typed["view"], state["big"][10:20])
    with pytest.raises(TypeError, match="returned int"):
        fp.load(path, map_location=lambda storage, loc: 1)
    with pytest.raises(TypeError, match="map_location must be"):
        fp.load(path, map_location=3.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("weights_only", [None, True, False])
@pytest.mark.parametrize("mmap", [None, True, False])
def test_weights_only_and_mmap_are_accepted(workdir: str, weights_only: bool | None, mmap: bool | None) -> None:
    path, state = _saved(workdir)
    loaded = fp.load(path, "cpu", weights_only=weights_only, mmap=mmap)
    assert torch.equal(loaded["big"], state["big"])


def test_flags_must_be_bools(workdir: str) -> None:
    path, _ = _saved(workdir)
    with pytest.raises(TypeError, match="weights_only"):
        fp.load(path, weights_only="yes")  # type: ignore[arg-type]


def test_a_device_this_machine_lacks_is_refused_before_reading_and_says_what_to_pass(workdir: str) -> None:
    path = os.path.join(workdir, "ck")
    fp.save({"w": torch.arange(3.0)}, path)
    manifest = os.path.join(path, "manifest.json")
    doc = json.load(open(manifest))
    doc.pop("manifest_sha256")
    doc["tensors"][0]["device"] = "cuda:99"  # as if saved on a GPU no machine here has
    open(manifest, "wb").write(seal(json.dumps(doc).encode()))
    with pytest.raises(fp.FastPersistError, match=r"'state.w' \(saved on cuda:99\).*no CUDA.*map_location='cpu'"):
        fp.load(path)
    assert torch.equal(fp.load(path, map_location="cpu")["w"], torch.arange(3.0))


def test_map_location_to_another_device_keeps_views_and_sharing(workdir: str) -> None:
    """A tensor moved by map_location keeps its strides and storage offset, and views of one
    storage share the moved one (each blob moves once; torch.load does the same). The meta
    device stands in for a GPU here: it has strides, offsets and storages but no data."""
    w = torch.arange(24.0).view(4, 6)
    state = {
        "w": w,
        "t": w.t(),
        "corner": w[1:, 2:],
        "cl": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    }
    path = os.path.join(workdir, "views")
    fp.save(state, path)
    for location in ("meta", {"cpu": "meta"}, torch.device("meta")):
        loaded = fp.load(path, map_location=location)
        for key, saved in state.items():
            got = loaded[key]
            assert got.device.type == "meta", key
            assert (got.shape, got.stride(), got.storage_offset()) == (
                saved.shape,
                saved.stride(),
                saved.storage_offset(),
            )
        cdata = {key: loaded[key].untyped_storage()._cdata for key in ("w", "t", "corner")}
        assert len(set(cdata.values())) == 1, cdata
        assert loaded["cl"].untyped_storage()._cdata != cdata["w"]
