"""Checkpointer: overlap, retention, resume, leftovers, the mutation guard, resource bounds."""

from __future__ import annotations

import inspect
import json
import os
import random
import threading
from typing import Any

import pytest
import torch

import fastpersist as fp
from fastpersist.integrations import guard_optimizer

from training import make_run, restore, seed_all, train_step, training_state


def test_resume_from_latest_is_bit_exact(workdir: str, backend: str) -> None:
    total, stop = 8, random.Random(7).randint(2, 6)
    seed_all(0)
    model, opt, sched = make_run(0)
    expected = [train_step(model, opt, sched) for _ in range(total)]

    seed_all(0)
    model, opt, sched = make_run(0)
    ck = fp.Checkpointer(workdir, keep=2, config=fp.Config(backend=backend))
    ck.guard(opt)  # every optimizer.step() first waits for the previous save's staging
    for step in range(stop):
        train_step(model, opt, sched)
        ck.save(step, training_state(model, opt, sched, step))
    ck.wait()
    assert ck.steps() == [stop - 2, stop - 1]

    seed_all(99)
    ck2 = fp.Checkpointer(workdir, keep=2)
    assert ck2.latest() == stop - 1
    model2, opt2, sched2, step = restore(ck2.load())
    assert step == stop - 1
    got = [train_step(model2, opt2, sched2) for _ in range(total - stop)]
    assert got == expected[stop:]
    index = json.load(open(os.path.join(workdir, "latest.json")))
    assert index["step"] == stop - 1 and index["path"] == f"step-{stop - 1:08d}"


def test_every_and_keep(workdir: str) -> None:
    ck = fp.Checkpointer(workdir, every=3, keep=1)
    futures = [ck.save(step, {"step": step, "w": torch.full((10,), step)}) for step in range(10)]
    assert [f is not None for f in futures] == [s % 3 == 0 for s in range(10)]
    ck.wait()
    assert ck.steps() == [9]
    assert ck.load()["step"] == 9
    with pytest.raises(ValueError):
        fp.Checkpointer(workdir, keep=0)


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: fp.Remote(""), "Remote(place=''): expected a directory on a shared filesystem"),
        (lambda: fp.Remote(5), "Remote(place=5): expected a directory"),  # type: ignore[arg-type]
        (lambda: fp.Remote("/r", every=0), "Remote(every=0): expected an integer >= 1 or None"),
        (lambda: fp.Remote("/r", keep=0), "Remote(keep=0): expected an integer >= 1"),
        (lambda: fp.Remote("/r", bytes_per_s=0), "Remote(bytes_per_s=0): expected a positive number"),
        # bool is an int to isinstance: True would throttle the drain to 1 byte/s (close() never returns).
        (lambda: fp.Remote("/r", bytes_per_s=True), "Remote(bytes_per_s=True): expected a positive number"),
        (lambda: fp.Remote("/r", bytes_per_s=float("inf")), "Remote(bytes_per_s=inf): expected a positive number"),
        (lambda: fp.HFExport("/e", every=1, key=5), "HFExport(key=5): expected None or a str"),  # type: ignore[arg-type]
        (lambda: fp.HFExport("/e", every=1, prefix=None), "HFExport(prefix=None): expected a str"),  # type: ignore[arg-type]
        (lambda: fp.HFExport("", every=1), "HFExport(export_dir=''): expected a directory"),
        (lambda: fp.HFExport("/e", every=0), "HFExport(every=0): expected an integer >= 1"),
        (lambda: fp.Partner(replicas=0), "Partner(replicas=0): expected an integer >= 1"),
        (lambda: fp.Partner(replicas=True), "Partner(replicas=True): expected an integer >= 1"),
    ],
)
def test_bad_level_settings_are_refused_naming_them(make: Any, named: str) -> None:
    with pytest.raises((TypeError, ValueError)) as info:
        make()
    assert named in str(info.value)


@pytest.mark.parametrize("where", ["the root", "inside the root"])
def test_an_hf_export_into_the_root_is_refused_when_the_checkpointer_is_made(workdir: str, where: str) -> None:
    root = os.path.join(workdir, "root")
    export_dir = root if where == "the root" else os.path.join(root, "hf")
    with pytest.raises(
        ValueError, match=r"HFExport\(export_dir=.*\): it is the Checkpointer's root .* or lies inside it"
    ):
        fp.Checkpointer(root, levels=[fp.HFExport(export_dir, every=1)])
    assert not os.path.exists(os.path.join(root, "model.safetensors"))


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"config": "x"}, "config='x': expected a fastpersist.Config"),
        ({"levels": "s3://b/p"}, "levels='s3://b/p': expected a list of level objects"),
        ({"levels": [{"replicas": 1}]}, "expected fastpersist.Partner, fastpersist.Remote or fastpersist.HFExport"),
        ({"levels": [fp.Remote("/r1"), fp.Remote("/r2")]}, "more than one Remote level"),
        ({"levels": [fp.Partner()]}, "Partner(replicas=1): needs the Checkpointer's group="),
        ({"every": "auto"}, 'every="auto" needs failures='),
        ({"failures": {"process_mtbf_s": 1.0}}, "expected a fastpersist.Failures"),
    ],
)
def test_bad_constructor_arguments_are_refused_naming_them(workdir: str, kwargs: dict[str, Any], named: str) -> None:
    root = os.path.join(workdir, "root")
    with pytest.raises((TypeError, ValueError)) as info:
        fp.Checkpointer(root, **kwargs)
    assert named in str(info.value)
    assert os.listdir(workdir) == []  # refused before anything was made (no remote in the working directory)


@pytest.mark.parametrize(
    ("kwargs", "new_form"),
    [
        ({"replicas": 1}, "levels=[fastpersist.Partner(replicas=1)]"),
        (
            {"remote": "s3://b/p", "remote_every": 10, "remote_keep": 3, "remote_bytes_per_s": 1e6},
            "levels=[fastpersist.Remote('s3://b/p', every=10, keep=3, bytes_per_s=1000000.0)]",
        ),
        (
            {"export_hf_every": 5, "export_dir": "/e", "export_hf_key": "model", "export_hf_prefix": "m."},
            "levels=[fastpersist.HFExport('/e', every=5, key='model', prefix='m.')]",
        ),
        ({"mtbf_s": 3600.0}, "failures=fastpersist.Failures(process_mtbf_s=3600.0)"),
        (
            {"replicas": 2, "remote": "/r", "mtbf_s": 60},
            "levels=[fastpersist.Partner(replicas=2), fastpersist.Remote('/r')], "
            "failures=fastpersist.Failures(process_mtbf_s=60)",
        ),
    ],
)
def test_the_keywords_that_became_objects_are_refused_showing_the_new_form(
    workdir: str, kwargs: dict[str, Any], new_form: str
) -> None:
    with pytest.raises(TypeError) as info:
        fp.Checkpointer(os.path.join(workdir, "root"), **kwargs)
    assert f"write Checkpointer(..., {new_form})" in str(info.value)
    assert os.listdir(workdir) == []
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        fp.Checkpointer(os.path.join(workdir, "root"), bogus=1)


def test_the_checkpointer_takes_at_most_nine_keywords() -> None:
    """The issue-50 cap: a new level is a new object in `levels`, not another keyword family. The
    ninth is `incremental`, one noun (fp.Incremental) for how each step is written."""
    params = inspect.signature(fp.Checkpointer.__init__).parameters.values()
    keywords = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert len(keywords) <= 9, keywords


@pytest.mark.parametrize("root", ["", " "])
def test_an_empty_root_is_refused_not_taken_as_the_working_directory(
    workdir: str, monkeypatch: pytest.MonkeyPatch, root: str
) -> None:
    monkeypatch.chdir(workdir)
    with pytest.raises(ValueError, match=rf"Checkpointer\(root={root!r}\): expected a directory; an empty"):
        fp.Checkpointer(root)
    assert os.listdir(workdir) == []


@pytest.mark.parametrize("timeout", ["x", float("nan"), True, [1]])
def test_a_bad_timeout_is_refused_naming_the_method(workdir: str, timeout: object) -> None:
    ck = fp.Checkpointer(workdir)
    for method in ("wait", "wait_staged"):
        with pytest.raises(TypeError, match=rf"Checkpointer\.{method}\(timeout=.*\): expected None .* of seconds"):
            getattr(ck, method)(timeout=timeout)  # refused with no save in flight too
    ck.save(1, {"w": torch.ones(3)})
    with pytest.raises(TypeError, match=r"Checkpointer\.wait\(timeout="):
        ck.wait(timeout=timeout)
    assert ck.wait(timeout=float("inf")) is not None and ck.steps() == [1]


def test_bad_load_and_guard_arguments_are_refused_naming_them(workdir: str) -> None:
    ck = fp.Checkpointer(workdir)
    ck.save(1, {"w": torch.ones(3)})
    ck.wait()
    for step in ("x", -1, 1.0, True):
        with pytest.raises(TypeError, match=rf"step={step!r}: expected a step number"):
            ck.load(step=step)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expected a torch\.optim\.Optimizer.*not str"):
        ck.guard("not an optimizer")
    assert torch.equal(ck.load(step=1)["w"], torch.ones(3))


def test_latest_skips_a_corrupt_checkpoint(workdir: str) -> None:
    ck = fp.Checkpointer(workdir, keep=3)
    for step in range(3):
        ck.save(step, {"w": torch.full((50_000,), float(step))})
    ck.wait()
    assert ck.latest() == 2
    newest = fp.inspect(ck.path(2))["files"][0]["path"]
    with open(newest, "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff")
    assert ck.latest() == 1
    assert ck.load()["w"][0].item() == 1.0


def test_leftovers_of_a_crash_are_removed_and_only_those(workdir: str) -> None:
    ck = fp.Checkpointer(workdir)
    ck.save(1, {"a": torch.ones(3)})
    ck.wait()
    leftover = os.path.join(workdir, ".step-00000002.fptmp-0123456789ab")
    os.makedirs(leftover)
    open(os.path.join(leftover, "data-w0-s0.bin"), "wb").close()
    unrelated = os.path.join(workdir, "notes.txt")
    open(unrelated, "w").close()
    ck2 = fp.Checkpointer(workdir)
    assert ck2.latest() == 1 and ck2.load()["a"].sum() == 3
    assert os.path.exists(leftover), "a read-only use (construction, latest, load) removes nothing"
    ck2.save(2, {"a": torch.ones(3)})  # the first save cleans up first
    ck2.wait()
    assert ck2.removed_leftovers == [leftover]
    assert not os.path.exists(leftover) and os.path.exists(unrelated)
    assert ck2.latest() == 2


def test_mutation_before_staging_ends_fails_the_save(workdir: str, backend: str) -> None:
    # A bounded pool much smaller than the state: staging lasts until the disk drains.
    cfg = fp.Config(backend=backend, chunk_bytes=64 << 10, pool_bytes=128 << 10, queue_depth=1, durable=True)
    ck = fp.Checkpointer(workdir, keep=2, config=cfg)
    w = torch.zeros((8 << 20) // 4)  # 8 MiB: above the size copied at call time
    ck.save(1, {"w": w})
    ck.wait()
    fut = ck.save(2, {"w": w})
    assert fut is not None
    w[-1:].add_(1)  # "optimizer.step()" before wait_staged()
    with pytest.raises(fp.SaveCancelledError, match=r"state\.w.*wait_staged"):
        ck.wait()
    assert ck.steps() == [1]
    assert ck.latest() == 1 and ck.load()["w"].sum().item() == 0


def test_mutation_after_staging_keeps_pre_step_values(workdir: str) -> None:
    ck = fp.Checkpointer(workdir)
    model, opt, sched = make_run(0)
    train_step(model, opt, sched)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ck.save(0, {"model": model.state_dict()})
    ck.wait_staged()
    train_step(model, opt, sched)  # optimizer.step() after wait_staged: allowed
    ck.wait()
    loaded = ck.load()["model"]
    for k, v in before.items():
        assert torch.equal(loaded[k], v), k


def test_guard_optimizer_waits_before_step(workdir: str) -> None:
    cfg = fp.Config(chunk_bytes=64 << 10, pool_bytes=128 << 10, queue_depth=1)
    ck = fp.Checkpointer(workdir, config=cfg)
    model, opt, sched = make_run(0)
    handle = guard_optimizer(opt, ck)
    for step in range(3):
        train_step(model, opt, sched)  # its optimizer.step() waits for the staging of the previous save
        ck.save(step, {"model": model.state_dict(), "opt": opt.state_dict()})
    ck.wait()
    handle.remove()
    assert ck.latest() == 2


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_a_thousand_saves_leak_no_fds_or_threads(workdir: str) -> None:
    ck = fp.Checkpointer(workdir, keep=2, config=fp.Config(durable=False))
    ck.save(0, {"w": torch.ones(16)})
    ck.wait()
    fds, threads, py_threads = _open_fds(), _os_threads(), threading.active_count()
    for step in range(1, 1001):
        ck.save(step, {"w": torch.full((16,), step), "step": step})
    ck.close()  # the save, and the background removal of the retired steps
    assert ck.steps() == [999, 1000] and not [n for n in os.listdir(workdir) if ".fptmp-" in n]
    assert _open_fds() == fds
    assert threading.active_count() == py_threads
    assert _os_threads() <= threads + 1  # a torch/OpenMP worker may appear lazily


def test_staging_pools_are_reused_and_bounded(workdir: str) -> None:
    from fastpersist.saving import pools as saving

    ck = fp.Checkpointer(os.path.join(workdir, "ck"), keep=1)
    ck.save(0, {"w": torch.ones(1000)})
    ck.wait()
    pool = ck._pool
    assert pool is not None
    ck.save(1, {"w": torch.ones(1000)})
    ck.wait()
    assert ck._pool is pool, "a Checkpointer reuses its pool"
    for i, pool_bytes in enumerate([1 << 20, 2 << 20, 3 << 20]):
        fp.save({"w": torch.ones(10)}, os.path.join(workdir, f"s{i}"), config=fp.Config(pool_bytes=pool_bytes))
    assert len(saving.POOLS) <= saving.POOLS.keep, "pools for other sizes are let go"
    ck.save(2, {"w": torch.ones(1000)})
    ck.wait()
    assert ck._pool is pool and pool.allocated_bytes > 0


@pytest.mark.parametrize("config", [None, fp.Config()], ids=["sized-by-the-state", "given"])
def test_every_save_flattens_its_state_once(
    workdir: str, config: fp.Config | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a config the first save sizes the pool by the state: it flattens it for that and
    hands the result to the save, which does not flatten again."""
    from fastpersist.saving import share_layout

    calls: list[object] = []
    real = share_layout.flatten

    def counted(state: object, **kwargs: Any) -> Any:
        calls.append(state)
        return real(state, **kwargs)

    monkeypatch.setattr(share_layout, "flatten", counted)
    ck = fp.Checkpointer(os.path.join(workdir, "ck"), config=config)
    states = [{"w": torch.full((1000,), float(step)), "step": step} for step in range(3)]
    for step, state in enumerate(states):
        ck.save(step, state)
        ck.wait()
    assert [id(c) for c in calls] == [id(s) for s in states]
    assert ck.config is not None and (config is not None or ck.config.pool_bytes >= fp.Config().pool_bytes)
    assert ck.latest() == 2 and torch.equal(ck.load(2)["w"], states[2]["w"])
    ck.close()
