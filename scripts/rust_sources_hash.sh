#!/usr/bin/env bash
# One sha256 over the sources the extension is built from (rust/, Cargo.toml, Cargo.lock), the
# same on any machine with the same files: build_gpu_wheel.sh records it next to the wheel and
# gpu_check.sh compares it with the checkout's, since a machine without Rust cannot rebuild.
set -euo pipefail
cd "$(dirname "$0")/.."
find rust Cargo.toml Cargo.lock -type f -not -path '*/target/*' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1
