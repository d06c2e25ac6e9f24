"""Runs a stack's own checkpoint tests twice, stock and with fastpersist's integration as its
default, and fails when a test fails only with fastpersist (unless docs/integrations.md lists it
as asserting the host's internals: KNOWN below, each with its reason).

    python3 scripts/host_suites.py accelerate             # tests from the installed release's sdist (PyPI)
    python3 scripts/host_suites.py lightning --tests DIR  # DIR: a Lightning checkout's tests/tests_pytorch
    python3 scripts/host_suites.py deepspeed --tests DIR [--decoupled]  # DIR: a DeepSpeed checkout's tests

Accelerate ships its tests in its sdist, so scripts/test.sh runs that suite (~2 minutes).
Lightning's sdist has none: give a checkout of its repository at the installed release.
DeepSpeed's has none either: give its repository's tests/ (``git archive``, below). Its
tests/unit/checkpoint runs on the CPU accelerator over gloo (set here: ``DS_ACCELERATOR=cpu``, and
``LOCAL_SIZE=4``, the CPU "device count" that admits its 4-rank tests); ``ninja``, a C++ compiler,
pytest-timeout and pytest<8.4 must be installed (DeepSpeed pins pytest<8.4: later ones do not find
its DistributedFixture fixtures), e.g. in a venv over this environment. Each test's ranks start in
new interpreters (forkserver), where ``scripts/host_suites/sitecustomize.py`` makes the swap
(``install(engine)``, or ``install(engine, decoupled=True)`` with ``--decoupled``) and, in both
runs, drops the tests' one assertion on an engine attribute that DeepSpeed 0.19.8 removed. Not in
CI: each run of the folder takes hours on 2 cores (docs/integrations.md has the figures).

    git -C DEEPSPEED_REPO archive HEAD tests | tar x -C /tmp/ds
    python3 -m venv --system-site-packages /tmp/ds-venv && /tmp/ds-venv/bin/pip install 'pytest<8.4'
    /tmp/ds-venv/bin/python scripts/host_suites.py deepspeed --tests /tmp/ds/tests --keep /tmp/ds-run
    /tmp/ds-venv/bin/python scripts/host_suites.py deepspeed --tests /tmp/ds/tests --decoupled \
        --stock /tmp/ds-run/stock.jsonl  # the stock run's outcomes, not run again

Prints, per test, the outcome stock and with fastpersist and how many saves went through each
writer (scripts/host_suites/fastpersist_as_default.py counts them, so a test that never reached
fastpersist is seen), then one summary line.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
PLUGIN_DIR = os.path.join(HERE, "host_suites")

#: The suites: what to run, relative to the tests' folder.
SUITES = {
    "accelerate": ["test_state_checkpointing.py"],
    "lightning": ["checkpointing", "plugins"],
    "deepspeed": ["unit/checkpoint"],
}
#: The suites whose own pytest ``addopts`` are kept (DeepSpeed's deselect its nightly, sequential
#: and inference tests); the others' are dropped (coverage and the like).
KEEP_ADDOPTS = {"deepspeed"}
#: pytest options each suite's runs need. DeepSpeed's: a rank that fails with pytest's own
#: exception (``pytest.raises`` not raised: a BaseException) kills its pool worker, and its pool
#: then waits forever; pytest-timeout (which must be installed) fails that test, not the whole run.
SUITE_ARGS = {"deepspeed": ["--timeout=900"]}
#: The first pytest release each suite's tests do not run under (major, minor).
PYTEST_BELOW = {"deepspeed": (8, 4)}
#: Environment each suite's runs need.
SUITE_ENV = {"deepspeed": {"DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "4", "FASTPERSIST_HOST_COMPAT": "deepspeed"}}
#: Tests that fail only with fastpersist because they assert the host's internals (or, for an
#: overlapped writer, a save that is done when the call returns), by suite variant and node id
#: (a parametrized test by its name before "["), with the reason. docs/integrations.md lists them.
_MOCKS_TORCH_SAVE = "mocks torch.save and counts its calls; the plug-in writes through fp.torch_save"
_LISTS_IN_FLIGHT = (
    "lists or reads the directory right after a save returned, while the overlapped save is in flight "
    "(Lightning's own AsyncCheckpointIO fails it too; FastPersistCheckpointIO passes it)"
)
_LIGHTNING_INTERNALS = {
    "checkpointing/test_checkpoint_callback_frequency.py::test_default_checkpoint_freq": _MOCKS_TORCH_SAVE,
    "checkpointing/test_checkpoint_callback_frequency.py::test_top_k": _MOCKS_TORCH_SAVE,
    "checkpointing/test_trainer_checkpoint.py::test_trainer_save_checkpoint_storage_options": (
        "mocks TorchCheckpointIO.save_checkpoint and expects it called"
    ),
    "plugins/test_checkpoint_io_plugin.py::test_multi_wrapped_checkpoint_io_initialization": (
        "asserts the IO inside AsyncCheckpointIO is a TorchCheckpointIO"
    ),
}
_DS_IN_FLIGHT = (
    "right after save_checkpoint returned, with no commit point between (engine.step(), destroy(), "
    "load_checkpoint, another save), reads the tag's files outside the engine, while the decoupled save "
    "is still writing them and before `latest` moved (DeepSpeed's own decoupled engine also moves `latest` "
    "only at step()'s commit): "
)
_DEEPSPEED_DECOUPLED_IN = {
    "test_autotp_uc_checkpoint.py::TestRealCheckpointUniversalConversionTPxPP::test": (
        _DS_IN_FLIGHT + "globs and torch.loads mp_rank_*_model_states.pt, then converts the tag"
    ),
    "test_convert_checkpoint.py::TestCheckpointConvert::test_convert_zero_checkpoint_to_fp32_state_dict": (
        _DS_IN_FLIGHT + "zero_to_fp32's convert_zero_checkpoint_to_fp32_state_dict of `latest`"
    ),
    "test_shared_weights.py::TestCheckpointSharedWeights::test_checkpoint_shared_weights": (
        _DS_IN_FLIGHT + "zero_to_fp32's get_fp32_state_dict_from_zero_checkpoint of the tag"
    ),
    **{
        f"test_universal_checkpoint.py::TestZeROUniversalCheckpointDP::{test}": (
            _DS_IN_FLIGHT + "its fixture (train_save_convert) runs ds_to_universal on the tag after a barrier; "
            "2 of its dtype parametrizations failed so on 2026-12-07, under load, the others passed"
        )
        for test in ("test_dp_world_size_2to2", "test_dp_world_size_4to2", "test_dp_world_size_2to4")
    },
    "test_zero_optimizer.py::TestZeROElasticCheckpoint::test_elastic_checkpoint_change_dp": (
        "its fixture's 4 ranks save and end with no commit point (no step(), destroy(), load or save after "
        "save_checkpoint), so `latest` is never written (docs/integrations.md, Limits); the test's new group "
        "then loads `latest`, finds none, and so raises no ZeRORuntimeException"
    ),
}
_DEEPSPEED_DECOUPLED = {f"unit/checkpoint/{node}": why for node, why in _DEEPSPEED_DECOUPLED_IN.items()}
KNOWN: dict[str, dict[str, str]] = {
    "accelerate": {},
    "lightning": {
        **_LIGHTNING_INTERNALS,
        "checkpointing/test_model_checkpoint.py::test_none_monitor_not_alternating": _LISTS_IN_FLIGHT,
        "checkpointing/test_model_checkpoint.py::test_none_monitor_saves_correct_best_model_path": _LISTS_IN_FLIGHT,
        "checkpointing/test_model_checkpoint.py::test_save_last_saves_correct_last_model_path": _LISTS_IN_FLIGHT,
    },
    "lightning-sync": _LIGHTNING_INTERNALS,
    "deepspeed": {},
    "deepspeed-decoupled": _DEEPSPEED_DECOUPLED,
}


def accelerate_tests(workdir: str) -> str:
    """The installed Accelerate release's tests/, from its sdist on the package index."""
    version = importlib.metadata.version("accelerate")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"accelerate=={version}",
            "-d",
            workdir,
        ],
        check=True,
    )
    with tarfile.open(os.path.join(workdir, f"accelerate-{version}.tar.gz")) as sdist:
        members = [m for m in sdist.getmembers() if m.name.startswith(f"accelerate-{version}/tests/")]
        sdist.extractall(workdir, members=members, filter="data")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "parameterized"], check=True)
    return os.path.join(workdir, f"accelerate-{version}", "tests")


def pytest_version() -> tuple[int, int]:
    major, minor = importlib.metadata.version("pytest").split(".")[:2]
    return int(major), int(minor)


def run(tests: str, targets: list[str], suite: str, stack: str, work: str) -> dict[str, dict[str, object]]:
    """Runs pytest on `targets` under `tests` with the plugin for `stack` ("stock": nothing
    swapped), in `work` (its output in ``work/STACK.log``); returns each test's outcome and
    counts, by node id."""
    report = os.path.join(work, f"{stack}.jsonl")
    env = dict(
        os.environ,
        **SUITE_ENV.get(suite, {}),
        PYTHONPATH=os.pathsep.join([PLUGIN_DIR, os.environ.get("PYTHONPATH", "")]),
        FASTPERSIST_HOST_COUNTS=os.path.join(work, f"{stack}-counts.jsonl"),
    )
    for old in (report, env["FASTPERSIST_HOST_COUNTS"]):  # a kept work folder's, from an earlier run
        with contextlib.suppress(FileNotFoundError):
            os.remove(old)
    env.pop("FASTPERSIST_HOST_STACK", None)
    if stack.startswith("deepspeed"):
        env["FASTPERSIST_HOST_STACK"] = stack  # sitecustomize.py's switch, in every process
    with open(os.path.join(work, f"{stack}.log"), "w") as log:
        _pytest(tests, targets, suite, stack, work, env, report, log)
    return read_report(report)


def read_report(report: str) -> dict[str, dict[str, object]]:
    """A run's outcome and counts per test, by node id (the plugin's JSON lines)."""
    rows: dict[str, dict[str, object]] = {}
    if os.path.exists(report):
        with open(report) as f:
            for line in f:
                row = json.loads(line)
                rows[row.pop("test")] = row
    return rows


def _pytest(
    tests: str, targets: list[str], suite: str, stack: str, work: str, env: dict[str, str], report: str, log: Any
) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *([] if suite in KEEP_ADDOPTS else ["-o", "addopts="]),
            *SUITE_ARGS.get(suite, []),
            f"--basetemp={os.path.join(work, stack + '-tmp')}",
            "-p",
            "fastpersist_as_default",
            f"--fastpersist-stack={stack}",
            f"--fastpersist-report={report}",
            *targets,
        ],
        cwd=tests,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        check=False,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stack", choices=sorted(SUITES))
    parser.add_argument("--tests", help="the stack's tests folder (default for accelerate: its sdist's)")
    parser.add_argument("--sync", action="store_true", help="lightning: FastPersistCheckpointIO, not the async one")
    parser.add_argument("--decoupled", action="store_true", help="deepspeed: install(engine, decoupled=True)")
    parser.add_argument("--only", nargs="+", metavar="PATH", help="run these (under --tests), not the whole suite")
    parser.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (each run's pytest output, tmp dirs)")
    parser.add_argument("--stock", metavar="FILE", help="an earlier stock run's stock.jsonl (--keep): not run again")
    args = parser.parse_args()
    with contextlib.ExitStack() as dirs:
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
            work = args.keep
        else:
            work = dirs.enter_context(tempfile.TemporaryDirectory(prefix="fp-host-suite-"))
        tests = args.tests or (accelerate_tests(work) if args.stack == "accelerate" else None)
        if tests is None:
            parser.error(f"{args.stack}: give --tests, the folder of its tests at the installed release")
        if args.stack == "deepspeed" and PYTEST_BELOW["deepspeed"] <= pytest_version():
            parser.error(
                "deepspeed: its tests need pytest<8.4 (later ones do not find their DistributedFixture fixtures): "
                "run this script with a Python that has it, e.g. a venv made with --system-site-packages"
            )
        stack = args.stack
        if args.stack == "lightning" and args.sync:
            stack = "lightning-sync"
        elif args.stack == "deepspeed" and args.decoupled:
            stack = "deepspeed-decoupled"
        targets = args.only or SUITES[args.stack]
        stock = read_report(args.stock) if args.stock else run(tests, targets, args.stack, "stock", work)
        ours = run(tests, targets, args.stack, stack, work)
    known = KNOWN[stack]
    only_ours, documented = [], []
    for node, row in sorted(ours.items()):
        before = stock.get(node, {}).get("outcome", "-")
        print(
            f"{before:>7} {row['outcome']:>7}  hosts={row.get('hosts', 0)} "
            f"fastpersist={row.get('fastpersist saves', 0)} torch={row.get('torch saves', 0)}  {node}"
        )
        if row["outcome"] == "failed" and before != "failed":
            (documented if node.split("[")[0] in known else only_ours).append(node)
    saved = sum(1 for row in ours.values() if row.get("fastpersist saves"))
    failed = {
        name: sum(r["outcome"] == "failed" for r in rows.values()) for name, rows in (("stock", stock), ("ours", ours))
    }
    skipped = sum(r["outcome"] == "skipped" for r in ours.values())
    print(
        f"{stack}: {len(ours)} tests ({len(ours) - skipped} run, {skipped} skipped); "
        f"failed stock {failed['stock']}, with fastpersist {failed['ours']}; "
        f"only with fastpersist: {len(only_ours)} unexplained, {len(documented)} documented (host internals); "
        f"{saved} tests saved through fastpersist"
    )
    for node in documented:
        print(f"failed only with fastpersist, as documented: {node}: {known[node.split('[')[0]]}")
    for node in only_ours:
        print(f"FAILED only with fastpersist: {node}")
    if not saved:
        print("no test saved through fastpersist: the swap did not take")
        return 1
    return 1 if only_ours else 0


if __name__ == "__main__":
    sys.exit(main())
