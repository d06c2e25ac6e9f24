"""kill -9 of a process saving through the Lightning plug-ins, then a later run in its directory.

A save killed before its rename leaves the previous checkpoints whole and loadable, nothing
half-written under a checkpoint's name, and leftovers (its temporary file, full size, and, for
a new name, its placeholder) that the next run removes: its resume (the load) frees the
placeholder's name before ModelCheckpoint picks one, and its first save cleans the directory.

Run as a script (``python test_lightning_kills.py fit ROOT HOLD`` or ``... save PATH KIND``),
this module is the child: it holds the HOLD-th save (from 1) once its data is in the temporary
file, before the rename, prints ``holding`` and waits to be killed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from fastpersist.integrations.lightning import (  # noqa: E402
    RESERVED,
    FastPersistAsyncCheckpointIO,
    FastPersistCheckpointIO,
)
from fastpersist.interop import torchfile  # noqa: E402
from fastpersist.interop.torchasync import ArchiveSaveJob  # noqa: E402

from gloo import REPO_DIR  # noqa: E402
from lightning_workers import loader, rotation, seeded_model, trainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

TMP_MARKER = ".fptmp-"  # fastpersist.format.layout's temporary names


def _hold_before_rename(hold: int) -> None:
    """The `hold`-th save from now (either plug-in) stops forever once its bytes are written."""
    calls = 0

    def hold_here(what: str) -> None:
        nonlocal calls
        calls += 1
        if calls == hold:
            print("holding", what, flush=True)
            time.sleep(600)

    finish = ArchiveSaveJob.finish

    def held_finish(job: ArchiveSaveJob, timeout: float | None = None) -> Any:
        assert job.handle is not None
        job.handle.wait()
        hold_here(job.path)
        return finish(job, timeout)

    ArchiveSaveJob.finish = held_finish  # type: ignore[method-assign]
    archive_start = torchfile.Archive.start

    def held_start(archive: torchfile.Archive, *args: Any, **kwargs: Any) -> Any:
        handle = archive_start(archive, *args, **kwargs)
        if not kwargs.get("background"):
            handle.wait()
            hold_here(kwargs["what"])
        return handle

    torchfile.Archive.start = held_start  # type: ignore[method-assign]


def _child(mode: str, where: str, arg: str) -> None:
    if mode == "fit":
        _hold_before_rename(int(arg))
        ckdir = os.path.join(where, "ck")
        trainer(where, 4, FastPersistAsyncCheckpointIO(), callbacks=[rotation(ckdir)]).fit(seeded_model(), loader())
    else:
        _hold_before_rename(1)
        io = FastPersistAsyncCheckpointIO() if arg == "async" else FastPersistCheckpointIO()
        io.save_checkpoint({"state_dict": {"w": torch.randn(4 << 20)}, "epoch": 0}, where)
        io.teardown()
    print("finished", flush=True)


def _run_and_kill(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(REPO_DIR, "tests", "helpers"), *sys.path])}
    child = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout is not None
    try:
        while not (line := child.stdout.readline()).startswith("holding"):
            assert line, "the child ended before it held its save"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL


def _visible(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if not n.startswith("."))


def _leftovers(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if TMP_MARKER in n)


def _step(path: str) -> int:
    return int(torch.load(path, weights_only=False)["global_step"])


AFTER = ["epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt", "last.ckpt"]


@pytest.mark.parametrize(
    ("held", "held_name", "left", "after"),
    [
        # Saves 1-4 are epochs 0 and 1 (top-k, then last.ckpt). Save 5, epoch 2's top-k, held:
        # epoch=0's removal waited for it, so it stays, and last.ckpt is epoch 1's; the new
        # name holds the placeholder, which the resume removes (epoch 2 keeps its name).
        (5, "epoch=2-step=12.ckpt", ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"], AFTER),
        # Save 6, last.ckpt replacing itself, held: epoch 2's top-k is durable (epoch=0 went
        # when it was), and last.ckpt is still epoch 1's whole checkpoint. The resume from it
        # saves epoch 2 again: as with TorchCheckpointIO, ModelCheckpoint finds epoch 2's file
        # there and names the new one -v1 (and never removes the file it did not save).
        (
            6,
            "last.ckpt",
            ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt", "last.ckpt"],
            [*AFTER, "epoch=2-step=12-v1.ckpt"],
        ),
    ],
    ids=["top-k-save-in-flight", "last-ckpt-in-flight"],
)
def test_a_kill_during_an_overlapped_save_leaves_the_previous_checkpoints_and_the_next_fit_cleans(
    tmp_path: Any, held: int, held_name: str, left: list[str], after: list[str]
) -> None:
    root, ckdir, last_step = str(tmp_path), str(tmp_path / "ck"), 8
    _run_and_kill("fit", root, str(held))

    placeholder = [held_name] if held_name not in left else []
    assert _visible(ckdir) == sorted(left + placeholder)
    for name in left:
        step = last_step if name == "last.ckpt" else int(re.search(r"step=(\d+)", name).group(1))  # type: ignore[union-attr]
        assert _step(os.path.join(ckdir, name)) == step
    for name in placeholder:
        with open(os.path.join(ckdir, name), "rb") as f:
            assert f.read() == RESERVED  # never a part of a checkpoint under its name
    (leftover,) = _leftovers(ckdir)
    assert leftover.startswith(f".{held_name}{TMP_MARKER}")

    reference = seeded_model()
    trainer(str(tmp_path / "ref"), 4, FastPersistAsyncCheckpointIO(), enable_checkpointing=False).fit(
        reference, loader()
    )
    resumed = seeded_model(seed=1)
    keep = rotation(ckdir)
    trainer(root, 4, FastPersistAsyncCheckpointIO(), callbacks=[keep]).fit(
        resumed, loader(), ckpt_path=os.path.join(ckdir, "last.ckpt")
    )
    assert resumed.losses == reference.losses[last_step:]
    for a, b in zip(reference.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    # The killed save's leftovers are gone, nothing is hidden.
    assert sorted(os.listdir(ckdir)) == sorted(after)


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_a_killed_save_of_a_new_path_leaves_nothing_after_the_next_fit_in_its_directory(
    tmp_path: Any, kind: str
) -> None:
    """issue 56's reproducer, in the torch.save format: a 16 MiB last.ckpt killed before its
    rename, then a 2-epoch fit saving into the same directory."""
    ckdir = str(tmp_path / "ck")
    os.makedirs(ckdir)
    _run_and_kill("save", os.path.join(ckdir, "last.ckpt"), kind)
    (leftover,) = _leftovers(ckdir)
    assert os.path.getsize(os.path.join(ckdir, leftover)) > 16 << 20  # the whole state, written
    assert _visible(ckdir) == (["last.ckpt"] if kind == "async" else [])  # async: the placeholder

    keep = pl.callbacks.ModelCheckpoint(dirpath=ckdir, save_last=True, save_top_k=1, monitor="step", mode="max")
    plug_in = FastPersistAsyncCheckpointIO() if kind == "async" else FastPersistCheckpointIO()
    trainer(str(tmp_path), 2, plug_in, callbacks=[keep]).fit(seeded_model(), loader())
    assert sorted(os.listdir(ckdir)) == ["epoch=1-step=8.ckpt", "last.ckpt"]
    assert _step(os.path.join(ckdir, "last.ckpt")) == 8


if __name__ == "__main__":
    _child(*sys.argv[1:4])
