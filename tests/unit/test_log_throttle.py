"""`LogThrottle`: the first event logged at once, later ones summarised at most every N s,
and every event counted whether logged or not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import kvstore.client.backoff as backoff
from kvstore.client.backoff import LogThrottle


def test_first_at_once_then_one_summary_per_period(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    # The module's own clock only: patching time.monotonic would stop it for everything.
    monkeypatch.setattr(backoff, "time", SimpleNamespace(monotonic=lambda: now[0]))
    t = LogThrottle(60.0)
    assert t.first and t.count()
    assert t.logged() == (1, 0.0)
    assert not t.first
    for _ in range(4):  # within the period: counted, not due
        now[0] += 10.0
        assert not t.count()
    now[0] += 25.0  # 65 s after the first line
    assert t.count()
    assert t.logged() == (5, pytest.approx(65.0))  # the five since the first line
    assert t.total == 6 and t.pending == 0
    now[0] += 1.0
    assert not t.count() and t.pending == 1 and t.total == 7
