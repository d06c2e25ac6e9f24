"""How much random testing a run does: hypothesis examples and campaign iterations.

tests/conftest.py loads a hypothesis profile (``HYPOTHESIS_PROFILE``: ``ci``, the default, or
``soak``); tests written for a CI budget ask :func:`examples` and :func:`iterations` for their
count, which the profile scales. ``ci`` is derandomized (a CI result replays exactly) and keeps
today's counts; ``soak`` draws fresh random seeds and runs ``SOAK_SCALE`` (default 20) times as
many examples (scripts/soak.sh).

Example:
    >>> examples(150) == 150 * SCALE
    True
"""

from __future__ import annotations

import os

from hypothesis import settings

#: Examples per test under the ``ci`` profile when a test does not say otherwise (hypothesis' own).
CI_EXAMPLES = 100
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "soak"):
    raise ValueError(f"HYPOTHESIS_PROFILE={PROFILE!r}: expected 'ci' or 'soak'")
SCALE = int(os.environ.get("SOAK_SCALE", "20")) if PROFILE == "soak" else 1
if SCALE < 1:
    raise ValueError(f"SOAK_SCALE={SCALE}: expected a positive integer")


def register_profiles() -> None:
    """Registers ``ci`` and ``soak`` and loads the one ``HYPOTHESIS_PROFILE`` names."""
    # No example database either way: a CI run depends on nothing left by an earlier one, and a
    # soak failure prints its @reproduce_failure blob (print_blob) to replay it.
    settings.register_profile("ci", derandomize=True, max_examples=CI_EXAMPLES, database=None, print_blob=True)
    settings.register_profile(
        "soak", derandomize=False, max_examples=CI_EXAMPLES * SCALE, database=None, print_blob=True
    )
    settings.load_profile(PROFILE)


def examples(ci_count: int) -> int:
    """The ``max_examples`` of a test that runs `ci_count` examples in CI, scaled by the profile."""
    return ci_count * SCALE


def iterations(env_var: str, ci_count: int) -> int:
    """A campaign's iteration count: `env_var` when set, else `ci_count` scaled by the profile."""
    value = os.environ.get(env_var)
    count = int(value) if value else ci_count * SCALE
    if count < 1:
        raise ValueError(f"{env_var}={value}: expected a positive integer")
    return count
