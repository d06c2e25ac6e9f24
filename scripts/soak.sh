#!/usr/bin/env bash
# The soak: every hypothesis suite under the "soak" profile (fresh random seeds, SOAK_SCALE times
# the CI examples; tests/helpers/budget.py) and the kill -9 and damage campaigns at SOAK_SCALE times
# their CI counts, then a summary of what ran: tests, examples, kills, damages. Run it before
# resolving anything found by randomized testing; CI (scripts/test.sh) runs the derandomized
# "ci" profile instead. SOAK_SCALE=20 (the default) takes about 10 minutes on a 2-core VM (it scales
# linearly: SOAK_SCALE=1 took 35 s, 1,950 examples, 52 kills, 846 damages; SOAK_SCALE=2 58 s).
# A failure prints its replay: FASTPERSIST_TEST_SEED=... for the campaigns, and hypothesis'
# @reproduce_failure blob; rerun with HYPOTHESIS_SEED=... to replay the whole hypothesis part.
set -uo pipefail
cd "$(dirname "$0")/.."

export HYPOTHESIS_PROFILE=soak
export SOAK_SCALE="${SOAK_SCALE:-20}"
export FASTPERSIST_TEST_SEED="${FASTPERSIST_TEST_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}"
HYPOTHESIS_SEED="${HYPOTHESIS_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}"
mapfile -t suites < <(grep -rl --include='test_*.py' '^@given' tests | sort)
campaigns=(
    "tests/saving/test_crash.py::test_kill_9_at_random_moments_never_loses_the_newest_committed_step"
    "tests/saving/test_crash.py::test_kill_9_during_plain_saves_then_clean_removes_every_leftover"
    "tests/format/test_integrity.py::test_every_damage_anywhere_is_detected_by_verify_and_load"
)
log="$(mktemp -t fastpersist-soak.XXXXXX)"
echo "soak: SOAK_SCALE=$SOAK_SCALE HYPOTHESIS_SEED=$HYPOTHESIS_SEED FASTPERSIST_TEST_SEED=$FASTPERSIST_TEST_SEED"
echo "soak: hypothesis suites ${suites[*]}; log $log"
start=$SECONDS
python3 -m pytest -q -s -p no:cacheprovider --hypothesis-show-statistics --hypothesis-seed="$HYPOTHESIS_SEED" \
    "${suites[@]}" "${campaigns[@]}" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}

python3 - "$log" "$((SECONDS - start))" <<'PY'
import re, sys

text = open(sys.argv[1]).read()


def total(pattern: str) -> int:
    return sum(int(n) for n in re.findall(pattern, text))


outcome = re.findall(r"^(?:=+ )?(\d+ (?:passed|failed|errors?)\b.*?) in [0-9.]+s", text, re.M)
generated = re.findall(r"during generate phase.*\n.*\n\s*- (\d+) passing, (\d+) failing", text)
passing, failing = sum(int(p) for p, _ in generated), sum(int(f) for _, f in generated)
kills = total(r"kill -9 campaign \(seed \d+\): (\d+) kills survived")
plain_kills = total(r"plain-save kills: (\d+) survived")
damages = re.findall(r"corruption campaign \(([a-z_]+), seed \d+\): (\d+)/(\d+) damages", text)
print(f"soak summary ({sys.argv[2]} s): {outcome[-1] if outcome else 'pytest printed no outcome'}")
print(f"  hypothesis examples generated: {passing} passing, {failing} failing, over {len(generated)} tests")
print(f"  kill -9: {kills} checkpointer kills and {plain_kills} plain-save kills survived")
print("  damages detected: " + (", ".join(f"{b} {d}/{c}" for b, d, c in damages) or "none ran"))
PY
exit "$status"
