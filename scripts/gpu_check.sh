#!/usr/bin/env bash
# The GPU check (docs/gpu.md). On a machine with one NVIDIA GPU, no network and no Rust
# toolchain, it installs the wheel that scripts/build_gpu_wheel.sh built here (target/wheels,
# carried along with the checkout) and runs these stages:
#   install    the wheel, offline, into a directory of its own that goes on PYTHONPATH, with the
#              checkout's Python files over its own (the extension must come from the wheel; the
#              stage says so when rust/ has changed since the wheel was built)
#   preflight  glibc, kernel, torch/CUDA, nvidia-smi, df -T, the backend a save chooses, O_DIRECT
#              in the target directory, a save and load on the thread backend, and whether a
#              staging slot the copier registered reports pinned (benches/gpu_preflight.py)
#   tests      the suite's CUDA and device tests (tests/conftest.py's FASTPERSIST_GPU_CHECK), against
#              the installed wheel
#   bench      benches/gpu_check.py at --size
# Each stage runs under its own timeout (their sum keeps the run under 6 minutes); a failed stage
# does not stop the next (no set -e), except that nothing runs against a failed install. Each
# stage's output is teed to $OUT/<stage>.log; a summary of their exit statuses ends the run (and
# $OUT/summary.txt). The exit status is 0 only if every stage passed.
#
#   PYTHON=/opt/torch/.venv/bin/python bash scripts/gpu_check.sh [--size 512MiB] [--dir DIR]
#   bash scripts/gpu_check.sh --dry-run   # no GPU needed: the wheel installs offline into a
#                                         # throwaway directory, the preflight runs, the tests are
#                                         # collected (not run), the bench runs its CPU smoke mode
#   bash scripts/gpu_check.sh [--dry-run] --list   # prints the stages, their timeouts and commands
#
# PYTHON defaults to python3; FASTPERSIST_GPU_CHECK_WHEELS (where the wheel is) to target/wheels; OUT (where the logs go) to a new temporary directory. The
# checkpoints go to DIR/fastpersist-gpu-check (removed afterwards); DIR defaults to target/, on
# the checkout's own disk (a /tmp on tmpfs would take no O_DIRECT).
set -uo pipefail
cd "$(dirname "$0")/.."

mode=run
list_only=0
size=512MiB
dir="$PWD/target"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) mode=dry-run ;;
        --list) list_only=1 ;;
        --size) size="$2"; shift ;;
        --dir) dir="$2"; shift ;;
        *) echo "usage: $0 [--dry-run] [--list] [--size 512MiB] [--dir DIR]" >&2; exit 2 ;;
    esac
    shift
done

STAGES=(install preflight tests bench)
declare -A LIMIT_S=([install]=20 [preflight]=40 [tests]=70 [bench]=210)
KILL_AFTER_S=5
# The test files that mention CUDA and the device path's; FASTPERSIST_GPU_CHECK=1 makes
# tests/conftest.py keep only their CUDA and device tests.
mapfile -t TEST_FILES < <({
    grep -rl --include='test_*.py' -i cuda tests | grep -v '/test_gpu_check\.py$'
    find tests -name 'test_device*.py'
} | LC_ALL=C sort -u)

export PYTHON="${PYTHON:-python3}" MODE="$mode" SIZE="$size" DIR="$dir/fastpersist-gpu-check" PYTHONUNBUFFERED=1
export TEST_FILES_LINE="${TEST_FILES[*]}" FASTPERSIST_GPU_CHECK=1
shopt -s nullglob
# Only a manylinux wheel: a plain linux_x86_64 one needs the glibc of the machine it was built on.
wheels=("${FASTPERSIST_GPU_CHECK_WHEELS:-target/wheels}"/fastpersist-*-abi3-manylinux*.whl)
shopt -u nullglob
WHEEL=""
[ ${#wheels[@]} -gt 0 ] && WHEEL="${wheels[-1]}"
export WHEEL

stage_install() {
    if [ -z "$WHEEL" ]; then
        echo "no manylinux wheel in target/wheels: run scripts/build_gpu_wheel.sh on a machine with Rust, then copy target/wheels along"
        return 1
    fi
    echo "installing $WHEEL into $SITE (offline)"
    if "$PYTHON" -m pip --version >/dev/null 2>&1; then
        # pip checks the wheel's tags (Python ABI, glibc) against this interpreter.
        PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install --quiet --no-deps --no-index --no-compile \
            --disable-pip-version-check --target "$SITE" "$WHEEL" || return
    else
        echo "no pip in $PYTHON: unpacking the wheel instead (its tags are not checked)"
        "$PYTHON" -m zipfile -e "$WHEEL" "$SITE" || return
    fi
    # The Python side comes from the checkout (a machine without Rust can still change it and
    # rerun); only the compiled extension must come from the wheel.
    if command -v diff >/dev/null; then
        diff -rq -x '*.so' -x __pycache__ -x '*.dist-info' python/fastpersist "$SITE/fastpersist" |
            sed 's/^/the checkout differs from the wheel (the checkout wins): /'
    fi
    tar -C python --exclude='*.so' --exclude=__pycache__ -cf - fastpersist | tar -C "$SITE" -xf - || return
    PYTHONPATH="$SITE" "$PYTHON" -c 'import fastpersist, fastpersist._core as c; print("imported", fastpersist.__file__, "backend", c.select_backend("auto"))' || return
    local built="" here
    [ -f "$(dirname "$WHEEL")/rust-sources.sha256" ] && built=$(cat "$(dirname "$WHEEL")/rust-sources.sha256")
    here=$(bash scripts/rust_sources_hash.sh)
    if [ "$built" != "$here" ]; then
        echo "STALE: rust/ differs from the sources the wheel's extension was built from (${built:-unknown}, now $here);"
        echo "the stages below run the older extension: rebuild with scripts/build_gpu_wheel.sh where Rust is installed"
        return 3
    fi
    echo "the wheel's extension was built from this checkout's rust/ ($here)"
}

stage_preflight() {
    local rc=0
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || rc=1
    else
        echo "nvidia-smi: not found"
    fi
    mkdir -p "$DIR" && df -T "$DIR" || rc=1
    local require=(--require-cuda)
    [ "$MODE" = dry-run ] && require=()
    "$PYTHON" benches/gpu_preflight.py --dir "$DIR" "${require[@]}" || rc=1
    return $rc
}

stage_tests() {
    local files
    read -r -a files <<<"$TEST_FILES_LINE"
    if [ "$MODE" = dry-run ]; then
        "$PYTHON" -m pytest --collect-only -q -p no:cacheprovider "${files[@]}"
        return
    fi
    local log rc
    log=$(mktemp)
    "$PYTHON" -m pytest -q -p no:cacheprovider -rs "${files[@]}" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    if grep -q "^SKIPPED.*needs a CUDA device" "$log"; then
        echo "FAIL: CUDA tests were skipped on a machine that should have a GPU"
        rc=1
    fi
    rm -f "$log"
    return "$rc"
}

stage_bench() {
    if [ "$MODE" = dry-run ]; then
        "$PYTHON" benches/gpu_check.py --device cpu --size 16MiB --reps 1 --dir "$DIR"
    else
        "$PYTHON" benches/gpu_check.py --size "$SIZE" --dir "$DIR"
    fi
}

describe() {
    case "$1:$MODE" in
        install:*) echo "install ${WHEEL:-<no wheel in target/wheels>} offline (pip --no-deps --no-index --target, or unzip) onto PYTHONPATH, the checkout's Python over it; check the Rust sources' hash" ;;
        preflight:dry-run) echo "nvidia-smi; df -T $DIR; $PYTHON benches/gpu_preflight.py --dir $DIR" ;;
        preflight:*) echo "nvidia-smi; df -T $DIR; $PYTHON benches/gpu_preflight.py --dir $DIR --require-cuda" ;;
        tests:dry-run) echo "FASTPERSIST_GPU_CHECK=1 $PYTHON -m pytest --collect-only $TEST_FILES_LINE" ;;
        tests:*) echo "FASTPERSIST_GPU_CHECK=1 $PYTHON -m pytest -rs $TEST_FILES_LINE (fails if a test that needs a CUDA device is skipped)" ;;
        bench:dry-run) echo "$PYTHON benches/gpu_check.py --device cpu --size 16MiB --reps 1 --dir $DIR" ;;
        bench:*) echo "$PYTHON benches/gpu_check.py --size $SIZE --dir $DIR" ;;
    esac
}

if [ "$list_only" = 1 ]; then
    total=0
    for stage in "${STAGES[@]}"; do
        echo "stage $stage, timeout ${LIMIT_S[$stage]} s: $(describe "$stage")"
        total=$((total + LIMIT_S[$stage] + KILL_AFTER_S))
    done
    echo "at most $total s in all"
    exit 0
fi

OUT="${OUT:-$(mktemp -d -t fp-gpu-check-logs.XXXXXX)}"
mkdir -p "$OUT"
# Not under $OUT: the installed package is thousands of files, and OUT may be copied back.
SITE=$(mktemp -d -t fp-gpu-check-site.XXXXXX)
export OUT SITE
trap 'rm -rf "$SITE" "$DIR"' EXIT
echo "gpu_check ($mode): logs in $OUT, checkpoints in $DIR, python $PYTHON"

declare -A status seconds
for stage in "${STAGES[@]}"; do
    if [ "$stage" != install ] && [ "${status[install]}" != 0 ] && [ "${status[install]}" != 3 ]; then
        status[$stage]=skipped
        seconds[$stage]=0
        continue
    fi
    echo "=== $stage (timeout ${LIMIT_S[$stage]} s): $(describe "$stage")"
    started=$SECONDS
    if [ "$stage" = install ]; then
        run_path=""
    else
        run_path="$SITE"
    fi
    PYTHONPATH="$run_path" timeout -k "$KILL_AFTER_S" "${LIMIT_S[$stage]}" \
        bash -c "$(declare -f "stage_$stage"); stage_$stage" 2>&1 | tee "$OUT/$stage.log"
    status[$stage]=${PIPESTATUS[0]}
    seconds[$stage]=$((SECONDS - started))
done

failed=0
echo "=== summary ($mode, --size $size): stage, exit status, seconds" >"$OUT/summary.txt"
for stage in "${STAGES[@]}"; do
    case "${status[$stage]}" in
        0) meaning=ok ;;
        3) meaning="installed, but the extension is older than rust/ in this checkout" ;;
        124 | 137) meaning="timed out after ${LIMIT_S[$stage]} s" ;;
        skipped) meaning="not run: the install failed" ;;
        *) meaning=failed ;;
    esac
    [ "${status[$stage]}" = 0 ] || failed=1
    printf '%-10s %-8s %4s s  %s\n' "$stage" "${status[$stage]}" "${seconds[$stage]}" "$meaning" >>"$OUT/summary.txt"
done
cat "$OUT/summary.txt"
exit $failed
