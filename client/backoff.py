"""Failure handling shared by the client's calls: log once per outage, back off with jitter.

While the daemon is unreachable, calls return a miss at once instead of waiting out a deadline
each; the first call after the backoff window probes again.
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


class Breaker:
    """Tracks an outage: when to probe again, and whether it has been logged."""

    def __init__(self, policy: BackoffPolicy, log: logging.Logger, target: str) -> None:
        self.policy = policy
        self.log = log
        self.target = target
        self.failures = 0
        self.retry_at = 0.0
        self._rng = random.Random()

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

    def success(self) -> None:
        if self.failures:
            self.log.info("kvstore daemon at %s is back after %d failed calls", self.target,
                          self.failures)
        self.failures = 0
