"""The commit thread a save starts (SaveFuture) does its Python work once the job is staged:
started inside the save call, work done at once would hold the GIL while the call waits for
the thread to start."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import fastpersist as fp
from fastpersist.gpu.copiers import use_copier
from fastpersist.saving import job as saving_job

from fake_cuda import LaterCopier


class GatedCopier(LaterCopier):
    """Copies land only once `gate` is set."""

    gate = threading.Event()

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, early: bool = False) -> None:
        if early:
            super().copy(pairs, early=True)
            return

        def land() -> None:
            GatedCopier.gate.wait(30)
            for src, dst in pairs:
                dst.copy_(src)

        self.threads.append(threading.Thread(target=land))
        self.threads[-1].start()


@pytest.mark.parametrize("on_device", [True, False])
def test_the_manifest_is_built_once_staged(workdir: str, monkeypatch: pytest.MonkeyPatch, on_device: bool) -> None:
    weight = torch.randn(500_000)
    built_when_staged: list[bool] = []
    build = saving_job.SaveJob.manifest_stream.func

    def recording(job: saving_job.SaveJob) -> Any:
        assert job.handle is not None
        built_when_staged.append(job.handle.staged())
        return build(job)

    monkeypatch.setattr(saving_job.SaveJob, "manifest_stream", property(recording))
    GatedCopier.gate = threading.Event()
    with use_copier(lambda t: on_device and t.data_ptr() == weight.data_ptr(), GatedCopier):
        fut = fp.save_async({"w": weight}, os.path.join(workdir, "ckpt"))
        if on_device:
            time.sleep(0.2)  # the copies have not landed: not staged, so no manifest yet
            assert built_when_staged == []
        GatedCopier.gate.set()
        fut.wait()
    assert built_when_staged and all(built_when_staged), built_when_staged
    assert torch.equal(fp.load(fut.path)["w"], weight)


@pytest.mark.parametrize("how", ["wait", "exception", "torch_save_async"])
def test_no_commit_thread_outlives_a_wait_that_returned(tmp_path: Any, how: str) -> None:
    """A caller that waited for a save sees no thread of it left, even while a done callback
    (a host's bookkeeping) still runs on the commit thread: a host's test harness counts
    leftover threads (Lightning's does)."""
    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    callback_ran = threading.Event()

    def slow_callback(_: object) -> None:
        time.sleep(0.2)
        callback_ran.set()

    if how == "torch_save_async":
        fut = fp.torch_save_async(state, os.path.join(tmp_path, "state.pt"))
    else:
        fut = fp.save_async(state, os.path.join(tmp_path, "ck"))
    fut.add_done_callback(slow_callback)
    if how == "exception":
        assert fut.exception() is None
    else:
        fut.wait()
    commit_threads = [t for t in threading.enumerate() if t.name == "fastpersist-commit"]
    assert commit_threads == [] and callback_ran.is_set()
