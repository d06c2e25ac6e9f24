#!/usr/bin/env bash
# Builds the wheel that scripts/gpu_check.sh installs offline on a GPU machine that has neither
# network nor a Rust toolchain (docs/gpu.md). The extension is built for the stable ABI
# (abi3-py311: one cp311-abi3 wheel for CPython 3.11 and later) and linked through zig against
# glibc 2.28 (manylinux_2_28), so it loads on any distro from RHEL 8 / Debian 10 / Ubuntu 18.10
# on, whatever glibc this machine has. Needs cargo, maturin and the ziglang package
# (`pip install ziglang`). Leaves exactly one wheel in target/wheels, with the hash of the Rust
# sources it was built from (rust-sources.sha256: scripts/gpu_check.sh warns when the checkout's
# differ), then prints the newest glibc symbol version the extension needs, from its dynamic
# symbol table.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

rm -f target/wheels/fastpersist-*.whl
"$PYTHON" -m maturin build --release --compatibility manylinux_2_28 --zig --out target/wheels
bash scripts/rust_sources_hash.sh >target/wheels/rust-sources.sha256
wheel=$(ls target/wheels/fastpersist-*.whl)
echo "built $wheel"

so_dir=$(mktemp -d)
trap 'rm -rf "$so_dir"' EXIT
unzip -q "$wheel" 'fastpersist/_core*.so' -d "$so_dir"
needed=$(objdump -T "$so_dir"/fastpersist/_core*.so | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1)
echo "the extension needs glibc >= $needed"
if [ "$(printf '%s\n' 2.28 "$needed" | sort -V | tail -1)" != 2.28 ]; then
    echo "error: it needs a glibc newer than manylinux_2_28 allows" >&2
    exit 1
fi
