"""Config(guard=...): what the version-counter guard misses, and the "copy" guard that misses nothing."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

import fastpersist as fp

from dist_workers import run
from gloo import run_ranks

#: 8 tensors of 2 MiB through a 256 KiB pool: staging lasts as long as the write.
COUNT, ELEMS = 8, (2 << 20) // 4


def _bounded(backend: str, guard: str) -> fp.Config:
    return fp.Config(backend=backend, chunk_bytes=64 << 10, pool_bytes=256 << 10, queue_depth=2, guard=guard)  # type: ignore[arg-type]


def _state(seed: int, elems: int = ELEMS) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.nn.Parameter(torch.randn(elems, generator=gen)) for i in range(COUNT)}


def _through_data(t: torch.Tensor) -> None:
    t.data.add_(1)  # no version bump: the .data alias has a counter of its own


def _through_numpy(t: torch.Tensor) -> None:
    t.detach().numpy()[:] += 1  # no version bump: numpy writes the memory directly


WRITES: dict[str, Callable[[torch.Tensor], None]] = {"data": _through_data, "numpy": _through_numpy}


def _write_last_first(state: dict[str, torch.Tensor], write: Callable[[torch.Tensor], None]) -> None:
    """What an optimizer.step() without wait_staged() does, the last-staged tensor first."""
    for t in reversed(list(state.values())):
        write(t)


def _assert_equal(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), f"{key} holds bytes written after the call"


@pytest.mark.parametrize("how", sorted(WRITES))
def test_copy_guard_keeps_invisible_writes_out_of_save_async(workdir: str, backend: str, how: str) -> None:
    path = os.path.join(workdir, "ckpt")
    state = _state(1)
    expected = {k: v.detach().clone() for k, v in state.items()}
    fut = fp.save_async(state, path, config=_bounded(backend, "copy"))
    _write_last_first(state, WRITES[how])
    fut.wait_staged()
    fut.wait()
    _assert_equal(fp.load(path), expected)
    assert not torch.equal(state["p0"].detach(), expected["p0"])  # the writes did happen


@pytest.mark.parametrize("how", sorted(WRITES))
def test_copy_guard_keeps_invisible_writes_out_of_checkpointer_saves(workdir: str, backend: str, how: str) -> None:
    ck = fp.Checkpointer(os.path.join(workdir, "run"), keep=2, config=_bounded(backend, "copy"))
    state = _state(2)
    for step in range(2):
        expected = {k: v.detach().clone() for k, v in state.items()}
        ck.save(step, state)
        _write_last_first(state, WRITES[how])
        ck.wait()
        _assert_equal(ck.load(step), expected)


def test_copy_guard_keeps_invisible_writes_out_of_a_group_save(workdir: str, backend: str) -> None:
    results = run_ranks(run, 2, ("copy_guard", workdir, backend), workdir, 120)
    assert results == [{"same": True, "changed": True}] * 2, results


def test_version_guard_cannot_see_data_writes_and_commits_a_torn_save(workdir: str, backend: str) -> None:
    """The limit of the default guard, shown: `.data` writes during staging commit a mixed state.

    The last tensor is written first, while the disk is still taking the first ones: its new
    bytes are staged; the first tensor's start was staged before the write reached it.
    """
    torn = []
    for trial in range(3):
        path = os.path.join(workdir, f"ckpt-{trial}")
        state = _state(3 + trial, elems=ELEMS * 4)
        before = {k: v.detach().clone() for k, v in state.items()}
        fut = fp.save_async(state, path, config=_bounded(backend, "version"))
        _write_last_first(state, _through_data)
        fut.wait()  # never SaveCancelledError: the version counters did not move
        loaded = fp.load(path)
        last, first = f"p{COUNT - 1}", "p0"
        torn.append(
            torch.equal(loaded[last], before[last] + 1) and torch.equal(loaded[first][:1024], before[first][:1024])
        )
    assert any(torn), "expected at least one committed save mixing pre- and post-call bytes"


def test_guard_must_be_a_known_mode() -> None:
    with pytest.raises(ValueError, match=r"Config\.guard='yes': expected version \| copy"):
        fp.Config(guard="yes")  # type: ignore[arg-type]
