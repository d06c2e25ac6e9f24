"""fp.export_hf / ``fastpersist export --to hf``: a real transformers model saved through the
Checkpointer, exported, and loaded back by ``from_pretrained`` bit-identically."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fastpersist as fp
from fastpersist.errors import FastPersistError
from fastpersist.interop import hfsources
from fastpersist.loading import reading
from fastpersist.tools.cli import main

from gloo import run_ranks
from hf_workers import dcp_sharded_save, sharded_save, tiny_gpt2

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _from_pretrained(outdir: str, model: torch.nn.Module) -> torch.nn.Module:
    model.config.save_pretrained(outdir)  # type: ignore[operator]
    return transformers.GPT2LMHeadModel.from_pretrained(outdir)  # type: ignore[no-any-return]


def _assert_same_model(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name].view(torch.uint8), sb[name].view(torch.uint8)), name
    assert sb["lm_head.weight"].data_ptr() == sb["transformer.wte.weight"].data_ptr()  # tied again


def _read_all(outdir: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(outdir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(outdir, name), framework="pt") as f:
                assert f.metadata() == {"format": "pt"}
                for key in f.keys():
                    assert key not in found
                    found[key] = f.get_tensor(key)
    return found


def test_checkpointer_root_exports_sharded_files_that_from_pretrained_loads(tmp_path: Any) -> None:
    model = tiny_gpt2()
    ck = fp.Checkpointer(tmp_path / "root", keep=2)
    ck.save(1, {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}, "step": 1})
    ck.save(2, {"model": model.state_dict(), "optimizer": {"lr": 0.1, "m": torch.ones(3)}, "step": 2})
    ck.close()
    limit = 40_000
    out = str(tmp_path / "hf")
    res = fp.export_hf(tmp_path / "root", out, key="model", max_shard_bytes=limit)

    assert res.source == ck.path(2)  # the root's latest step
    assert res.tied == ["lm_head.weight"]  # written once, as save_pretrained does
    assert len(res.files) > 2
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    state = model.state_dict()
    expected = {k: v for k, v in state.items() if k != "lm_head.weight"}
    assert set(index["weight_map"]) == set(expected)
    assert set(index["weight_map"].values()) == set(res.files) == {n for n in os.listdir(out) if n.endswith("ors")}
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in expected.values())
    for name in res.files:  # every shard within the limit, unless it holds one larger tensor alone
        held = [k for k, f in index["weight_map"].items() if f == name]
        data_bytes = sum(expected[k].numel() * expected[k].element_size() for k in held)
        assert data_bytes <= limit or len(held) == 1
    found = _read_all(out)  # safetensors' own reader takes every tensor
    assert set(found) == set(expected)
    for k, v in expected.items():
        assert torch.equal(found[k], v), k
    _assert_same_model(model, _from_pretrained(out, model))


def test_names_match_save_pretrained(tmp_path: Any) -> None:
    model = tiny_gpt2()
    model.save_pretrained(tmp_path / "theirs")  # type: ignore[operator]
    fp.save({"model": model.state_dict()}, tmp_path / "ck")
    res = fp.export_hf(tmp_path / "ck", tmp_path / "ours", key="model")
    assert res.files == ["model.safetensors"]  # fits: one file, no index, as save_pretrained
    assert not os.path.exists(tmp_path / "ours" / "model.safetensors.index.json")
    theirs = safetensors_torch.load_file(str(tmp_path / "theirs" / "model.safetensors"))
    ours = safetensors_torch.load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_cli_export_with_prefix_and_config(tmp_path: Any, capsys: Any) -> None:
    model = tiny_gpt2()
    wrapped = {f"module.{k}": v for k, v in model.state_dict().items()}  # as a DDP-wrapped model names them
    fp.save({"model": wrapped, "step": 7}, tmp_path / "ck")
    model.config.save_pretrained(tmp_path / "cfg")  # type: ignore[operator]
    out = str(tmp_path / "hf")
    flags = ["--key", "model", "--prefix", "module.", "--max-shard-size", "50KB", "--config", str(tmp_path / "cfg")]
    code = main(["export", str(tmp_path / "ck"), "--to", "hf", out, *flags])
    assert code == 0
    assert "1 tied name(s) written once" in capsys.readouterr().out
    _assert_same_model(model, transformers.GPT2LMHeadModel.from_pretrained(out))


def test_reexport_removes_the_shards_it_does_not_write(tmp_path: Any) -> None:
    fp.save({"a": torch.ones(1000), "b": torch.ones(1000)}, tmp_path / "ck")
    out = tmp_path / "hf"
    assert len(fp.export_hf(tmp_path / "ck", out, max_shard_bytes=4000).files) == 2
    assert fp.export_hf(tmp_path / "ck", out).files == ["model.safetensors"]
    assert sorted(os.listdir(out)) == ["model.safetensors"]  # from_pretrained would prefer a stale index


def test_non_tensors_are_skipped_and_listed_at_debug(tmp_path: Any, caplog: Any) -> None:
    fp.save({"w": torch.arange(4.0), "step": 3, "names": ["x"], "arr": np.ones(2)}, tmp_path / "ck")
    with caplog.at_level(logging.DEBUG, logger="fastpersist"):
        res = fp.export_hf(tmp_path / "ck", tmp_path / "hf")
    assert res.tensors == 1
    assert "skips 3 value(s)" in caplog.text and "'step'" in caplog.text
    assert list(_read_all(str(tmp_path / "hf"))) == ["w"]


def test_bad_key_and_foreign_dtype_are_refused_by_name(tmp_path: Any, capsys: Any) -> None:
    fp.save({"model": {"w": torch.ones(2)}, "opt": {"m": torch.ones(2)}}, tmp_path / "ck")
    with pytest.raises(FastPersistError, match=r"no tensor under key='encoder'.*'model', 'opt'"):
        fp.export_hf(tmp_path / "ck", tmp_path / "hf", key="encoder")
    assert main(["export", str(tmp_path / "ck"), "--to", "hf", str(tmp_path / "hf"), "--key", "encoder"]) == 1
    assert "FAILED: no tensor under key='encoder'" in capsys.readouterr().err
    fp.save({"model": {"z": torch.ones(2, dtype=torch.complex128)}}, tmp_path / "ck2")
    with pytest.raises(FastPersistError, match=r"'z' has dtype torch.complex128"):
        fp.export_hf(tmp_path / "ck2", tmp_path / "hf", key="model")
    assert not os.path.exists(tmp_path / "hf") or not os.listdir(tmp_path / "hf")


def test_an_export_into_a_committed_checkpoint_is_refused_naming_both(tmp_path: Any) -> None:
    ck, other = str(tmp_path / "ck"), str(tmp_path / "other")
    for path in (ck, other):
        fp.save({"model": {"w": torch.ones(4)}}, path)
    before = {p: sorted(os.listdir(p)) for p in (ck, other)}
    for outdir, says in (
        (ck, "the checkpoint being exported"),
        (os.path.join(ck, "hf"), "lies inside, the checkpoint being exported"),
        (other, "it is a committed checkpoint"),
    ):
        with pytest.raises(ValueError, match="export_hf") as info:
            fp.export_hf(ck, outdir, key="model")
        assert says in str(info.value) and outdir in str(info.value) and ck in str(info.value)
    ck_root = fp.Checkpointer(tmp_path / "root")
    ck_root.save(3, {"model": {"w": torch.ones(4)}})
    ck_root.wait()
    with pytest.raises(ValueError, match="the checkpoint being exported"):
        fp.export_hf(ck_root.root, ck_root.path(3), key="model")  # the root's latest step: the same one
    with pytest.raises(ValueError, match=r"export_hf\(outdir=''\): expected a directory"):
        fp.export_hf(ck, "", key="model")
    assert {p: sorted(os.listdir(p)) for p in (ck, other)} == before
    assert not os.path.exists(os.path.join(ck, "hf"))
    fp.export_hf(ck, tmp_path, key="model")  # a directory holding checkpoints is fine: they are not touched
    assert fp.load(ck)["model"]["w"].sum() == 4


def test_reads_one_window_at_a_time(tmp_path: Any, monkeypatch: Any) -> None:
    """Memory stays bounded: the stream is read in windows, never whole."""
    state = {f"w{i}": torch.full((64 << 10,), float(i)) for i in range(12)}  # 12 x 256 KiB
    fp.save(state, tmp_path / "ck", config=fp.Config(chunk_bytes=64 << 10))
    window = 512 << 10
    monkeypatch.setattr(reading, "WINDOW_BYTES", window)
    spans: list[int] = []
    real = hfsources.read_window

    def spy(root: str, m: Any, lo: int, hi: int, *args: Any, **kwargs: Any) -> None:
        spans.append(hi - lo)
        real(root, m, lo, hi, *args, **kwargs)

    monkeypatch.setattr(hfsources, "read_window", spy)
    fp.export_hf(tmp_path / "ck", tmp_path / "hf", max_shard_bytes=1 << 20)
    assert len(spans) >= 6 and max(spans) <= window + (128 << 10)
    found = _read_all(str(tmp_path / "hf"))
    assert all(torch.equal(found[k], v) for k, v in state.items())


def test_dcp_written_checkpoint_exports(tmp_path: Any) -> None:
    import torch.distributed.checkpoint as dcp

    from fastpersist.integrations.dcp import FastPersistWriter

    model = tiny_gpt2()
    dcp.save({"model": model.state_dict()}, storage_writer=FastPersistWriter(tmp_path / "dcp"), no_dist=True)
    res = fp.export_hf(tmp_path / "dcp", tmp_path / "hf", key="model", max_shard_bytes=60_000)
    assert len(res.files) > 1
    _assert_same_model(model, _from_pretrained(str(tmp_path / "hf"), model))


@pytest.mark.slow
def test_sharded_two_rank_checkpoint_is_merged(tmp_path: Any) -> None:
    results = run_ranks(sharded_save, 2, (str(tmp_path),), str(tmp_path))
    assert all("tensors" in r for r in results), results
    model = tiny_gpt2()
    res = fp.export_hf(tmp_path / "root", tmp_path / "hf", key="model", max_shard_bytes=100_000)
    assert res.tied == ["lm_head.weight"]
    _assert_same_model(model, _from_pretrained(str(tmp_path / "hf"), model))
    with pytest.raises(FastPersistError, match=r"tensor 'w' differs between .*shard-00000 and .*shard-00001"):
        fp.export_hf(tmp_path / "differ", tmp_path / "hf2", key="model")


def test_checkpointer_exports_in_the_background(tmp_path: Any) -> None:
    model = tiny_gpt2()
    out = str(tmp_path / "hf")
    ck = fp.Checkpointer(tmp_path / "root", keep=1, levels=[fp.HFExport(out, every=2, key="model")])
    for step in range(1, 5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        ck.save(step, {"model": model.state_dict(), "step": step})
        ck.wait()
    ck.close()
    (exports,) = ck._copies
    assert exports.last.source == ck.path(4)  # type: ignore[attr-defined]  # 4 crossed a multiple of 2: the newest export
    _assert_same_model(model, _from_pretrained(out, model))


def test_background_export_never_blocks_the_loop_and_close_raises_its_failure(
    tmp_path: Any, monkeypatch: Any, caplog: Any
) -> None:
    from fastpersist.levels import background_exports

    release = threading.Event()
    started: list[str] = []

    def slow_failing_export(src: str, outdir: str, **kwargs: Any) -> Any:
        started.append(src)
        assert release.wait(60)
        raise FastPersistError("no tensor under key='nope'")

    monkeypatch.setattr(background_exports, "export_checkpoint", slow_failing_export)
    ck = fp.Checkpointer(tmp_path / "root", keep=1, levels=[fp.HFExport(tmp_path / "hf", every=1)])
    ck.save(1, {"w": torch.ones(2)})
    ck.wait()
    ck.save(2, {"w": torch.ones(2)})
    ck.wait()  # both saves commit while the first export is still running
    assert started == [ck.path(1)]
    assert os.path.isdir(ck.path(1))  # pinned: retention (keep=1) leaves the step being exported
    release.set()
    with caplog.at_level(logging.WARNING, logger="fastpersist"), pytest.raises(FastPersistError, match="step 2"):
        ck.close()
    assert "the Hugging Face export of step 1" in caplog.text
    assert started == [ck.path(1), ck.path(2)]  # the step waiting was exported after the one in flight
    ck.close()  # raised once


@pytest.mark.slow
def test_dcp_tensors_saved_in_chunks_by_two_ranks_are_assembled(tmp_path: Any) -> None:
    results = run_ranks(dcp_sharded_save, 2, (str(tmp_path),), str(tmp_path))
    assert all("tensors" in r for r in results), results
    from fastpersist.integrations.dcp import FastPersistReader

    metadata = FastPersistReader(tmp_path / "dcp").read_metadata().state_dict_metadata
    assert len(metadata["model.transformer.wte.weight"].chunks) == 2  # one chunk in each rank's file
    model = tiny_gpt2()
    fp.export_hf(tmp_path / "dcp", tmp_path / "hf", key="model", max_shard_bytes=100_000)
    _assert_same_model(model, _from_pretrained(str(tmp_path / "hf"), model))


_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.float64]


@given(
    st.lists(st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 9), max_size=3)), max_size=12),
    st.integers(1, 400),
)
def test_shard_plan_and_files_hold_every_tensor_aligned(tmp_path_factory: Any, specs: list[Any], limit: int) -> None:
    """Every tensor in exactly one shard, in order, each shard within the limit unless it holds one
    larger tensor; safetensors' reader takes each file, every tensor aligned to its element size."""
    from fastpersist.interop.hfshards import OutTensor, ShardFile, plan_shards

    tensors = [OutTensor(f"t{i}", dtype, tuple(shape)) for i, (dtype, shape) in enumerate(specs)]
    shards = plan_shards(tensors, limit)
    assert [t for shard in shards for t in shard] == tensors
    assert all(sum(t.nbytes for t in shard) <= limit or len(shard) == 1 for shard in shards)
    directory = tmp_path_factory.mktemp("shards")
    for k, shard in enumerate(shards):
        path = str(directory / f"{k}.safetensors")
        f = ShardFile(path, shard)
        values = {t.name: torch.arange(max(t.nbytes, 1), dtype=torch.uint8)[: t.nbytes] for t in shard}
        for t in shard:
            assert f.offsets[t.name] % max(t.dtype.itemsize, 1) == 0
            f.write(
                t.name,
                values[t.name].view(t.dtype).reshape(t.shape) if t.nbytes else torch.empty(t.shape, dtype=t.dtype),
            )
        f.close()
        back = safetensors_torch.load_file(path)
        assert set(back) == {t.name for t in shard}
        for t in shard:
            assert back[t.name].dtype == t.dtype and tuple(back[t.name].shape) == t.shape
            assert torch.equal(back[t.name].reshape(-1).view(torch.uint8), values[t.name])


def test_background_export_pauses_while_a_save_is_staging(tmp_path: Any, monkeypatch: Any) -> None:
    from fastpersist.levels.background_exports import HfExports

    fp.save({"a": torch.ones(4), "b": torch.zeros(4)}, tmp_path / "ck")
    staging = threading.Event()
    staging.set()
    exports = HfExports(lambda step: str(tmp_path / "ck"), 1, tmp_path / "hf", staging=staging.is_set)
    exports.after_commit(1)
    time.sleep(0.3)
    assert exports.last is None and not os.path.exists(tmp_path / "hf" / "model.safetensors")  # waiting
    staging.clear()
    exports.close()
    assert exports.last is not None and exports.last.tensors == 2
