"""A circuit breaker for a tier behind a network: after a failure, skip it for a while.

A dead or partitioned Redis would otherwise cost every call its full timeout. Once a call fails
the breaker opens: calls are refused at once (the caller serves a miss) until a jittered window
has passed, then one call probes; its success closes the breaker, its failure reopens it with a
doubled window, up to a cap. Runs on the event-loop thread only, so it needs no lock.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable


class CircuitBreaker:
    """Closed (calls pass), open (calls refused) or probing (one call passes to test)."""

    def __init__(self, name: str, retry_s: float, max_retry_s: float, probe_timeout_s: float,
                 log: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.retry_s = retry_s
        self.max_retry_s = max(retry_s, max_retry_s)
        # A probe whose caller was cancelled never reports back; past this age another may go.
        self.probe_timeout_s = probe_timeout_s
        self.log = log
        self.clock = clock
        self.opens = 0  # times the breaker went from closed to open
        self.skipped = 0  # calls refused while open
        self._window = 0.0
        self._open_until: float | None = None
        self._probe_since: float | None = None
        self._rng = random.Random()

    @property
    def is_open(self) -> bool:
        return self._open_until is not None

    def allow(self) -> bool:
        """Whether a call may go to the tier now; counts the refusals."""
        if self._open_until is None:
            return True
        now = self.clock()
        probing = self._probe_since is not None and now - self._probe_since < self.probe_timeout_s
        if now < self._open_until or probing:
            self.skipped += 1
            return False
        self._probe_since = now
        return True

    def wait_s(self) -> float:
        """Seconds until a call may go (0 when closed or a probe is due), for background work
        that would rather wait than be refused."""
        if self._open_until is None:
            return 0.0
        return max(0.0, self._open_until - self.clock())

    def success(self) -> None:
        if self._open_until is not None:
            self.log.info("%s is back; calls go to it again", self.name)
        self._open_until = self._probe_since = None
        self._window = 0.0

    def failure(self, what: str) -> None:
        if self._open_until is None:
            self.opens += 1
            self._window = self.retry_s
            self.log.warning("%s failed (%s); serving misses for %.2f s before trying again",
                             self.name, what, self._window)
        else:
            self._window = min(self.max_retry_s, self._window * 2)
            self.log.debug("%s still failing (%s); next try in %.2f s", self.name, what,
                           self._window)
        # Jitter, so daemons sharing one cluster do not all probe it at the same instant.
        self._open_until = self.clock() + self._window * (1 - 0.25 * self._rng.random())
        self._probe_since = None
