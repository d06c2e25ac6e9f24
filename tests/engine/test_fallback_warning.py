"""A write that falls back from the backend asked for (io_uring blocked here) says why once per
process, whichever save path started it (fastpersist.engine.start_write)."""

from __future__ import annotations

import logging
import warnings

import pytest

from fastpersist.engine import writes


class FallenBack:
    fallback_reason = "io_uring is blocked here (seccomp): the thread pool writes instead"


def test_a_fallback_is_warned_once_per_process(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(writes._core, "start_write", lambda request: FallenBack())
    monkeypatch.setattr(writes, "_warned_fallback", False)
    with caplog.at_level(logging.WARNING, logger="fastpersist"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert isinstance(writes.start_write(object()), FallenBack)  # type: ignore[arg-type]
    assert [str(w.message) for w in caught if w.category is RuntimeWarning] == [FallenBack.fallback_reason]
    assert [r.getMessage() for r in caplog.records] == [FallenBack.fallback_reason]
