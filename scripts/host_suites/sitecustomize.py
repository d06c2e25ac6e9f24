"""Makes fastpersist DeepSpeed's default checkpoint engine in every process of a test run,
the ranks that DeepSpeed's tests start included (they run in fresh interpreters: forkserver or
spawn, so a patch made in pytest's process does not reach them; this file, on ``PYTHONPATH``,
runs at each interpreter's start).

It does nothing unless ``FASTPERSIST_HOST_STACK`` is ``deepspeed`` (blocking) or
``deepspeed-decoupled``: then, once ``deepspeed`` is imported, every engine that
``deepspeed.initialize`` makes gets ``fastpersist.integrations.deepspeed.install(engine, ...)``
in that mode. Each install and each save through fastpersist's engine (and through DeepSpeed's
``TorchCheckpointEngine``, which a test that bypassed the swap used) appends one JSON line to the
file ``FASTPERSIST_HOST_COUNTS`` names, which the pytest plugin (fastpersist_as_default.py)
reads per test: a rank's counts reach the report whatever process ran it.

With ``FASTPERSIST_HOST_COMPAT=deepspeed`` (the runner sets it for the stock run and ours alike)
it also drops, from DeepSpeed's checkpoint tests' shared comparison, the one assertion on an
engine attribute that the installed release no longer has (see :func:`compare_deepspeed_states`):
the mirror's tests predate the installed release, and that assertion would fail every
save-and-load test, stock and ours alike, hiding what they check.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys
from typing import Any

STACKS = {"deepspeed": False, "deepspeed-decoupled": True}  # the stack -> install(decoupled=...)


def count(event: str) -> None:
    """Appends `event` to the counts file (one short ``O_APPEND`` write: whole, whichever process)."""
    path = os.environ.get("FASTPERSIST_HOST_COUNTS")
    if path:
        line = json.dumps({"event": event, "pid": os.getpid()}) + "\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def _counting(owner: Any, name: str, event: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def counted(*args: Any, **kwargs: Any) -> Any:
        count(event)
        return original(*args, **kwargs)

    setattr(owner, name, counted)


def patch_deepspeed(deepspeed: Any, decoupled: bool) -> None:
    """Wraps ``deepspeed.initialize`` so that its engine gets fastpersist's checkpoint engine."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from fastpersist.integrations import deepspeed as fp_deepspeed

    made = deepspeed.initialize

    @functools.wraps(made)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        result = made(*args, **kwargs)
        fp_deepspeed.install(result[0], decoupled=decoupled)
        count("hosts")
        return result

    deepspeed.initialize = initialize
    _counting(fp_deepspeed.FastPersistCheckpointEngine, "save", "fastpersist saves")
    _counting(TorchCheckpointEngine, "save", "torch saves")


def compare_deepspeed_states(saved_model: Any, loaded_model: Any) -> None:
    """tests/unit/checkpoint/common.py's, less its check of ``sparse_tensor_module_names``, which
    DeepSpeed 0.19.8 removed from its engine (the tests of the mirror's master predate it)."""
    assert hasattr(loaded_model, "module")
    assert saved_model.skipped_steps == loaded_model.skipped_steps
    assert saved_model.global_steps == loaded_model.global_steps


def patch_checkpoint_tests(common: Any) -> None:
    """DeepSpeed's ``unit.checkpoint.common``: its comparison without the removed attribute's check."""
    original = common.compare_deepspeed_states

    def compare(saved_model: Any, loaded_model: Any) -> None:
        if hasattr(saved_model, "sparse_tensor_module_names"):
            original(saved_model, loaded_model)
        else:
            compare_deepspeed_states(saved_model, loaded_model)

    common.compare_deepspeed_states = compare


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs `then(module)` once the module `name` is imported (the import hook's ordinary form:
    finds the module's spec through the path finder, wraps its loader)."""

    def __init__(self, name: str, then: Any) -> None:
        self.name, self.then, self.loader = name, then, None

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name or self.loader is not None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)  # type: ignore[union-attr]

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)  # type: ignore[union-attr]
        sys.meta_path.remove(self)
        self.then(module)


if os.environ.get("FASTPERSIST_HOST_COMPAT") == "deepspeed":
    sys.meta_path.insert(0, _AfterImport("unit.checkpoint.common", patch_checkpoint_tests))
_stack = os.environ.get("FASTPERSIST_HOST_STACK")
if _stack in STACKS:
    sys.meta_path.insert(0, _AfterImport("deepspeed", functools.partial(patch_deepspeed, decoupled=STACKS[_stack])))
