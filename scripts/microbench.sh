#!/usr/bin/env bash
# Criterion microbenchmarks of the Rust core (about 2 minutes), then one line per benchmark
# with its median time and bytes/s. Arguments go to `cargo bench` (e.g. a filter: `plan`).
# Files of the I/O benchmarks go under FASTPERSIST_BENCH_DIR (default: inside target/), which
# must be on a disk that accepts O_DIRECT.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo bench -p fastpersist-core --locked --bench components --bench driver --bench write_1gib -- "$@"

target=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
python3 - "$target/criterion" <<'PY'
import json
import os
import sys

root = sys.argv[1]
print(f"\n{'benchmark':<34} {'median':>12} {'bytes/s':>12}")
for dirpath, _dirs, files in sorted(os.walk(root)):
    if os.path.basename(dirpath) != "new" or "estimates.json" not in files:
        continue
    bench = json.load(open(os.path.join(dirpath, "benchmark.json")))
    median_ns = json.load(open(os.path.join(dirpath, "estimates.json")))["median"]["point_estimate"]
    per_iter = (bench.get("throughput") or {}).get("Bytes")
    rate = f"{per_iter / (median_ns * 1e-9) / 1e9:9.2f} GB/s" if per_iter else ""
    unit, scale = next((u, s) for u, s in [("s", 1e9), ("ms", 1e6), ("us", 1e3), ("ns", 1.0)] if median_ns >= s or s == 1.0)
    print(f"{bench['full_id']:<34} {median_ns / scale:9.3f} {unit:<2} {rate:>12}")
PY
