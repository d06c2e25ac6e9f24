#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what it needs (the Rust extension through
# maturin, the Python test dependencies), then runs Rust format/lint/tests, the _core stub
# check, mypy --strict, ruff, and pytest (API tests run on every backend this machine offers).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore ".[test]"
# torchtitan (tests/integrations/test_torchtitan.py) without its training-data dependencies:
# their datasets pin would replace huggingface-hub with one transformers refuses. Its checkpoint
# module needs only these.
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps \
    torchtitan==0.3.0 torch_checkpointing==0.1.1 spmd_types==0.2.3 torchdata==0.11.0 tyro==1.0.17 \
    docstring_parser==0.18.0 typeguard==4.6.1
# DeepSpeed's tests (tests/integrations/test_deepspeed.py) run DeepSpeed on the CPU, which
# compiles its shared-memory comm op at first use with ninja (from .[test]) and a C++ compiler.
command -v c++ >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++; }

cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
cargo bench --workspace --no-run --locked

# Run outside the source tree so the installed package (with its compiled _core) is checked.
(cd /tmp && python3 -m mypy.stubtest fastpersist._core --allowlist "$repo/.mypy-stubtest-allowlist")
(cd /tmp && python3 -m mypy --config-file "$repo/pyproject.toml" -p fastpersist)
python3 -m ruff check python tests benches
python3 -m ruff format --check python tests benches

python3 -m pytest tests -q -p no:cacheprovider
# Accelerate's own checkpoint tests (from the installed release's sdist), stock and with
# FastPersistStateHooks on every Accelerator: none may fail only with fastpersist. ~2 minutes.
python3 scripts/host_suites.py accelerate
# The format, API and hostile-input suites again under CPython's debug allocator (buffer
# over/underruns, use after free, API misuse by the extension, such as the native walk's
# slot setting, are fatal there). ~60 s.
(cd /tmp && PYTHONMALLOC=debug python3 -m pytest -q -p no:cacheprovider "$repo/tests/format/test_flatten.py" \
    "$repo/tests/format/test_native_walk.py" "$repo/tests/test_api.py" "$repo/tests/format/test_integrity.py" "$repo/tests/format/test_hostile.py" "$repo/tests/saving/test_io_errors.py")
