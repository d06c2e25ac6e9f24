"""``load(out=...)`` is all or nothing: a load that fails leaves every tensor of `out` as it was.

Multi-window states, both fill strategies (a stream that fits the window budget is read whole
before the first copy; a larger one is checked in a first pass), on both backends.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

import fastpersist as fp
from fastpersist.loading import fill

CHUNK = 64 << 10
TENSORS = 6
ELEMS = 96 << 10  # 384 KiB per tensor: 2.25 MiB of stream, several windows of 256 KiB


@pytest.fixture(params=["fits-budget", "over-budget"])
def budget(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Windows of 256 KiB read ahead within 4 MiB (the stream fits) or 768 KiB (it does not)."""
    monkeypatch.setattr(fill, "WINDOW_BYTES", 256 << 10)
    monkeypatch.setattr(fill, "FILL_BUFFER_BYTES", (4 << 20) if request.param == "fits-budget" else (768 << 10))
    return str(request.param)


def _saved(workdir: str, backend: str, stripes: int = 0) -> tuple[str, dict[str, torch.Tensor]]:
    roots = [os.path.join(workdir, f"ssd{i}") for i in range(stripes)]
    for r in roots:
        os.makedirs(r)
    config = fp.Config(backend=backend, chunk_bytes=CHUNK, pool_bytes=1 << 20, stripes=roots or None)
    torch.manual_seed(3)
    state = {f"w{i}": torch.randn(ELEMS) for i in range(TENSORS)}
    path = os.path.join(workdir, "ck")
    fp.save(state, path, config=config)
    return path, state


def _live() -> dict[str, torch.Tensor]:
    """The caller's current weights: other values than the checkpoint's."""
    torch.manual_seed(99)
    return {f"w{i}": torch.randn(ELEMS) for i in range(TENSORS)}


def _files(path: str) -> list[str]:
    return [f["path"] for f in sorted(fp.inspect(path)["files"], key=lambda f: f["path"])]


def _flip(file: str, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


def _middle_chunk(path: str) -> None:
    file = _files(path)[0]
    _flip(file, os.path.getsize(file) // 2)


def _last_chunk(path: str) -> None:
    file = _files(path)[-1]
    _flip(file, os.path.getsize(file) - 10)


def _truncate(path: str) -> None:
    file = _files(path)[-1]
    os.truncate(file, os.path.getsize(file) - CHUNK)


def _append(path: str) -> None:
    with open(_files(path)[0], "ab") as f:
        f.write(b"x")


def _remove(path: str) -> None:
    os.remove(_files(path)[-1])


DAMAGE: dict[str, tuple[Callable[[str], None], type[Exception]]] = {
    "middle-chunk": (_middle_chunk, fp.ChecksumMismatchError),
    "last-chunk": (_last_chunk, fp.ChecksumMismatchError),
    "truncated": (_truncate, fp.CorruptCheckpointError),
    "bytes-appended": (_append, fp.CorruptCheckpointError),
    "file-missing": (_remove, fp.CorruptCheckpointError),
}


def _assert_untouched(out: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> None:
    for key, t in out.items():
        assert torch.equal(t.view(torch.uint8), before[key].view(torch.uint8)), f"out[{key!r}] was modified"


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("stripes", [0, 2], ids=["one-file", "striped"])
def test_a_failed_out_load_leaves_out_as_it_was(
    workdir: str, backend: str, budget: str, damage: str, stripes: int
) -> None:
    path, _ = _saved(workdir, backend, stripes)
    assert len(_files(path)) == (1 if stripes == 0 else 2)
    harm, error = DAMAGE[damage]
    harm(path)
    out = _live()
    before = {k: t.clone() for k, t in out.items()}
    with pytest.raises(error):
        fp.load(path, out=out, config=fp.Config(backend=backend))
    _assert_untouched(out, before)


def test_a_good_out_load_fills_every_tensor(workdir: str, backend: str, budget: str) -> None:
    path, state = _saved(workdir, backend, stripes=2)
    out = _live()
    for verify in (True, False):
        for t in out.values():
            t.zero_()
        loaded = fp.load(path, out=out, verify=verify, config=fp.Config(backend=backend))
        assert all(loaded[k] is out[k] and torch.equal(out[k], state[k]) for k in state)


def test_the_stream_is_checked_before_the_first_copy(
    workdir: str, backend: str, budget: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The damage sits in the last window: every earlier window was read (and, without the
    rule, copied) before the mismatch is found."""
    path, _ = _saved(workdir, backend)
    _last_chunk(path)
    copied: list[int] = []
    copy_window = fill._copy_window
    monkeypatch.setattr(fill, "_copy_window", lambda m, lo, *rest: (copied.append(lo), copy_window(m, lo, *rest)))
    out = _live()
    with pytest.raises(fp.ChecksumMismatchError, match="w5"):
        fp.load(path, out=out, config=fp.Config(backend=backend))
    assert copied == []
