"""A pytest plugin that runs a stack's own test suite with fastpersist's integration as its default.

``python -m pytest -p fastpersist_as_default --fastpersist-stack=accelerate ...`` (with this
folder on ``PYTHONPATH``; scripts/host_suites.py does it):

* ``accelerate``: every ``Accelerator`` made gets ``FastPersistStateHooks().install(...)``.
* ``lightning`` / ``lightning-sync``: every strategy without a checkpoint IO of the test's own
  gets ``FastPersistAsyncCheckpointIO`` (``FastPersistCheckpointIO``), also inside Lightning's
  ``AsyncCheckpointIO`` wrapper; a test that passes its own IO keeps it.
* ``deepspeed`` / ``deepspeed-decoupled``: every engine ``deepspeed.initialize`` makes gets
  ``fastpersist.integrations.deepspeed.install(engine, decoupled=...)``. DeepSpeed's tests run
  their ranks in new interpreters, so the swap is made by this folder's ``sitecustomize.py`` in
  every process, when ``FASTPERSIST_HOST_STACK`` names the stack (the runner sets it, and
  ``FASTPERSIST_HOST_COUNTS``, the file where each process appends its counts).

The swap is checked per test, not assumed: each test's report line counts the hosts made and
the saves that went through fastpersist and, for Lightning, through ``TorchCheckpointIO``
(a test that saved only through torch did not exercise the swap); for DeepSpeed, the hosts are
the engines made and the counts are summed over every process the test ran. They are written as
JSON lines to ``--fastpersist-report`` for the runner to read.
"""

from __future__ import annotations

import functools
import json
import os
from collections import Counter
from typing import Any

import pytest

_counts: Counter[str] = Counter()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fastpersist")
    group.addoption(
        "--fastpersist-stack",
        choices=[
            "stock",
            "accelerate",
            "lightning",
            "lightning-sync",
            "lightning-torch-async",
            "deepspeed",
            "deepspeed-decoupled",
        ],
        required=True,
        help="stock: change nothing, only report each test's outcome; lightning-torch-async: Lightning's own "
        "AsyncCheckpointIO(TorchCheckpointIO()) as the default, the peer an async writer is compared with",
    )
    group.addoption("--fastpersist-report", default=None, help="JSON lines: one per test, its outcome and counts")


def _counting(owner: Any, name: str, key: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def counted(*args: Any, **kwargs: Any) -> Any:
        _counts[key] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)


def _install_accelerate() -> None:
    from accelerate import Accelerator

    from fastpersist.integrations import hf_accelerate
    from fastpersist.integrations.hf_accelerate import FastPersistStateHooks

    made = Accelerator.__init__

    @functools.wraps(made)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        FastPersistStateHooks().install(self)
        _counts["hosts"] += 1

    Accelerator.__init__ = init  # type: ignore[method-assign]
    _counting(hf_accelerate, "save_async", "fastpersist saves")


def _install_lightning(stack: str) -> None:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
    from lightning.pytorch.strategies.strategy import Strategy

    from fastpersist.integrations.lightning import FastPersistAsyncCheckpointIO, FastPersistCheckpointIO

    ours: Any = {"lightning": FastPersistAsyncCheckpointIO, "lightning-sync": FastPersistCheckpointIO}.get(stack)
    stock = Strategy.checkpoint_io

    def get(self: Strategy) -> Any:
        io = self._checkpoint_io
        if io is None and ours is None:
            self._checkpoint_io = AsyncCheckpointIO(TorchCheckpointIO())
            _counts["hosts"] += 1
        elif io is None:
            self._checkpoint_io = ours()
            _counts["hosts"] += 1
        elif isinstance(io, _WrappingCheckpointIO) and io.checkpoint_io is None:
            io.checkpoint_io = ours() if ours is not None else TorchCheckpointIO()
            _counts["hosts"] += 1
        return self._checkpoint_io

    Strategy.checkpoint_io = property(get, stock.fset)  # type: ignore[method-assign,assignment]
    if ours is not None:
        _counting(ours, "save_checkpoint", "fastpersist saves")
    _counting(TorchCheckpointIO, "save_checkpoint", "torch saves")


def _counts_file() -> str | None:
    """The file where every process of a DeepSpeed run appends its counts (sitecustomize.py)."""
    return os.environ.get("FASTPERSIST_HOST_COUNTS")


def _counted_since(offset: int) -> Counter[str]:
    """The events the processes appended to the counts file after byte `offset`."""
    path = _counts_file()
    if path is None or not os.path.exists(path):
        return Counter()
    with open(path) as f:
        f.seek(offset)
        return Counter(json.loads(line)["event"] for line in f if line.endswith("\n"))


def pytest_configure(config: pytest.Config) -> None:
    stack = config.getoption("--fastpersist-stack")
    if stack.startswith("deepspeed"):
        import sitecustomize  # this folder's: the swap, made in every process at its start

        if os.environ.get("FASTPERSIST_HOST_STACK") != stack or stack not in getattr(sitecustomize, "STACKS", {}):
            raise pytest.UsageError(
                f"--fastpersist-stack={stack} needs FASTPERSIST_HOST_STACK={stack} and this folder on PYTHONPATH "
                "(scripts/host_suites.py sets both)"
            )
    elif stack == "accelerate":
        _install_accelerate()
    elif stack != "stock":
        _install_lightning(stack)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    _counts.clear()
    outcomes: list[str] = []
    item.stash[_OUTCOMES] = outcomes
    counts_file = _counts_file()
    offset = os.path.getsize(counts_file) if counts_file and os.path.exists(counts_file) else 0
    yield
    _counts.update(_counted_since(offset))
    path = item.config.getoption("--fastpersist-report")
    if path:
        failed = "failed" in outcomes
        outcome = "failed" if failed else ("skipped" if "skipped" in outcomes else "passed")
        with open(path, "a") as f:
            f.write(json.dumps({"test": item.nodeid, "outcome": outcome, **_counts}) + "\n")


_OUTCOMES = pytest.StashKey[list[str]]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    outcomes = item.stash.get(_OUTCOMES, None)
    if outcomes is not None:
        outcomes.append(report.get_result().outcome)
