#!/usr/bin/env bash
# Memory safety under valgrind (not run by CI by default: it takes minutes).
#
# 1. Every test binary of the Rust core crate (unit and integration tests) runs under memcheck.
# 2. A short pytest subset runs the installed extension (fastpersist._core) under memcheck, with
#    PYTHONMALLOC=malloc so every Python allocation goes through what valgrind tracks.
#
# Only invalid reads/writes/frees fail the run (--undef-value-errors=no: third-party libraries
# such as libtorch's BLAS trip uninitialised-value checks that are not ours). Install the
# package first (pip install .). Exit status 0 means no invalid access was seen.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
log_dir=${VALGRIND_LOG_DIR:-$(mktemp -d /tmp/fastpersist-valgrind.XXXXXX)}
vg=(valgrind --tool=memcheck --error-exitcode=99 --undef-value-errors=no --leak-check=no
    --show-mismatched-frees=yes --num-callers=30 --suppressions="$repo/scripts/valgrind.supp")

echo "== Rust core tests under valgrind (logs: $log_dir)"
export CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="${vg[*]} --log-file=$log_dir/rust-%p.log"
# Property tests run fewer cases here: each case is ~50x slower under memcheck.
PROPTEST_CASES=${PROPTEST_CASES:-8} cargo test -p fastpersist-core --locked -- --test-threads=2
unset CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER

echo "== pytest subset under valgrind"
subset=(
    "$repo/tests/engine/test_core.py::test_write_read_round_trip"
    "$repo/tests/engine/test_core.py::test_flipped_byte_raises_checksum_mismatch"
    "$repo/tests/engine/test_core.py::test_truncated_file_is_corrupt"
    "$repo/tests/engine/test_core.py::test_crc32c_matches_reference"
    "$repo/tests/engine/test_core.py::test_full_disk_is_enospc"
    "$repo/tests/format/test_integrity.py::test_seal_covers_a_dict_key_and_a_value"
    "$repo/tests/format/test_integrity.py::test_a_payload_class_never_runs_unless_allow_listed"
)
(cd /tmp && PYTHONMALLOC=malloc "${vg[@]}" --log-file="$log_dir/python-%p.log" \
    python3 -m pytest "${subset[@]}" -q -p no:cacheprovider -x)

errors=$(grep -hE "^==[0-9]+== (Invalid (read|write|free)|Mismatched free)" "$log_dir"/*.log | wc -l || true)
summaries=$(grep -h "ERROR SUMMARY" "$log_dir"/*.log | sort | uniq -c)
echo "$summaries"
echo "invalid reads/writes/frees: $errors (logs in $log_dir)"
[ "$errors" -eq 0 ]
