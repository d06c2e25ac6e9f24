"""Every temporary file fastpersist writes is one that the next write to that place and
``fastpersist clean`` recognise and remove once its writer is dead, and never while it lives.

A writer killed (SIGKILL, in a child process) just before it renames its temporary file into
place leaves the file at its full size: a Hugging Face export's shards, an ``fp.torch_save``
file, a safetensors conversion, a Checkpointer's index (before the fix: ``.NAME.tmp-PID-TID``,
which nothing removed; up to 5 GB per killed export).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import fastpersist as fp
from fastpersist.format.layout import atomic_file, parse_tmp_dir
from fastpersist.interop.convert import convert

#: The child: makes os.replace of a temporary file kill the process (the temporary whole, not
#: yet renamed), then writes `kind` into `where`.
CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import fastpersist as fp
    from fastpersist.format.layout import parse_tmp_dir
    from fastpersist.interop.convert import convert
    kind, src, where = sys.argv[1:4]
    replace = os.replace
    def killed_before_the_rename(a, b, *args, **kwargs):
        if parse_tmp_dir(os.path.basename(os.fspath(a))):
            os.kill(os.getpid(), signal.SIGKILL)
        return replace(a, b, *args, **kwargs)
    os.replace = killed_before_the_rename
    state = {"model": {"w": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(7)}}
    if kind == "export_hf":
        fp.export_hf(src, where, key="model", max_shard_bytes=600_000)
    elif kind == "torch_save":
        fp.torch_save(state, os.path.join(where, "model.pt"))
    elif kind == "safetensors":
        convert(src, "safetensors", os.path.join(where, "model.safetensors"))
    elif kind == "checkpointer":
        fp.Checkpointer(where).save(1, state)
    """
)


def _state() -> dict[str, object]:
    return {"model": {"w": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(7)}}


def _leftovers(where: str) -> list[str]:
    return sorted(n for n in os.listdir(where) if parse_tmp_dir(n) and os.path.isfile(os.path.join(where, n)))


def _killed_writer(kind: str, src: str, where: str) -> list[str]:
    """Runs `kind`'s write in a child killed before its rename; returns the temporaries it left."""
    done = subprocess.run([sys.executable, "-c", CHILD, kind, src, where], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    return _leftovers(where)


def _write_again(kind: str, src: str, where: str) -> None:
    if kind == "export_hf":
        fp.export_hf(src, where, key="model", max_shard_bytes=600_000)
    elif kind == "torch_save":
        fp.torch_save(_state(), os.path.join(where, "model.pt"))
    elif kind == "safetensors":
        convert(src, "safetensors", os.path.join(where, "model.safetensors"))
    else:
        ck = fp.Checkpointer(where)
        ck.save(2, _state())
        ck.wait()


@pytest.mark.parametrize("kind", ["export_hf", "torch_save", "safetensors", "checkpointer"])
def test_a_killed_writers_temporary_files_go_with_the_next_write(workdir: str, kind: str) -> None:
    src = os.path.join(workdir, "ck")
    fp.save(_state(), src)
    where = os.path.join(workdir, "out")
    os.makedirs(where)
    left = _killed_writer(kind, src, where)
    assert left, os.listdir(where)
    if kind != "checkpointer":  # the data itself: full size (1.2 MB of tensors)
        assert sum(os.path.getsize(os.path.join(where, n)) for n in left) > 1_000_000
    assert sorted(os.path.basename(p) for p in fp.clean(where, dry_run=True)) == left
    _write_again(kind, src, where)
    assert _leftovers(where) == [] and fp.clean(where, dry_run=True) == []


def test_clean_removes_a_killed_writers_temporary_file(workdir: str) -> None:
    left = _killed_writer("torch_save", "", workdir)
    assert [n.split(".fptmp-")[0] for n in left] == [".model.pt"]
    removed = fp.clean(workdir)
    assert [os.path.basename(p) for p in removed] == left
    assert os.listdir(workdir) == []


def test_a_live_writers_temporary_file_is_never_removed(workdir: str) -> None:
    path = os.path.join(workdir, "model.pt")
    other = "import sys, fastpersist as fp; print(len(fp.clean(sys.argv[1])))"
    with atomic_file(path, durable=False) as tmp:
        with open(tmp, "wb") as f:
            f.write(b"x" * 4096)
        assert fp.clean(workdir) == []  # this process, another open file: the lock is held
        done = subprocess.run([sys.executable, "-c", other, workdir], capture_output=True, text=True, timeout=120)
        assert done.stdout.strip() == "0", done.stderr
        fp.torch_save({"w": torch.ones(2)}, os.path.join(workdir, "other.pt"))  # a write beside it
        with atomic_file(path, durable=False) as second:  # a second writer of the same file
            assert second != tmp and os.path.exists(tmp)
            open(second, "wb").close()
        assert os.path.getsize(tmp) == 4096
    assert open(path, "rb").read() == b"x" * 4096
    assert _leftovers(workdir) == []
