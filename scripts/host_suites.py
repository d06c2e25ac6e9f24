"""Runs a stack's own checkpoint tests twice, stock and with fastpersist's integration as its
default, and fails when a test fails only with fastpersist (unless docs/integrations.md lists it
as asserting the host's internals: KNOWN below, each with its reason).

    python3 scripts/host_suites.py accelerate             # tests from the installed release's sdist (PyPI)
    python3 scripts/host_suites.py lightning --tests DIR  # DIR: a Lightning checkout's tests/tests_pytorch

Accelerate ships its tests in its sdist, so scripts/test.sh runs that suite (~2 minutes).
Lightning's sdist has none: give a checkout of its repository at the installed release.
Prints, per test, the outcome stock and with fastpersist and how many saves went through each
writer (scripts/host_suites/fastpersist_as_default.py counts them, so a test that never reached
fastpersist is seen), then one summary line.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PLUGIN_DIR = os.path.join(HERE, "host_suites")

#: The suites: what to run, relative to the tests' folder.
SUITES = {
    "accelerate": ["test_state_checkpointing.py"],
    "lightning": ["checkpointing", "plugins"],
}
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
KNOWN: dict[str, dict[str, str]] = {
    "accelerate": {},
    "lightning": {
        **_LIGHTNING_INTERNALS,
        "checkpointing/test_model_checkpoint.py::test_none_monitor_not_alternating": _LISTS_IN_FLIGHT,
        "checkpointing/test_model_checkpoint.py::test_none_monitor_saves_correct_best_model_path": _LISTS_IN_FLIGHT,
        "checkpointing/test_model_checkpoint.py::test_save_last_saves_correct_last_model_path": _LISTS_IN_FLIGHT,
    },
    "lightning-sync": _LIGHTNING_INTERNALS,
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


def run(tests: str, targets: list[str], stack: str, report: str) -> dict[str, dict[str, object]]:
    """Runs pytest on `targets` under `tests` with the plugin for `stack` ("stock": nothing
    swapped); returns each test's outcome and counts, by node id."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PLUGIN_DIR, os.environ.get("PYTHONPATH", "")]))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "-p",
            "fastpersist_as_default",
            f"--fastpersist-stack={stack}",
            f"--fastpersist-report={report}",
            *targets,
        ],
        cwd=tests,
        env=env,
        stdout=subprocess.DEVNULL,
        check=False,
    )
    rows: dict[str, dict[str, object]] = {}
    if os.path.exists(report):
        with open(report) as f:
            for line in f:
                row = json.loads(line)
                rows[row.pop("test")] = row
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stack", choices=sorted(SUITES))
    parser.add_argument("--tests", help="the stack's tests folder (default for accelerate: its sdist's)")
    parser.add_argument("--sync", action="store_true", help="lightning: FastPersistCheckpointIO, not the async one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fp-host-suite-") as work:
        tests = args.tests or (accelerate_tests(work) if args.stack == "accelerate" else None)
        if tests is None:
            parser.error(f"{args.stack}: give --tests, the folder of its tests at the installed release")
        targets = SUITES[args.stack]
        stack = "lightning-sync" if args.stack == "lightning" and args.sync else args.stack
        stock = run(tests, targets, "stock", os.path.join(work, "stock.jsonl"))
        ours = run(tests, targets, stack, os.path.join(work, "ours.jsonl"))
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
    print(
        f"{args.stack}: {len(ours)} tests; failed stock {failed['stock']}, with fastpersist {failed['ours']}; "
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
