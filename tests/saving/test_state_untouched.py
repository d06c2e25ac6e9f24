"""A save leaves the state's tensors as it found them: every way into the library reads a CPU
tensor's bytes without changing its storage's flags, so code that later grows a buffer with
``resize_`` or frees a storage FSDP-style (``untyped_storage().resize_(0)``) still can, as after
``torch.save``."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fastpersist as fp
from fastpersist.integrations.dcp import FastPersistWriter

DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.complex64, torch.float8_e4m3fn]


def _state() -> dict[str, torch.Tensor]:
    state = {str(dt).removeprefix("torch."): torch.ones(300, dtype=torch.float32).to(dt) for dt in DTYPES}
    state["requires_grad"] = torch.ones(50, requires_grad=True)
    state["a 2-D row"] = torch.ones(4, 25)[1]  # a view into a larger storage
    return state


def _saves(workdir: str, config: fp.Config) -> dict[str, Callable[[dict[str, torch.Tensor]], object]]:
    def checkpointer(state: dict[str, torch.Tensor]) -> None:
        with fp.Checkpointer(os.path.join(workdir, "root"), keep=1, config=config) as ck:
            ck.save(0, state)

    return {
        "fp.save": lambda s: fp.save(s, os.path.join(workdir, "a"), config=config),
        "fp.save_async": lambda s: fp.save_async(s, os.path.join(workdir, "b"), config=config).wait(),
        "fp.torch_save": lambda s: fp.torch_save(s, os.path.join(workdir, "c.pt"), config=config),
        "Checkpointer.save": checkpointer,
        "dcp.save(FastPersistWriter)": lambda s: dcp.save(
            s, storage_writer=FastPersistWriter(os.path.join(workdir, "d"), config=config), no_dist=True
        ),
    }


@pytest.mark.parametrize(
    "how", ["fp.save", "fp.save_async", "fp.torch_save", "Checkpointer.save", "dcp.save(FastPersistWriter)"]
)
def test_every_saved_storage_stays_resizable(workdir: str, config: fp.Config, how: str) -> None:
    state = _state()
    before = {k: t.clone() for k, t in state.items()}
    _saves(workdir, config)[how](state)
    for key, t in state.items():
        assert t.untyped_storage().resizable(), f"{how} left the storage of {key!r} non-resizable"
        assert torch.equal(t, before[key]) and t.requires_grad == before[key].requires_grad
    grown = state["float32"]
    grown.resize_(grown.numel() * 2)  # what the reproducer does: torch.save allows it
    state["bfloat16"].untyped_storage().resize_(0)  # FSDP frees a flat parameter so


def test_a_saved_view_still_reads_the_bytes_at_the_call(workdir: str, config: fp.Config) -> None:
    """The view is of the tensor's own first element on (a storage offset, any dtype): what was saved loads."""
    base = torch.arange(40, dtype=torch.bfloat16)
    state = {"tail": base[7:], "row": torch.arange(12.0).reshape(3, 4)[2]}
    fp.save(state, os.path.join(workdir, "v"), config=config)
    loaded = fp.load(os.path.join(workdir, "v"))
    assert torch.equal(loaded["tail"], base[7:]) and torch.equal(loaded["row"], torch.tensor([8.0, 9.0, 10.0, 11.0]))
