"""Ctrl-C: a KeyboardInterrupt during a blocking save or during wait() propagates promptly and
never leaves a partial checkpoint committed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import fastpersist as fp

_CHILD = textwrap.dedent(
    """
    import os, sys, time, torch, fastpersist as fp
    path, mode = sys.argv[1], sys.argv[2]
    # A bounded pool and small chunks: the save lasts long enough to be interrupted.
    cfg = fp.Config(chunk_bytes=64 << 10, pool_bytes=128 << 10, queue_depth=1, direct_io="off")
    state = {"w": torch.arange(float((768 << 20) // 4))}
    print("ready", flush=True)
    try:
        if mode == "blocking":
            fp.save(state, path, config=cfg)
        else:
            fut = fp.save_async(state, path, config=cfg)
            fut.wait()
    except KeyboardInterrupt:
        print("interrupted", time.monotonic(), flush=True)
        sys.exit(130)
    print("finished", flush=True)
    """
)


def _interrupt(workdir: str, mode: str) -> tuple[int, str, float]:
    path = os.path.join(workdir, "ckpt")
    child = subprocess.Popen([sys.executable, "-c", _CHILD, path, mode], stdout=subprocess.PIPE, text=True, cwd=workdir)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    time.sleep(0.1)
    sent = time.monotonic()
    child.send_signal(signal.SIGINT)
    out, _ = child.communicate(timeout=120)
    lines = out.split()
    latency = float(lines[lines.index("interrupted") + 1]) - sent if "interrupted" in lines else float("inf")
    return child.returncode, out, latency


def test_ctrl_c_during_a_blocking_save_stops_it_and_commits_nothing(workdir: str) -> None:
    code, out, latency = _interrupt(workdir, "blocking")
    if "finished" in out:
        pytest.skip("the save finished before the signal arrived (disk too fast to interrupt it)")
    assert code == 130 and latency < 2.0, (code, out, latency)
    assert not os.path.exists(os.path.join(workdir, "ckpt"))
    assert not [n for n in os.listdir(workdir) if ".fptmp-" in n]


def test_ctrl_c_during_wait_returns_promptly_and_the_save_commits_whole(workdir: str) -> None:
    code, out, latency = _interrupt(workdir, "async")
    if "finished" in out:
        pytest.skip("the save finished before the signal arrived (disk too fast to interrupt it)")
    assert code == 130 and latency < 2.0, (code, out, latency)
    # The interpreter waited for the commit thread at exit: the checkpoint is whole.
    path = os.path.join(workdir, "ckpt")
    fp.verify(path)
    last = torch.tensor(float((768 << 20) // 4 - 1), dtype=torch.float32)
    assert torch.equal(fp.load(path)["w"][-1], last)
