"""The child side of the kill -9 campaign (tests/saving/test_crash.py), started through a forkserver.

The child saves a state that changes every step, forever, until the test kills it. It marks
the phase it is in (one byte in a shared file) at the Python-visible boundaries of a save, so
the test can aim its SIGKILLs and report where they landed. The hooks only wrap functions;
they change no behaviour.
"""

from __future__ import annotations

import functools
import mmap
import os
from collections.abc import Callable
from typing import Any

import torch

import fastpersist as fp
from fastpersist import _core, checkpointer
from fastpersist.saving import job as saving

#: Phase codes written into the marker byte.
PHASES = ["starting", "idle", "staging", "writing+fsync", "manifest", "rename", "index+retention"]
STARTING, IDLE, STAGING, WRITING, MANIFEST, RENAME, RETENTION = range(len(PHASES))


def expected_state(step: int) -> dict[str, object]:
    """What step `step` saves: every tensor and value depends on the step."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(96 << 10, generator=g), "b": torch.full((1000,), float(step))},
        "opt": {"step": step, "lr": 1e-3 / (1 + step)},
        "rng": g.get_state(),
    }


def incremental_state(step: int) -> dict[str, object]:
    """What step `step` of the incremental worker saves: expected_state's, plus 2 MiB that never change."""
    return {**expected_state(step), "frozen": torch.arange(512 << 10, dtype=torch.float32)}


def config(stripes: list[str] | None = None) -> fp.Config:
    return fp.Config(chunk_bytes=64 << 10, pool_bytes=1 << 20, queue_depth=4, stripes=stripes)


def _marker(path: str) -> Callable[..., None]:
    f = open(path, "r+b")
    mm = mmap.mmap(f.fileno(), 1)

    def mark(phase: int, only_from: int | None = None) -> None:
        if only_from is None or mm[0] == only_from:
            mm[0] = phase

    return mark


def _wrap(owner: Any, name: str, before: Callable[[], None], after: Callable[[], None] | None = None) -> None:
    original = getattr(owner, name, None)
    if original is None:
        return  # renamed since: the phase is simply not reported

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before()
        try:
            return original(*args, **kwargs)
        finally:
            if after is not None:
                after()

    setattr(owner, name, wrapper)


def run_checkpointer(root: str, marker: str, incremental: bool = False) -> None:
    """Resume from the newest good step and save every step until killed (`incremental`: each step
    with fp.Incremental, 64 KiB blocks, the frozen part linked from the step before)."""
    mark = _marker(marker)
    _wrap(saving.SaveJob, "start", lambda: mark(STAGING))
    _wrap(saving, "write_manifest", lambda: mark(MANIFEST))
    _wrap(_core, "replace_atomically", lambda: mark(RENAME))
    _wrap(checkpointer.Checkpointer, "_after_commit", lambda: mark(RETENTION), lambda: mark(IDLE))
    increment = fp.Incremental(block_bytes=64 << 10) if incremental else None
    ck = fp.Checkpointer(root, keep=2, config=config(), incremental=increment)
    state_of = incremental_state if incremental else expected_state
    latest = ck.latest()
    step = 0 if latest is None else latest + 1
    mark(IDLE)
    while True:
        ck.save(step, state_of(step))
        ck.wait_staged()
        mark(WRITING, only_from=STAGING)
        step += 1


def run_device_checkpointer(root: str, marker: str) -> None:
    """run_checkpointer with the state's weights on a fake device: staged through the arena."""
    from fastpersist.gpu.copiers import use_copier

    from fake_cuda import LaterCopier

    with use_copier(lambda t: t.numel() == 96 << 10, LaterCopier):
        run_checkpointer(root, marker)


def run_plain_saves(path: str, stripes: list[str], marker: str) -> None:
    """``fp.save`` to one path over and over (each replaces the last) until killed."""
    mark = _marker(marker)
    step = 1000
    mark(IDLE)
    while True:
        fp.save(expected_state(step), path, config=config(stripes))
        step += 1
        os.sched_yield()


def serve() -> None:
    """A minimal fork server on stdin/stdout: children start in milliseconds, torch already imported.

    ``run_checkpointer ROOT MARKER`` / ``run_incremental_checkpointer ROOT MARKER`` /
    ``run_device_checkpointer ROOT MARKER`` /
    ``run_plain_saves PATH MARKER STRIPE...`` forks a child
    running that function and answers its pid; ``wait PID`` reaps it and answers its status.
    """
    import sys

    for line in sys.stdin:
        command, *args = line.split()
        if command == "wait":
            _, status = os.waitpid(int(args[0]), 0)
            print(status, flush=True)
            continue
        pid = os.fork()
        if pid == 0:
            try:
                if command == "run_checkpointer":
                    run_checkpointer(args[0], args[1])
                elif command == "run_incremental_checkpointer":
                    run_checkpointer(args[0], args[1], incremental=True)
                elif command == "run_device_checkpointer":
                    run_device_checkpointer(args[0], args[1])
                else:
                    run_plain_saves(args[0], args[2:], args[1])
            finally:
                os._exit(1)
        print(pid, flush=True)


if __name__ == "__main__":
    serve()
