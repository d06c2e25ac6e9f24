"""The overlap contract: a save fails only if a tensor changed before its bytes were staged, and
once it failed for anyone it never commits, whatever order of calls follows."""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import os
import threading
import time
from typing import Any

import pytest
import torch

import fastpersist as fp

#: Big enough that a bounded pool keeps staging busy while the test mutates.
BIG = (16 << 20) // 4


def _bounded(backend: str) -> fp.Config:
    return fp.Config(backend=backend, chunk_bytes=64 << 10, pool_bytes=256 << 10, queue_depth=2)


def _leftovers(parent: str) -> list[str]:
    return [n for n in os.listdir(parent) if ".fptmp-" in n or n.endswith(".fpstripe")]


def _torn_save(workdir: str, backend: str) -> tuple[fp.SaveFuture, str, dict[str, torch.Tensor]]:
    """Saves a state, then modifies every tensor at once (an ``optimizer.step()`` too early)."""
    path = os.path.join(workdir, "ckpt")
    state = {"a": torch.zeros(BIG), "b": torch.zeros(BIG)}
    fut = fp.save_async(state, path, config=_bounded(backend))
    for t in state.values():
        # A one-element change: in-place all the same, and over before staging can finish (a
        # long kernel could still be running, GIL released, as its tensor's check passes).
        t[:1].add_(1)
    return fut, path, state


def test_wait_staged_then_wait_raise_the_same_error_and_nothing_commits(workdir: str, backend: str) -> None:
    fut, path, _ = _torn_save(workdir, backend)
    with pytest.raises(fp.SaveCancelledError, match="wait_staged") as staged:
        fut.wait_staged()
    with pytest.raises(fp.SaveCancelledError) as waited:
        fut.wait()
    assert waited.value is staged.value
    assert fut.exception() is staged.value
    assert not os.path.exists(path)
    assert _leftovers(workdir) == []


def test_wait_alone_raises_and_nothing_commits(workdir: str, backend: str) -> None:
    fut, path, _ = _torn_save(workdir, backend)
    with pytest.raises(fp.SaveCancelledError, match=r"state\.[ab]"):
        fut.wait()
    assert not os.path.exists(path)
    assert _leftovers(workdir) == []


def test_unwatched_commit_thread_never_commits_a_torn_save(workdir: str, backend: str) -> None:
    fut, path, _ = _torn_save(workdir, backend)
    concurrent.futures.wait([fut], timeout=60)
    assert fut.done() and isinstance(fut.exception(), fp.SaveCancelledError)
    assert not os.path.exists(path)
    assert _leftovers(workdir) == []


def test_a_torn_save_leaves_the_previous_checkpoint_untouched(workdir: str, backend: str) -> None:
    path = os.path.join(workdir, "ckpt")
    fp.save({"a": torch.full((BIG,), 7.0), "b": torch.zeros(BIG)}, path)
    state = {"a": torch.zeros(BIG), "b": torch.zeros(BIG)}
    fut = fp.save_async(state, path, config=_bounded(backend))
    state["b"][:1].add_(1)
    with pytest.raises(fp.SaveCancelledError):
        fut.wait_staged()
    with pytest.raises(fp.SaveCancelledError):
        fut.wait()
    assert fp.load(path)["a"][0].item() == 7.0
    fp.verify(path)
    assert _leftovers(workdir) == []


def test_cancel_stops_a_save_and_the_future_says_so(workdir: str, backend: str) -> None:
    path = os.path.join(workdir, "ckpt")
    fut = fp.save_async({"a": torch.zeros(BIG), "b": torch.zeros(BIG)}, path, config=_bounded(backend))
    assert fut.running()
    assert fut.cancel()
    done, _ = concurrent.futures.wait([fut], timeout=60)
    assert fut in done and fut.cancelled() and not fut.running()
    with pytest.raises(fp.SaveCancelledError):
        fut.result()
    with pytest.raises(concurrent.futures.CancelledError):  # SaveCancelledError is one
        fut.wait()
    assert not fut.cancel()  # already decided
    assert not os.path.exists(path) and _leftovers(workdir) == []


def test_cancel_after_commit_changes_nothing(workdir: str) -> None:
    path = os.path.join(workdir, "ckpt")
    fut = fp.save_async({"a": torch.ones(10)}, path)
    fut.wait()
    assert not fut.cancel() and not fut.cancelled()
    assert fp.load(path)["a"].sum().item() == 10


def test_change_after_a_tensor_was_staged_does_not_fail_the_save(workdir: str, backend: str) -> None:
    """`a` is staged first; it is changed while `b` is still being staged: allowed."""
    path = os.path.join(workdir, "ckpt")
    a, b = torch.zeros(BIG), torch.zeros(8 * BIG)
    fut = fp.save_async({"a": a, "b": b}, path, config=_bounded(backend))
    handle = fut._job.handle  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while handle.bytes_staged < a.nbytes + (64 << 10) and time.monotonic() < deadline:
        time.sleep(0.0002)
    staging_ongoing = not handle.staged()
    a.add_(1)
    fut.wait()
    loaded = fp.load(path)
    assert loaded["a"].sum().item() == 0 and loaded["b"].sum().item() == 0
    if not staging_ongoing:
        pytest.skip("staging finished before the test could change `a` mid-save (disk too fast)")


def test_small_buffers_changed_by_the_next_forward_keep_their_saved_values(workdir: str, backend: str) -> None:
    """BatchNorm statistics are updated in place by every forward: they are copied at call time."""
    path = os.path.join(workdir, "ckpt")
    bn = torch.nn.BatchNorm1d(8)
    big = torch.zeros(8 * BIG)
    state = {"big": big, "bn": bn.state_dict()}
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    fut = fp.save_async(state, path, config=_bounded(backend))
    bn(torch.randn(4, 8))  # forward: running_mean, running_var, num_batches_tracked change
    fut.wait_staged()
    fut.wait()
    loaded = fp.load(path)["bn"]
    for key, value in before.items():
        assert torch.equal(loaded[key], value), key


@pytest.mark.parametrize("overlapping", [False, True], ids=["one-after-another", "two-in-flight"])
def test_consecutive_saves_reusing_the_pools_early_copy_block_keep_each_calls_values(
    workdir: str, backend: str, overlapping: bool
) -> None:
    """The pool keeps the early copies' block between saves: each save still holds the small
    tensors as they were at its own call, whether the previous save is done (its block reused)
    or still staging (the next one gets memory of its own). Tied weights still share storage."""
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 16))
    model[2].weight = model[0].weight  # tied, as a language model's input and output embeddings
    big = torch.zeros(8 * BIG)
    config = _bounded(backend)
    expected: list[dict[str, torch.Tensor]] = []
    futures: list[fp.SaveFuture] = []
    for step in range(3):
        state = {"big": big, "model": model.state_dict()}
        expected.append({k: v.clone() for k, v in model.state_dict().items()})
        futures.append(fp.save_async(state, os.path.join(workdir, f"step{step}"), config=config))
        model[1](torch.randn(4, 8))  # forward: BatchNorm's statistics change in place
        if not overlapping:
            futures[-1].wait()
    for future in futures:
        future.wait()
    for step, values in enumerate(expected):
        loaded = fp.load(os.path.join(workdir, f"step{step}"))["model"]
        for key, value in values.items():
            assert torch.equal(loaded[key], value), (step, key)
        tied = (loaded["0.weight"], loaded["2.weight"])
        assert tied[0].untyped_storage().data_ptr() == tied[1].untyped_storage().data_ptr(), step


def test_snapshot_mode_mutation_after_wait_staged_keeps_pre_step_values(workdir: str, backend: str) -> None:
    path = os.path.join(workdir, "ckpt")
    w = torch.zeros(BIG)
    fut = fp.save_async({"w": w}, path, config=fp.Config(backend=backend, pool_bytes=64 << 20))
    fut.wait_staged()
    w.add_(1)
    fut.wait()
    assert fp.load(path)["w"].sum().item() == 0


def test_futures_protocol(workdir: str) -> None:
    futs = [fp.save_async({"x": torch.full((1000,), float(i))}, os.path.join(workdir, f"c{i}")) for i in range(3)]
    results = [f.result() for f in concurrent.futures.as_completed(futs, timeout=60)]
    assert sorted(r.path for r in results) == sorted(f.path for f in futs)
    done, pending = concurrent.futures.wait(futs, timeout=60)
    assert len(done) == 3 and not pending
    called: list[fp.SaveFuture] = []
    futs[0].add_done_callback(called.append)
    assert called == [futs[0]]
    assert all(isinstance(f, concurrent.futures.Future) for f in futs)


def test_a_failure_nobody_observes_is_logged(workdir: str, caplog: pytest.LogCaptureFixture) -> None:
    fut, _path, _ = _torn_save(workdir, "threads")
    concurrent.futures.wait([fut], timeout=60)
    with caplog.at_level(logging.ERROR, logger="fastpersist"):
        del fut
        gc.collect()
    assert any("nobody waited" in r.getMessage() and "ckpt" in r.getMessage() for r in caplog.records)


def test_checkpointer_raises_an_unseen_failure_at_the_next_save(workdir: str, backend: str) -> None:
    ck = fp.Checkpointer(workdir, config=_bounded(backend))
    state = {"a": torch.zeros(BIG), "b": torch.zeros(BIG)}
    ck.save(0, state)
    ck.wait()
    ck.save(1, state)
    state["b"][:1].add_(1)
    with pytest.raises(fp.SaveCancelledError):
        ck.save(2, state)  # the failure of step 1 was never seen: raised here, step 2 not started
    assert ck.steps() == [0]
    assert ck.save(2, state) is not None  # raised once; the Checkpointer goes on
    ck.wait()
    assert ck.steps() == [0, 2]


def test_checkpointer_does_not_raise_twice_what_wait_staged_raised(workdir: str, backend: str) -> None:
    ck = fp.Checkpointer(workdir, config=_bounded(backend))
    state = {"a": torch.zeros(BIG), "b": torch.zeros(BIG)}
    ck.save(1, state)
    state["b"][:1].add_(1)
    with pytest.raises(fp.SaveCancelledError):
        ck.wait_staged()
    ck.save(2, state)  # already reported: not raised again
    ck.wait()
    assert ck.steps() == [2] and ck.latest() == 2


def test_the_manifest_records_are_built_on_the_saves_thread_not_at_the_call(
    workdir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On 200,000 small tensors they cost a third of a second, and nothing at the call needs them."""
    from fastpersist.saving import job

    threads: list[str] = []
    real = job.records_to_json

    def on_which_thread(records: list[object]) -> object:
        threads.append(threading.current_thread().name)
        return real(records)  # type: ignore[arg-type]

    monkeypatch.setattr(job, "records_to_json", on_which_thread)
    fut = fp.save_async({f"t{i}": torch.zeros(4) for i in range(100)}, os.path.join(workdir, "ckpt"))
    fut.wait()
    # Built once, by the commit thread: not by the caller's thread (which the call runs on),
    # whether or not the commit thread got there before save_async returned.
    assert threads == ["fastpersist-commit"]
    assert len(fp.load(os.path.join(workdir, "ckpt"))) == 100


def test_only_a_save_that_returns_early_copies_the_small_tensors_first(
    workdir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save_async copies small watched tensors before it returns (the next forward pass may update
    them in place); fp.save returns only when done, so the copy would be memory and time for nothing."""
    from fastpersist import _core

    budgets: list[int] = []
    real = _core.start_write

    def spy(request: Any) -> object:
        budgets.append(len(request.hooks.guard.copy_early))
        return real(request)

    monkeypatch.setattr(_core, "start_write", spy)
    state = {"small": torch.ones(16), "big": torch.ones(BIG)}
    fp.save(state, os.path.join(workdir, "blocking"))
    fp.save_async(state, os.path.join(workdir, "async")).wait()
    assert budgets[0] == 0 and budgets[1] > 0, budgets
    assert torch.equal(fp.load(os.path.join(workdir, "blocking"))["small"], state["small"])
