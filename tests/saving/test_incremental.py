"""fp.Incremental: a step writes only the blocks whose bytes changed and links the rest from its
base, and still loads, verifies and survives its base's deletion on its own."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import fastpersist as fp
import fastpersist._core as _core
from fastpersist.errors import ChecksumMismatchError, CorruptCheckpointError
from fastpersist.format.manifest import read_manifest
from fastpersist.format.seal import seal
from fastpersist.saving import incremental as incremental_module
from fastpersist.saving.incremental import check_packed, segments_of
from fastpersist.tools import cli

from dist_workers import same

BLOCK = 4096


def lora_like() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {
        "base": torch.randn(256, 1024, generator=gen),  # 1 MiB, frozen
        "lora_a": torch.randn(8, 1024, generator=gen),
        "lora_b": torch.randn(1024, 8, generator=gen),
        "step": 0,
    }


def inc(base: str | None = None, **kw: Any) -> fp.Incremental:
    return fp.Incremental(base=base, block_bytes=BLOCK, **kw)


def own_bytes(path: str) -> int:
    """Bytes of the files this step wrote itself (not linked from an earlier step)."""
    m = read_manifest(path)
    return sum(f.len_bytes for f in m.files if ".from-" not in f.name)


def test_a_step_writes_only_what_changed_and_loads_whole_without_its_base(tmp_path: Any) -> None:
    state = lora_like()
    first = fp.save(state, tmp_path / "s0", incremental=inc())
    assert read_manifest(str(tmp_path / "s0")).format_version == (1, 3)  # a full step: 1.x readers load it
    state["lora_a"] += 1
    state["step"] = 1
    second = fp.save(state, tmp_path / "s1", incremental=inc(tmp_path / "s0"))
    m = read_manifest(str(tmp_path / "s1"))
    assert m.format_version == (2, 0) and m.incremental_depth == 1
    changed = state["lora_a"].nbytes
    assert changed <= second.nbytes <= changed + 2 * BLOCK  # the blocks holding lora_a, no more
    assert second.nbytes * 20 < first.nbytes
    assert own_bytes(str(tmp_path / "s1")) == second.nbytes
    shutil.rmtree(tmp_path / "s0")  # the base goes: the step holds its own links
    assert same(fp.load(tmp_path / "s1"), state)
    assert fp.verify(tmp_path / "s1")["bytes"] >= first.nbytes


def test_writes_the_version_counter_cannot_see_are_saved(tmp_path: Any) -> None:
    state = lora_like()
    fp.save(state, tmp_path / "s0", incremental=inc())
    version = state["base"]._version
    state["base"].numpy()[3, 7] = 42.0  # numpy view
    state["base"].data[100, 0] = -1.0  # .data
    ctypes.memset(state["base"].data_ptr() + 200 * 1024 * 4, 0, 16)  # raw memory, as a C extension writes
    assert state["base"]._version == version
    fp.save(state, tmp_path / "s1", incremental=inc(tmp_path / "s0"))
    loaded = fp.load(tmp_path / "s1")
    assert loaded["base"][3, 7] == 42.0 and loaded["base"][100, 0] == -1.0 and loaded["base"][200, :4].eq(0).all()
    assert same(loaded, state)


def test_blocks_inside_a_tensor(tmp_path: Any) -> None:
    table = torch.randn(4096, 64)  # 1 MiB: 256 blocks of 4 KiB (16 rows each)
    fp.save({"emb": table}, tmp_path / "s0", incremental=inc())
    rows = [5, 6, 900, 4000]
    table[rows] += 1
    result = fp.save({"emb": table}, tmp_path / "s1", incremental=inc(tmp_path / "s0"))
    assert result.nbytes == 3 * BLOCK  # rows 5 and 6 share a block
    assert same(fp.load(tmp_path / "s1"), {"emb": table})


def test_tied_weights_stay_tied_and_buffers_changed_in_forward_are_saved(tmp_path: Any) -> None:
    """A model's own state: an embedding tied to the output layer (one blob, two keys) and
    batch norm statistics that the forward pass changes without any optimizer step."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(512, 64)
    head = torch.nn.Linear(64, 512, bias=False)
    head.weight = emb.weight  # tied
    norm = torch.nn.BatchNorm1d(64)
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "norm": norm})
    fp.save(model.state_dict(), tmp_path / "s0", incremental=inc())
    norm.train()
    norm(torch.randn(32, 64))  # running_mean, running_var, num_batches_tracked change
    state = model.state_dict()
    result = fp.save(state, tmp_path / "s1", incremental=inc(tmp_path / "s0"))
    stats = norm.running_mean.nbytes + norm.running_var.nbytes + norm.num_batches_tracked.nbytes
    assert 0 < result.nbytes <= stats + 4 * BLOCK and result.nbytes < emb.weight.nbytes  # the table is linked
    loaded = fp.load(tmp_path / "s1")
    assert same(loaded, state) and int(loaded["norm.num_batches_tracked"]) == 1
    assert loaded["emb.weight"].untyped_storage().data_ptr() == loaded["head.weight"].untyped_storage().data_ptr()
    with torch.no_grad():
        emb.weight[7] += 1  # through the tie: one block of the one blob
    result = fp.save(model.state_dict(), tmp_path / "s2", incremental=inc(tmp_path / "s1"))
    assert result.nbytes <= 2 * BLOCK
    assert same(fp.load(tmp_path / "s2"), model.state_dict())


def test_nothing_changed_writes_nothing_and_a_chain_of_steps_each_loads(tmp_path: Any) -> None:
    state = lora_like()
    states = []
    for i in range(5):
        base = str(tmp_path / f"s{i - 1}") if i else None
        if i in (2, 4):
            state["lora_b"][i] += i
        state["step"] = i
        fp.save(state, tmp_path / f"s{i}", incremental=inc(base))
        states.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
    assert own_bytes(str(tmp_path / "s3")) == 0 or read_manifest(str(tmp_path / "s3")).files
    for i in (0, 1, 3):
        shutil.rmtree(tmp_path / f"s{i}")
    for i in (2, 4):
        assert same(fp.load(tmp_path / f"s{i}"), states[i])
        fp.verify(tmp_path / f"s{i}")


def test_full_every_and_max_span_bound_what_a_step_refers_to(tmp_path: Any) -> None:
    state = {"a": torch.zeros(4 * 1024), "b": torch.zeros(4 * 1024), "c": torch.zeros(4 * 1024)}  # 3 blocks
    fp.save(state, tmp_path / "s0", incremental=inc(full_every=3))
    depths = []
    for i in range(1, 6):
        state["a"] += 1
        fp.save(state, tmp_path / f"s{i}", incremental=inc(tmp_path / f"s{i - 1}", full_every=3))
        depths.append(read_manifest(str(tmp_path / f"s{i}")).incremental_depth)
    assert depths == [1, 2, 0, 1, 2]
    # Each step changes another block: after two, its bytes would come from 3 saves.
    fp.save(state, tmp_path / "t0", incremental=inc(max_span=2))
    for i, key in enumerate("bc", start=1):
        state[key] += 1
        fp.save(state, tmp_path / f"t{i}", incremental=inc(tmp_path / f"t{i - 1}", max_span=2))
    assert read_manifest(str(tmp_path / "t1")).incremental_depth == 1
    assert read_manifest(str(tmp_path / "t2")).incremental_depth == 0
    assert same(fp.load(tmp_path / "t2"), state)


def test_damage_to_a_shared_block_is_reported_by_every_step_that_uses_it(tmp_path: Any) -> None:
    state = lora_like()
    fp.save(state, tmp_path / "s0", incremental=inc())
    state["lora_b"] += 1
    fp.save(state, tmp_path / "s1", incremental=inc(tmp_path / "s0"))
    data = tmp_path / "s0" / read_manifest(str(tmp_path / "s0")).files[0].name
    with open(data, "r+b") as f:  # the frozen base's bytes: one inode, named by both steps
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    for step in ("s0", "s1"):
        with pytest.raises(ChecksumMismatchError, match="base"):
            fp.load(tmp_path / step)
        with pytest.raises(ChecksumMismatchError):
            fp.verify(tmp_path / step)


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_a_base_file_that_is_not_its_own_makes_a_full_write(tmp_path: Any, caplog: Any, planted: str) -> None:
    state = lora_like()
    fp.save(state, tmp_path / "s0", incremental=inc())
    data = tmp_path / "s0" / read_manifest(str(tmp_path / "s0")).files[0].name
    (tmp_path / "elsewhere.bin").write_bytes(data.read_bytes())
    data.unlink()
    if planted == "symlink":
        data.symlink_to(tmp_path / "elsewhere.bin")
    else:
        os.mkfifo(data)  # never opened for reading without O_NONBLOCK: no hang
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        result = fp.save(state, tmp_path / "s1", incremental=inc(tmp_path / "s0"))
    assert "unusable" in caplog.text and result.nbytes >= state["base"].nbytes
    assert read_manifest(str(tmp_path / "s1")).incremental_depth == 0
    assert not any(os.path.islink(p) for p in (tmp_path / "s1").iterdir())
    assert same(fp.load(tmp_path / "s1"), state)


def test_a_missing_or_foreign_base_makes_a_full_write(tmp_path: Any) -> None:
    state = lora_like()
    fp.save(state, tmp_path / "plain")  # no chunk hashes
    for base in (tmp_path / "missing", tmp_path / "plain"):
        result = fp.save(state, tmp_path / "s", incremental=inc(base))
        assert result.nbytes >= state["base"].nbytes
    fp.save(state, tmp_path / "other-block", incremental=fp.Incremental(block_bytes=8192))
    assert fp.save(state, tmp_path / "s", incremental=inc(tmp_path / "other-block")).nbytes >= state["base"].nbytes


def test_the_base_may_be_the_path_itself(tmp_path: Any) -> None:
    state = lora_like()
    fp.save(state, tmp_path / "ck", incremental=inc())
    state["lora_a"] -= 3
    result = fp.save(state, tmp_path / "ck", incremental=inc(tmp_path / "ck"))
    fp.wait_removed()
    assert result.nbytes <= state["lora_a"].nbytes + 2 * BLOCK
    assert same(fp.load(tmp_path / "ck"), state)


def test_save_async_incremental(tmp_path: Any) -> None:
    state = lora_like()
    fp.save_async(state, tmp_path / "s0", incremental=inc()).wait()
    state["lora_b"] *= 2
    fut = fp.save_async(state, tmp_path / "s1", incremental=inc(tmp_path / "s0"))
    fut.wait_staged()
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    state["lora_b"] += 1  # after wait_staged: not in the step
    assert fut.wait().nbytes <= state["lora_b"].nbytes + 2 * BLOCK
    assert same(fp.load(tmp_path / "s1"), expected)


def test_refused_where_not_built_yet(tmp_path: Any) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.raises(ValueError, match="stripes"):
        fp.save(
            {"w": torch.ones(4)},
            tmp_path / "s",
            incremental=inc(),
            config=fp.Config(stripes=[str(tmp_path / "a"), str(tmp_path / "b")]),
        )
    with pytest.raises(ValueError, match="block_bytes"):
        fp.Incremental(block_bytes=1000)
    with pytest.raises(ValueError, match="max_span"):
        fp.Incremental(max_span=0)


def test_a_manifest_whose_runs_hold_a_chunk_twice_is_refused(tmp_path: Any) -> None:
    state = lora_like()
    fp.save(state, tmp_path / "s0", incremental=inc())
    state["lora_a"] += 1
    fp.save(state, tmp_path / "s1", incremental=inc(tmp_path / "s0"))
    path = tmp_path / "s1" / "manifest.json"
    body = json.loads(path.read_bytes())
    del body["manifest_sha256"]
    own = next(f for f in body["files"] if ".from-" not in f["name"])
    linked = next(f for f in body["files"] if ".from-" in f["name"])
    linked["stream_chunks"].append([*own["stream_chunks"][0][:2], 1])
    linked["stream_chunks"].sort()
    path.write_bytes(seal(json.dumps(body, separators=(",", ":")).encode()))
    with pytest.raises(CorruptCheckpointError, match=r"holds again|chunk"):
        fp.load(tmp_path / "s1")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(0, 3 * BLOCK), min_size=1, max_size=8),
    pick=st.lists(st.booleans(), min_size=1, max_size=16),
)
def test_packed_changed_chunks_are_the_streams_chunks(lengths: list[int], pick: list[bool]) -> None:
    stream = _core.Plan(lengths, 1, 1, BLOCK)
    chunks = [c for c in range(_core.chunk_count(stream.total_bytes, BLOCK)) if pick[c % len(pick)]]
    if not chunks:
        return
    segments = segments_of(stream.extent_offsets, lengths, stream.total_bytes, BLOCK, chunks)
    own = _core.Plan([s.hi - s.lo for s in segments], 1, 1, BLOCK)
    check_packed(own, segments, stream.extent_offsets, chunks, stream.total_bytes)
    # byte for byte: materialise both streams from random blob bytes
    rng = np.random.default_rng(len(lengths))
    blobs = [rng.integers(0, 256, n, dtype=np.uint8) for n in lengths]
    full = np.zeros(stream.total_bytes, dtype=np.uint8)
    for b, at in zip(blobs, stream.extent_offsets, strict=True):
        full[at : at + len(b)] = b
    packed = np.zeros(own.total_bytes, dtype=np.uint8)
    for s, at in zip(segments, own.extent_offsets, strict=True):
        packed[at : at + s.hi - s.lo] = blobs[s.blob][s.lo : s.hi]
    for k, c in enumerate(chunks):
        want = full[c * BLOCK : (c + 1) * BLOCK]
        assert np.array_equal(packed[k * BLOCK : k * BLOCK + len(want)], want)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=5),
    steps=st.lists(
        st.tuples(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4999)), max_size=4), st.integers(0, 7)),
        min_size=1,
        max_size=5,
    ),
)
def test_every_step_of_a_random_series_loads_exactly(tmp_path_factory: Any, sizes: list[int], steps: Any) -> None:
    root = tmp_path_factory.mktemp("series")
    state = {f"t{i}": torch.arange(n, dtype=torch.float32) for i, n in enumerate(sizes)}
    kept: dict[str, dict[str, torch.Tensor]] = {}
    previous = None
    for i, (writes, drop) in enumerate(steps):
        for which, at in writes:
            t = state[f"t{which % len(sizes)}"]
            if t.numel():
                t.numpy()[at % t.numel()] += 1  # bypasses the version counter
        path = str(root / f"s{i}")
        fp.save(state, path, incremental=inc(previous, full_every=4, max_span=3))
        kept[path] = {k: v.clone() for k, v in state.items()}
        previous = path
        if drop % 3 == 0 and len(kept) > 1:  # retention: an older step goes
            gone = sorted(kept)[drop % (len(kept) - 1)]
            shutil.rmtree(gone)
            del kept[gone]
        for where, expected in kept.items():
            assert same(fp.load(where), expected), where
    # Damage: one byte of one kept step's file. Every step naming that inode reports it, no other.
    victim_step = sorted(kept)[len(steps) % len(kept)]
    m = read_manifest(victim_step)
    if not m.files:
        return
    victim = os.path.join(victim_step, m.files[len(sizes) % len(m.files)].name)
    with open(victim, "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0x55]))
    damaged = os.stat(victim).st_ino
    for where, expected in kept.items():
        inodes = {os.stat(os.path.join(where, f.name)).st_ino for f in read_manifest(where).files}
        if damaged in inodes:
            with pytest.raises(ChecksumMismatchError):
                fp.verify(where)
        else:
            assert same(fp.load(where), expected), where


def lora_step(state: dict[str, Any], step: int) -> dict[str, Any]:
    state["lora_a"] += step  # every trainable parameter changes, as in training
    state["lora_b"] -= step
    state["step"] = step
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_a_checkpointer_builds_each_step_on_the_newest_and_retires_freely(tmp_path: Any, where: str) -> None:
    root = str(tmp_path / "root") if where == "disk" else f"/dev/shm/fp-incremental-test-{os.getpid()}"
    try:
        state = lora_like()
        expected = {}
        with fp.Checkpointer(root, every=1, keep=2, incremental=inc()) as ck:
            written = []
            for step in range(1, 7):
                expected[step] = lora_step(state, step)
                fut = ck.save(step, state)
                ck.wait_staged()
                written.append(fut.wait().nbytes)
        assert ck.steps() == [5, 6]  # the full step 1 retired: 5 and 6 keep its bytes by their links
        assert written[0] <= ck.levels()["local"]["bytes"] <= written[0] + 3 * max(written[1:])  # shared once
        assert max(written[1:]) * 10 < written[0]  # the 64 KiB of adapters, not the 1 MiB base
        for step in (5, 6):
            assert same(fp.load(ck.path(step)), expected[step])
        again = fp.Checkpointer(root, incremental=inc())
        assert same(again.load(), expected[6])
    finally:
        if where == "memory":
            shutil.rmtree(root, ignore_errors=True)


def test_a_checkpointer_drains_incremental_steps_to_a_remote_that_restores_them(tmp_path: Any) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    state = lora_like()
    with fp.Checkpointer(local, every=1, keep=2, incremental=inc(), levels=[fp.Remote(remote, every=1)]) as ck:
        for step in range(1, 4):
            last = lora_step(state, step)
            ck.save(step, state)
            ck.wait_staged()
    shutil.rmtree(local)
    again = fp.Checkpointer(local, incremental=inc(), levels=[fp.Remote(remote, every=1)])
    assert same(again.load(), last)
    again.close()


def test_a_checkpointer_refuses_a_base_or_a_group() -> None:
    with pytest.raises(ValueError, match="no base"):
        fp.Checkpointer("/tmp/unused", incremental=fp.Incremental(base="/tmp/x"))


def test_inspect_shows_what_a_step_wrote_and_what_it_refers_to(tmp_path: Any, capsys: Any) -> None:
    state = lora_like()
    fp.save(state, tmp_path / "s0", incremental=inc())
    state["lora_b"] += 1
    fp.save(state, tmp_path / "s1", incremental=inc(tmp_path / "s0"))
    info = fp.inspect(tmp_path / "s1")
    s0_id = read_manifest(str(tmp_path / "s0")).checkpoint_id[:12]
    total = read_manifest(str(tmp_path / "s1")).total_bytes
    inc_info = info["incremental"]
    assert inc_info["depth"] == 1 and list(inc_info["refers_to"]) == [s0_id]
    assert inc_info["wrote_bytes"] + inc_info["refers_to"][s0_id] == total
    assert state["lora_b"].nbytes <= inc_info["wrote_bytes"] <= state["lora_b"].nbytes + 2 * BLOCK
    assert fp.inspect(tmp_path / "s0")["incremental"]["refers_to"] == {}
    assert cli.main(["inspect", str(tmp_path / "s1")]) == 0
    assert f"written by save {s0_id}" in capsys.readouterr().out


@pytest.mark.parametrize("old_tree", ["kept", "deleted"])
def test_a_base_replaced_while_the_step_is_planned_still_gives_the_step_its_bytes(
    tmp_path: Any, monkeypatch: Any, old_tree: str
) -> None:
    state = lora_like()
    fp.save(state, tmp_path / "base", incremental=inc())
    state["lora_a"] += 1
    original = incremental_module.link_into
    replaced = []

    def replace_base_first(link: Any, directory: str) -> None:
        if not replaced:
            other = {k: v + 7 if isinstance(v, torch.Tensor) else v for k, v in state.items()}
            fp.save(other, tmp_path / "base", incremental=inc())  # same names, other bytes
            if old_tree == "deleted":
                fp.wait_removed()  # the base's files are gone: they cannot be linked
            replaced.append(True)
        original(link, directory)

    monkeypatch.setattr(incremental_module, "link_into", replace_base_first)
    result = fp.save(state, tmp_path / "s1", incremental=inc(tmp_path / "base"))
    monkeypatch.undo()
    assert same(fp.load(tmp_path / "s1"), state)  # the base it read, or a full write: never the new base's bytes
    fp.verify(tmp_path / "s1")
    if old_tree == "deleted":
        assert result.nbytes >= state["base"].nbytes


def test_the_remote_level_receives_only_the_bytes_a_step_wrote(tmp_path: Any) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    state = lora_like()
    with fp.Checkpointer(local, every=1, keep=3, incremental=inc(), levels=[fp.Remote(remote, every=1, keep=3)]) as ck:
        for step in range(1, 4):
            last = lora_step(state, step)
            ck.save(step, state)
            ck.close()  # each drained before the next
    drained = [json.loads((remote / f"step-{s:08d}" / ".fpdrained-00000.json").read_bytes())["bytes"] for s in (2, 3)]
    assert all(n <= 2 * (state["lora_a"].nbytes + state["lora_b"].nbytes) + 4 * BLOCK for n in drained), drained
    base_file = next(p for p in (remote / "step-00000001").iterdir() if p.suffix == ".bin")
    assert base_file.stat().st_nlink == 3  # one inode for the frozen bytes of the three remote steps
    shutil.rmtree(local)
    shutil.rmtree(remote / "step-00000001")
    again = fp.Checkpointer(local, levels=[fp.Remote(remote, every=1)])
    assert same(again.load(), last)
    again.close()


def test_an_incremental_step_reads_as_any_step(tmp_path: Any) -> None:
    """load(out=...), windowed; fastpersist convert to torch.save; fp.export_hf."""
    state = lora_like()
    fp.save(state, tmp_path / "s0", incremental=inc())
    state["lora_a"] *= -1
    fp.save(state, tmp_path / "s1", incremental=inc(tmp_path / "s0"))
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    loaded = fp.load(tmp_path / "s1", out=out)
    assert loaded["base"] is out["base"] and same(loaded, state)
    assert cli.main(["convert", str(tmp_path / "s1"), str(tmp_path / "s1.pt"), "--to", "torch"]) == 0
    assert same(torch.load(tmp_path / "s1.pt", weights_only=True), state)
    fp.export_hf(tmp_path / "s1", tmp_path / "hf")
    exported = load_file(str(next((tmp_path / "hf").glob("*.safetensors"))))
    assert torch.equal(exported["lora_a"], state["lora_a"]) and torch.equal(exported["base"], state["base"])
