"""Failure handling shared by the client's calls: log once per outage, back off with jitter,
and probe cheaply for the daemon's return.

While the daemon is unreachable, calls return a miss at once instead of waiting out a deadline
each. A daemon that is gone (connection refused: stopped, restarting) is probed with a small
`Info` call every `probe_s`, so calls resume as soon as it answers again rather than after a
backoff that grew during a long restart; a daemon that is there but slow (calls past their
deadline) is only retried after the backoff, since each retry costs a deadline.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class BackoffPolicy:
    initial_s: float = 0.05
    maximum_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.5  # each delay is scaled by a random factor in [1 - jitter, 1]
    probe_s: float = 0.1  # while the daemon is gone: seconds between cheap probes


class Breaker:
    """Tracks an outage: when to try again, and whether it has been logged."""

    def __init__(self, policy: BackoffPolicy, log: logging.Logger, target: str) -> None:
        self.policy = policy
        self.log = log
        self.target = target
        self.failures = 0
        self.retry_at = 0.0
        self._rng = random.Random()

    @property
    def open(self) -> bool:
        """An outage is under way (calls may still be let through to probe it)."""
        return self.failures > 0

    def allow(self) -> bool:
        return self.failures == 0 or time.monotonic() >= self.retry_at

    def failure(self, what: str) -> None:
        if self.failures == 0:
            self.log.warning("kvstore daemon at %s unavailable (%s); serving misses until it "
                             "is back", self.target, what)
        else:
            self.log.debug("kvstore daemon still unavailable: %s", what)
        p = self.policy
        delay = min(p.maximum_s, p.initial_s * p.multiplier ** min(self.failures, 30))
        delay *= 1 - p.jitter * self._rng.random()
        self.failures += 1
        self.retry_at = time.monotonic() + delay

    def answered(self) -> None:
        """A probe got an answer: let the next call through now (it ends the outage if it
        succeeds; if it fails, the backoff resumes from where it was)."""
        self.retry_at = time.monotonic()

    def success(self) -> None:
        if self.failures:
            self.log.info("kvstore daemon at %s is back after %d failed calls", self.target,
                          self.failures)
        self.failures = 0


class LogThrottle:
    """Counts a repeated event (a dropped save, a failed load) and says when to log it: the
    first at once, later ones as one summary line at most every `every_s` seconds, since a
    broken path can fire on every request."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.total = 0
        self.pending = 0  # events since the last line
        self._logged_at: float | None = None

    @property
    def first(self) -> bool:
        """Nothing logged yet: the next line is the first."""
        return self._logged_at is None

    def count(self) -> bool:
        """Counts one event; whether a line is due now."""
        self.total += 1
        self.pending += 1
        return self._logged_at is None or time.monotonic() - self._logged_at >= self.every_s

    def logged(self) -> tuple[int, float]:
        """Marks a line written: the events it covers, and seconds since the previous line."""
        now = time.monotonic()
        since = 0.0 if self._logged_at is None else now - self._logged_at
        covered, self._logged_at, self.pending = self.pending, now, 0
        return covered, since
