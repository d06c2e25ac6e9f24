"""save / save_async / load / inspect / verify through the public API, on every backend."""

from __future__ import annotations

import collections
import gc
import json
import math
import os
import shutil
import time
from typing import Any

import numpy as np
import pytest
import torch

import fastpersist as fp
from fastpersist.format.manifest import seal

from training import make_run, restore, seed_all, train_step, training_state


def assert_same(a: object, b: object, path: str = "state") -> None:
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)), path
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert isinstance(b, dict)
        assert list(a.keys()) == list(b.keys()), path
        assert [type(k) for k in a] == [type(k) for k in b], f"{path}: key types"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple))
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert a == b, path


Point = collections.namedtuple("Point", ["x", "y"])


def sample_state() -> dict[str, object]:
    torch.manual_seed(0)
    emb = torch.nn.Parameter(torch.randn(50, 8))
    return {
        "model": collections.OrderedDict(
            [("emb.weight", emb), ("head.weight", emb), ("bias", torch.zeros(50, dtype=torch.bfloat16))]
        ),
        "opt": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(50, 8)}}, "lr": 1e-3},
        "big": torch.arange(300_000, dtype=torch.float32).reshape(1000, 300).t(),  # non-contiguous
        "arr": np.arange(10, dtype=np.int16),
        "misc": [None, True, 2**80, -0.0, float("inf"), "s", b"\x00\xff", torch.float16, torch.Size([2, 3])],
        "pt": Point(1, torch.ones(2, dtype=torch.complex64)),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "by_shape": {torch.Size([2, 3]): 1, (2, 3, 4): 2, torch.device("cpu"): 3, 1j: 4, torch.Size([]): 5},
    }


def test_round_trip_and_aliasing(workdir: str, config: fp.Config) -> None:
    state = sample_state()
    path = os.path.join(workdir, "ck")
    res = fp.save(state, path, config=config)
    assert res.backend == config.backend
    assert res.nbytes > 1_200_000 and res.seconds > 0 and res.files
    loaded = fp.load(path, config=config, namedtuple_types=[Point])
    assert_same(state, loaded)
    emb, head = loaded["model"]["emb.weight"], loaded["model"]["head.weight"]
    assert isinstance(emb, torch.nn.Parameter) and emb.requires_grad
    with torch.no_grad():
        emb.add_(1)
    assert torch.equal(emb, head), "tied weights must come back sharing storage"


def test_training_resume_is_bit_exact(workdir: str, config: fp.Config) -> None:
    seed_all(0)
    model, opt, sched = make_run(0)
    for _ in range(3):
        train_step(model, opt, sched)
    path = os.path.join(workdir, "train")
    fp.save(training_state(model, opt, sched, 3), path, config=config)
    expected = [train_step(model, opt, sched) for _ in range(5)]
    expected_params = {k: v.clone() for k, v in model.state_dict().items()}

    seed_all(123)  # scramble every RNG: the checkpoint must restore them
    model2, opt2, sched2, step = restore(fp.load(path, config=config))
    assert step == 3
    got = [train_step(model2, opt2, sched2) for _ in range(5)]
    assert got == expected
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected_params[k]), k


def test_out_fills_existing_tensors_in_place(workdir: str, config: fp.Config) -> None:
    model, _, _ = make_run(0)
    path = os.path.join(workdir, "out")
    fp.save({"model": model.state_dict()}, path, config=config)
    other, _, _ = make_run(1)
    target = {"model": other.state_dict()}
    ptrs = {k: v.data_ptr() for k, v in target["model"].items()}
    result = fp.load(path, out=target, config=config)
    for k, v in target["model"].items():
        assert result["model"][k] is v, k  # the returned state holds out's tensors
        assert v.data_ptr() == ptrs[k], k
        assert torch.equal(v, model.state_dict()[k]), k


def test_out_is_matched_by_key_not_position(workdir: str, backend: str) -> None:
    path = os.path.join(workdir, "bykey")
    saved = {"a": torch.arange(5.0), "b": torch.arange(5.0) + 100, "step": 7, "lr": 0.5, "rng": torch.arange(3)}
    fp.save(saved, path)
    out = {"b": torch.zeros(5), "a": torch.zeros(5), "step": -1}  # other order, stale values
    ptr_a = out["a"].data_ptr()
    state = fp.load(path, out=out, config=fp.Config(backend=backend))
    assert torch.equal(out["a"], saved["a"]) and torch.equal(out["b"], saved["b"])
    assert out["a"].data_ptr() == ptr_a and state["a"] is out["a"]
    assert state["step"] == 7 and state["lr"] == 0.5  # non-tensor values from the checkpoint
    assert torch.equal(state["rng"], saved["rng"])  # a tensor out lacks comes back new


def test_out_missing_key_or_mismatch_names_the_key_and_leaves_out_untouched(workdir: str) -> None:
    path = os.path.join(workdir, "mismatch")
    fp.save({"model": {"w": torch.ones(4), "b": torch.ones(2)}}, path)
    out = {"model": {"w": torch.zeros(4), "extra": torch.zeros(1)}}
    with pytest.raises(ValueError, match=r"state\.model\.extra"):
        fp.load(path, out=out)
    out = {"model": {"w": torch.zeros(4), "b": torch.zeros(3)}}
    with pytest.raises(ValueError, match=r"state\.model\.b.*float32\[3\].*float32\[2\]"):
        fp.load(path, out=out)
    assert out["model"]["w"].sum().item() == 0  # checked before anything was read
    with pytest.raises(ValueError, match=r"state\.model\.w"):
        fp.load(path, out={"model": {"w": torch.zeros(4, dtype=torch.float64)}})


def test_out_reads_through_a_bounded_window(workdir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from fastpersist import _core
    from fastpersist.loading import fill

    path = os.path.join(workdir, "window")
    saved = {f"t{i}": torch.full(((1 << 20) // 4,), float(i)) for i in range(12)}  # 12 MiB
    saved["tied"] = saved["t0"]
    fp.save(saved, path, config=fp.Config(chunk_bytes=64 << 10))
    sizes: list[int] = []
    real = _core.PagedBuffer

    def recording(nbytes: int) -> _core.PagedBuffer:
        sizes.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(fill._core, "PagedBuffer", recording)
    monkeypatch.setattr(fill, "WINDOW_BYTES", 3 << 20)
    monkeypatch.setattr(fill, "FILL_BUFFER_BYTES", 6 << 20)  # two windows in flight at most

    out = {k: torch.zeros_like(v) for k, v in saved.items() if k != "tied"}
    state = fp.load(path, out=out)
    for k, v in out.items():
        assert torch.equal(v, saved[k]), k
    assert torch.equal(state["tied"], saved["t0"])
    assert sizes and max(sizes) <= (3 << 20) + (256 << 10)  # never the state's 12 MiB
    assert sum(sizes) <= 2 * ((3 << 20) + (256 << 10)), sizes  # buffers are reused within the budget


def test_out_mismatch_is_rejected(workdir: str) -> None:
    path = os.path.join(workdir, "mm")
    fp.save({"a": torch.zeros(3)}, path)
    with pytest.raises(ValueError, match="state"):
        fp.load(path, out={"a": torch.zeros(4)})


def test_save_async_semantics(workdir: str, config: fp.Config) -> None:
    state = {"w": torch.randn(1 << 18), "step": 1}
    fut = fp.save_async(state, os.path.join(workdir, "a"), config=config)
    fut.wait_staged()
    state["w"].add_(1)  # allowed after wait_staged
    res = fut.wait()
    assert fut.done() and fut.exception() is None and fut.result() is res
    loaded = fp.load(res.path)
    assert torch.equal(loaded["w"] + 1, state["w"])
    seen = []
    fut.add_done_callback(seen.append)
    assert seen == [fut]


def test_overwrite_is_atomic_and_keeps_old_on_failure(workdir: str, config: fp.Config) -> None:
    path = os.path.join(workdir, "ow")
    fp.save({"v": torch.tensor([1])}, path, config=config)
    fp.save({"v": torch.tensor([2])}, path, config=config)
    assert fp.load(path)["v"].item() == 2
    with pytest.raises(fp.UnsupportedValueError, match=r"state\.bad"):
        fp.save({"v": torch.tensor([3]), "bad": object()}, path, config=config)
    assert fp.load(path)["v"].item() == 2
    assert fp.wait_removed(timeout=60)  # the first tree, replaced by the second save, goes in the background
    assert sorted(os.listdir(workdir)) == ["ow"], "no temporary leftovers"


def test_refuses_to_replace_a_foreign_directory(workdir: str) -> None:
    target = os.path.join(workdir, "mine")
    os.mkdir(target)
    with open(os.path.join(target, "precious.txt"), "w") as f:
        f.write("x")
    with pytest.raises(FileExistsError):
        fp.save({"a": 1}, target)
    assert os.path.exists(os.path.join(target, "precious.txt"))


def test_inspect_and_verify_catch_a_flipped_byte(workdir: str, config: fp.Config) -> None:
    path = os.path.join(workdir, "iv")
    fp.save({"a": torch.arange(100_000, dtype=torch.int32), "b": torch.ones(10)}, path, config=config)
    info = fp.inspect(path)
    assert info["tensors"] == 2 and info["bytes"] == 400_040 and info["format_version"] == "1.2"
    assert info["checksum"] == "crc32c" and info["files"]
    assert fp.verify(path)["chunks"] == sum(f["chunks"] for f in info["files"])
    data_file = info["files"][0]["path"]
    with open(data_file, "r+b") as f:
        f.seek(1234)
        byte = f.read(1)
        f.seek(1234)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(fp.ChecksumMismatchError, match=r"state\.a"):
        fp.verify(path)
    with pytest.raises(fp.ChecksumMismatchError, match=r"bytes \[0, 65536\)") as caught:
        fp.load(path, config=config)
    assert caught.value.filename == data_file and caught.value.offset_bytes == 0
    assert caught.value.tensors == ["state.a"]
    assert fp.load(path, verify=False)["b"].sum().item() == 10


def test_damaged_checkpoints_raise_clear_errors(workdir: str) -> None:
    path = os.path.join(workdir, "dm")
    fp.save({"a": torch.ones(5000)}, path)
    with pytest.raises(FileNotFoundError):
        fp.load(os.path.join(workdir, "nothing"))
    manifest = os.path.join(path, "manifest.json")
    doc = json.load(open(manifest))
    data_file = os.path.join(path, doc["files"][0]["name"])
    os.truncate(data_file, 100)
    with pytest.raises(fp.CorruptCheckpointError, match="wrong size"):
        fp.load(path)
    os.remove(data_file)
    with pytest.raises(fp.CorruptCheckpointError, match="missing"):
        fp.load(path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(format_version=[3, 0]), "upgrade fastpersist"),
        (lambda d: d["files"][0].update(name="../../etc/passwd"), "plain file name"),
        (lambda d: d["files"][0].update(len_bytes=10**12), "chunk checksums|total_bytes"),
        (lambda d: d.update(total_bytes=d["total_bytes"] + 1), "total_bytes"),
        (lambda d: d["blobs"][0].update(len_bytes=10**12), "blobs"),
        (lambda d: d["tensors"][0].update(shape=[10**6]), "needs"),
        (lambda d: d["files"][0].update(chunk_crc32c=[]), "checksums"),
        (lambda d: d.update(tree={"t": "nope"}), "manifest"),
    ],
)
def test_hostile_manifest_edits_are_rejected(workdir: str, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    path = os.path.join(workdir, "h")
    fp.save({"a": torch.ones(5000)}, path)
    manifest = os.path.join(path, "manifest.json")
    doc = json.load(open(manifest))
    edit(doc)
    doc.pop("manifest_sha256")
    with open(manifest, "wb") as f:
        f.write(seal(json.dumps(doc).encode()))  # re-sealed: the checks past the seal must hold too
    with pytest.raises(fp.CorruptCheckpointError, match=message):
        fp.load(path)


def test_map_location_and_numpy_only(workdir: str) -> None:
    path = os.path.join(workdir, "ml")
    fp.save({"a": torch.ones(3), "n": np.ones(2)}, path)
    loaded = fp.load(path, map_location="cpu")
    assert loaded["a"].device.type == "cpu"
    loaded = fp.load(path, map_location={"cpu": "cpu"})
    assert isinstance(loaded["n"], np.ndarray)


def test_stripes_spread_files_and_load(workdir: str, config: fp.Config) -> None:
    stripes = [os.path.join(workdir, f"ssd{i}") for i in range(3)]
    for s in stripes:
        os.mkdir(s)
    cfg = fp.Config(stripes=stripes, backend=config.backend, chunk_bytes=64 << 10)
    state = {"w": torch.randn(200_000)}
    path = os.path.join(workdir, "striped")
    res = fp.save(state, path, config=cfg)
    assert len(res.files) == 3
    assert {os.path.dirname(os.path.dirname(f)) for f in res.files} == set(stripes)
    assert torch.equal(fp.load(path)["w"], state["w"])
    fp.save({"w": torch.zeros(1)}, path, config=cfg)  # replacing removes the old stripe dirs
    fp.wait_removed()  # (after the commit, on the remover's thread)
    assert sum(len(os.listdir(s)) for s in stripes) == 1


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        fp.Config(chunk_bytes=1000)
    with pytest.raises(ValueError, match="backend"):
        fp.Config(backend="uring")
    with pytest.raises(ValueError, match="direct_io"):
        fp.Config(direct_io="yes")


@pytest.mark.parametrize(
    ("knobs", "least"),
    [
        ({"pinned_bytes": 1}, 128 << 20),  # "auto" chunks: a tuned one may be half of the 256 MiB pool
        ({"chunk_bytes": 8 << 20, "pinned_bytes": 4 << 20}, 8 << 20),
        ({"chunk_bytes": 4096, "pinned_bytes": 1 << 20}, 2 << 20),  # arenas come in 2 MiB granules
        ({"pool_bytes": 0, "pinned_bytes": (8 << 20) - 1}, 8 << 20),
    ],
)
def test_pinned_bytes_below_one_chunk_is_refused_naming_both(knobs: dict[str, int], least: int) -> None:
    # A device save stages through an arena of at least one chunk: a smaller bound waited forever.
    refused = rf"Config\.pinned_bytes={knobs['pinned_bytes']}: expected at least {least} "
    with pytest.raises(ValueError, match=refused) as info:
        fp.Config(**knobs)  # type: ignore[arg-type]
    assert "chunk_bytes" in str(info.value)
    fp.Config(**{**knobs, "pinned_bytes": least})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda p: fp.save({"w": torch.zeros(1)}, p + "-new", config="x"), "config='x': expected a fastpersist.Config"),
        (lambda p: fp.save_async({"w": torch.zeros(1)}, p + "-new", config={"durable": False}), "config={'durable'"),
        (lambda p: fp.load(p, config="x"), "config='x'"),
        (lambda p: fp.inspect(p, config="x"), "config='x'"),
        (lambda p: fp.verify(p, config="x"), "config='x'"),
        (lambda p: fp.load(p, phases="x"), "phases='x': expected a dict"),
        (lambda p: fp.load(p, out=5), "out=5: expected None or the state to fill"),
        (lambda p: fp.load(p, out="w"), "out='w'"),
        (lambda p: fp.load(p, out={"w": torch.empty(10, device="meta")}), "is on the meta device"),
    ],
)
def test_bad_arguments_are_refused_at_the_call_naming_them(workdir: str, call: Any, named: str) -> None:
    path = os.path.join(workdir, "ck")
    fp.save({"w": torch.randn(10)}, path)
    with pytest.raises((TypeError, ValueError)) as info:
        call(path)
    assert named in str(info.value)
    assert not os.path.exists(path + "-new")  # a refused save writes nothing


@pytest.mark.parametrize("save", [fp.save, lambda state, path: fp.save_async(state, path).wait()])
def test_an_empty_path_is_refused_not_taken_as_the_working_directory(
    workdir: str, monkeypatch: pytest.MonkeyPatch, save: Any
) -> None:
    """In an empty working directory, save(state, "") replaced the working directory itself."""
    empty = os.path.join(workdir, "cwd")
    os.mkdir(empty)
    monkeypatch.chdir(empty)
    with pytest.raises(ValueError, match=r"fastpersist\.save(_async)?\(path=''\): expected the checkpoint directory"):
        save({"w": torch.ones(2)}, "")
    assert os.listdir(workdir) == ["cwd"] and os.listdir(empty) == []


@pytest.mark.parametrize("timeout", ["x", float("nan"), True, [1]])
def test_a_bad_timeout_is_refused_naming_the_call(workdir: str, timeout: object) -> None:
    fut = fp.save_async({"w": torch.ones(2)}, os.path.join(workdir, "ck"))
    for method in ("wait_staged", "wait", "result", "exception"):
        with pytest.raises(TypeError, match=rf"SaveFuture\.{method}\(timeout=.*\): expected None .* number of seconds"):
            getattr(fut, method)(timeout)
    with pytest.raises(TypeError, match=r"fastpersist\.wait_removed\(timeout="):
        fp.wait_removed(timeout)
    assert fut.wait(timeout=float("inf")).path.endswith("ck") and fut.exception(0) is None
    assert fp.wait_removed(timeout=60)


def test_empty_state(workdir: str, config: fp.Config) -> None:
    path = os.path.join(workdir, "e")
    fp.save({}, path, config=config)
    assert fp.load(path) == {}
    fp.save({"x": torch.empty(0)}, path, config=config)
    assert fp.load(path)["x"].numel() == 0


def test_missing_parents_are_created_as_mkdir_p_would(workdir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's loop saves to ckpt/step-N in an empty directory: ckpt/ is made (it failed)."""
    monkeypatch.chdir(workdir)
    fp.save_async({"a": torch.ones(2)}, "ckpt/step-0").wait()
    fp.save({"a": torch.ones(3)}, os.path.join(workdir, "no", "such", "dir"))
    assert torch.equal(fp.load("ckpt/step-0")["a"], torch.ones(2))
    assert torch.equal(fp.load(os.path.join(workdir, "no", "such", "dir"))["a"], torch.ones(3))


def test_leftover_free_failure_on_a_parent_that_cannot_be_made(workdir: str) -> None:
    blocker = os.path.join(workdir, "file")
    open(blocker, "wb").close()
    with pytest.raises((FileExistsError, NotADirectoryError)):
        fp.save({"a": torch.ones(2)}, os.path.join(blocker, "sub", "dir"))
    with pytest.raises(ValueError, match="a save writes a local or mounted directory"):
        fp.save({"a": torch.ones(2)}, "s3://bucket/ckpt")
    assert os.listdir(workdir) == ["file"] and not os.path.exists("s3:")
    shutil.rmtree(workdir)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_kept_tensor_does_not_pin_the_rest_of_the_checkpoint(workdir: str, backend: str) -> None:
    path = os.path.join(workdir, "pin")
    n = (64 << 20) // 4
    fp.save({"a": torch.ones(n), "b": torch.full((n,), 2.0), "tied": {"x": torch.zeros(n)}}, path)
    state = fp.load(path, config=fp.Config(backend=backend))
    # Each large tensor's storage is its own pages, not the whole stream.
    assert state["a"].untyped_storage().nbytes() < (64 << 20) + 8192
    before = _rss_bytes()
    keep = state["a"]
    del state
    gc.collect()
    freed = before - _rss_bytes()
    assert freed > 100 << 20, f"only {freed} bytes returned after dropping 128 MiB of tensors"
    assert keep.sum().item() == n


def _vm_flags_at(address: int) -> list[str] | None:
    """The VmFlags of the mapping holding `address`, from /proc/self/smaps (None if not found)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return None


def _thp_enabled() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not _thp_enabled(), reason="transparent huge pages are off here")
def test_a_large_load_is_read_into_memory_advised_for_huge_pages(workdir: str) -> None:
    # Its first touch (part of every cold load) then takes one fault per 2 MiB, not per 4 KiB.
    path = os.path.join(workdir, "huge")
    fp.save({"w": torch.arange(float((8 << 20) // 4)), "small": torch.ones(3)}, path)
    state = fp.load(path)
    flags = _vm_flags_at(state["w"].data_ptr())
    assert flags is not None and "hg" in flags, flags
    assert torch.equal(state["w"], torch.arange(float((8 << 20) // 4)))


def test_shared_storage_stays_shared_after_load(workdir: str) -> None:
    path = os.path.join(workdir, "shared")
    base = torch.arange(float((2 << 20) // 4))
    fp.save({"w": base, "view": base[10:20]}, path)
    state = fp.load(path)
    state["w"][10] = -1.0
    assert state["view"][0].item() == -1.0


def test_a_checksum_error_names_a_strided_tensor_by_its_whole_span(workdir: str) -> None:
    base = torch.zeros(4096)
    state = {"strided": base.as_strided((4,), (1024,)), "head": base[:1]}  # share one 16 KiB blob
    path = os.path.join(workdir, "strided")
    fp.save(state, path, config=fp.Config(chunk_bytes=4096))
    data = next(n for n in os.listdir(path) if n.endswith(".bin"))
    with open(os.path.join(path, data), "r+b") as f:
        f.seek(9000)  # the third chunk: inside state.strided's span, past its first 16 bytes
        f.write(b"\xff")
    with pytest.raises(fp.ChecksumMismatchError) as caught:
        fp.load(path)
    assert caught.value.tensors == ["state.strided"]


def test_a_save_reports_where_its_time_went(workdir: str, config: fp.Config) -> None:
    res = fp.save({"w": torch.randn(1 << 18), "step": 3}, os.path.join(workdir, "phases"), config=config)
    assert set(res.phases) == {"flatten_plan", "staging", "write_fsync", "commit"}
    assert all(v >= 0 for v in res.phases.values()), res.phases
    assert res.phases["staging"] <= res.phases["write_fsync"] + 1e-3  # staging ends before the last write
    assert res.phases["flatten_plan"] + res.phases["write_fsync"] + res.phases["commit"] <= res.seconds + 0.05


def test_a_load_reports_where_its_time_went(workdir: str, config: fp.Config) -> None:
    path = os.path.join(workdir, "load-phases")
    state = {"w": torch.randn(3 << 20), "small": torch.ones(3), "step": 3}  # 12 MiB: over one 8 MiB chunk
    fp.save(state, path, config=config)
    phases: dict[str, float] = {}
    started = time.perf_counter()
    got = fp.load(path, config=config, phases=phases)
    wall = time.perf_counter() - started
    assert torch.equal(got["w"], state["w"]) and got["step"] == 3
    timed = ("manifest", "read", "build", "place", "unflatten")
    assert set(phases) == {*timed, "crc32c", "read_minor_faults", "read_sys_cpu_s"}, phases
    assert all(v >= 0 for v in phases.values()), phases
    assert sum(phases[k] for k in timed) <= wall + 1e-3, (phases, wall)
    assert 0 < phases["crc32c"] <= phases["read"], phases  # checked on the driver thread, inside the read
    # The destination is fresh memory: its pages are first touched by the read itself, at least
    # one fault per 2 MiB huge page (one per 4 KiB page where huge pages are off or short).
    assert phases["read_minor_faults"] >= (12 << 20) // (2 << 20), phases

    unverified: dict[str, float] = {}
    fp.load(path, config=config, verify=False, phases=unverified)
    assert unverified["crc32c"] == 0, unverified

    filled: dict[str, float] = {}
    fp.load(path, config=config, out={"w": torch.empty(3 << 20)}, phases=filled)
    assert set(filled) == {"manifest", "fill"}, filled
