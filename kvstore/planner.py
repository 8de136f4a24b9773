"""Load or recompute: how many cached prefix blocks are worth loading, and from where.

A cached block only helps when loading it is faster than recomputing it. With a prefill speed
of `P` tokens/s and `B` bytes per token, a block of `T` tokens from a tier that delivers `W`
bytes/s saves `T/P - T*B/W` seconds (positive iff `W > B*P`). Blocks form a prefix, so block
`i` can only be used if blocks `0..i-1` are loaded too: the plan is the prefix length `k` that
maximises the summed saving minus a fixed cost per tier touched (a round trip, a lease).
The model is linear in tokens; attention's quadratic term makes recompute of long suffixes
slower than modelled, so the planner errs towards recomputing (the safe side).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvstore.errors import InvalidArgumentError

# Priors until a tier has been measured: bytes/s end to end into the engine's memory, and
# seconds of fixed cost per call that touches the tier. Deliberately conservative.
DEFAULT_BANDWIDTH: dict[str, float] = {"gpu": 100e9, "host": 5e9, "disk": 1e9, "remote": 0.5e9}
DEFAULT_LATENCY: dict[str, float] = {"gpu": 1e-4, "host": 5e-4, "disk": 2e-3, "remote": 2e-3}


@dataclass(frozen=True)
class Plan:
    load_blocks: int  # blocks of the cached prefix to load (the rest is recomputed)
    load_tokens: int
    tiers: tuple[str, ...]  # the tier of each block to load
    load_s: float  # estimated time to load them
    compute_s: float  # estimated time to prefill the rest
    recompute_s: float  # estimated time to prefill everything

    @property
    def ttft_s(self) -> float:
        return self.load_s + self.compute_s


@dataclass
class BandwidthModel:
    """Per-tier bandwidth, updated online from observed transfers (an EWMA)."""

    bandwidth: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_BANDWIDTH))
    latency: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_LATENCY))
    alpha: float = 0.3  # weight of the newest observation

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        """Fold in one transfer of `nbytes` from `tier` that took `seconds` end to end."""
        if nbytes <= 0 or seconds <= 0:
            return
        fixed = self.latency.get(tier, 0.0)
        rate = nbytes / max(seconds - fixed, seconds * 0.1)
        old = self.bandwidth.get(tier)
        self.bandwidth[tier] = rate if old is None else (1 - self.alpha) * old + self.alpha * rate


def plan(
    tiers: Sequence[str],
    total_tokens: int,
    block_tokens: int,
    bytes_per_token: int,
    prefill_tokens_per_s: float,
    bandwidth: Mapping[str, float] | None = None,
    latency: Mapping[str, float] | None = None,
) -> Plan:
    """Best prefix to load, given the tier of each cached block (in prefix order).

    At least one token is always computed (the first output token's logits need it), so at most
    `(total_tokens - 1) // block_tokens` blocks are considered.
    """
    if prefill_tokens_per_s <= 0:
        raise InvalidArgumentError(f"prefill_tokens_per_s must be positive, got "
                                   f"{prefill_tokens_per_s}")
    if block_tokens <= 0 or bytes_per_token <= 0 or total_tokens < 0:
        raise InvalidArgumentError("block_tokens and bytes_per_token must be positive")
    bw = {**DEFAULT_BANDWIDTH, **(bandwidth or {})}
    lat = {**DEFAULT_LATENCY, **(latency or {})}
    usable = min(len(tiers), max(total_tokens - 1, 0) // block_tokens)
    per_block_compute = block_tokens / prefill_tokens_per_s
    block_bytes = block_tokens * bytes_per_token
    best_k, best_gain, gain, load_s = 0, 0.0, 0.0, 0.0
    best_load = 0.0
    touched: set[str] = set()
    for i in range(usable):
        tier = tiers[i]
        rate = bw.get(tier)
        if rate is None or rate <= 0:
            break  # an unknown tier: never plan a load from it
        cost = block_bytes / rate + (lat.get(tier, 0.0) if tier not in touched else 0.0)
        touched.add(tier)
        load_s += cost
        gain += per_block_compute - cost
        if gain > best_gain:
            best_k, best_gain, best_load = i + 1, gain, load_s
    recompute = total_tokens / prefill_tokens_per_s
    compute = (total_tokens - best_k * block_tokens) / prefill_tokens_per_s
    return Plan(best_k, best_k * block_tokens, tuple(tiers[:best_k]), best_load, compute,
                recompute)


TRANSFER_SLACK = 4.0
"""A transfer with no recompute budget may run this many times slower than its bandwidth
says before it is given up (a busy host, a cold page cache, a daemon sharing the cores)."""


def transfer_deadline(nbytes: int, bandwidth: float, base_s: float,
                      budget_s: float | None = None) -> float:
    """Seconds a transfer of `nbytes` at `bandwidth` bytes/s may take before it is given up.

    A call that moves bytes is not held to a control call's deadline `base_s`: it gets
    `base_s` plus its bytes' time. With `budget_s` (the seconds recomputing what it carries
    would take), it goes on as long as finishing it can still beat recomputing: `budget_s`,
    but never less than the bytes' time at `bandwidth`. Without one, `TRANSFER_SLACK` times
    the bytes' time.
    """
    if nbytes < 0 or not bandwidth > 0 or not base_s > 0:
        raise InvalidArgumentError(f"transfer_deadline: nbytes >= 0, bandwidth > 0 and "
                                   f"base_s > 0, got {nbytes}, {bandwidth}, {base_s}")
    expected = nbytes / bandwidth
    if budget_s is not None and math.isfinite(budget_s):
        return max(budget_s, base_s + expected)
    return base_s + TRANSFER_SLACK * expected


def serial_bandwidth(*legs: float | None) -> float:
    """Bytes/s of a transfer made of legs that run one after another (each byte goes through
    every leg): the harmonic sum. A leg of None costs nothing; no costly leg at all is
    infinitely fast."""
    inverse = sum(1.0 / leg for leg in legs if leg is not None and leg > 0)
    if any(leg is not None and leg <= 0 for leg in legs):
        return 0.0  # a leg that moves nothing stops the whole transfer
    return 1.0 / inverse if inverse else math.inf


def end_to_end_bandwidth(tiers: Iterable[str], read: Mapping[str, float],
                         copy: float | None = None, consume: float | None = None,
                         ) -> dict[str, float]:
    """Bytes/s from each tier into the engine, as three legs in series.

    - `read`: the daemon's measured read into its staging memory, per tier. Host hits are
      pinned in place (zero copy), so the host tier has no read leg; a tier the daemon has not
      measured yet uses its prior (`DEFAULT_BANDWIDTH`), and a tier with neither is left out
      (`plan` never loads from it).
    - `copy`: the client's own copy out of the daemon's memory (or its receive, over TCP),
      which every block pays whatever its tier; None: the host prior.
    - `consume`: the engine taking the copied blocks into its own cache (a layout conversion);
      None: free.

    In series is the conservative reading: a same-node fetch of a long prompt overlaps the
    daemon's reads of one window with the client's copy of the previous one, so it approaches
    its slowest leg. The estimate then errs towards recomputing.
    """
    copy_leg = copy if copy is not None else DEFAULT_BANDWIDTH["host"]
    out: dict[str, float] = {}
    for tier in set(tiers):
        if tier == "host":
            out[tier] = serial_bandwidth(copy_leg, consume)
            continue
        leg = read.get(tier) or DEFAULT_BANDWIDTH.get(tier)
        if leg is None:
            continue
        out[tier] = serial_bandwidth(leg, copy_leg, consume)
    return out


@dataclass
class PrefillModel:
    """An engine's prefill time as a function of prompt length, fitted online from its own
    full recomputes: `t(n) = a*n + b*n^2` (the linear layers, and attention's quadratic term).

    Least squares on relative error (each sample weighted by `1/t`), so short and long prompts
    count alike, over the last `window` samples, with `a, b >= 0`. The per-call overhead of a
    forward pass is not modelled apart: a cached prefill pays it too, so it is not a saving.
    """

    window: int = 32
    samples: deque[tuple[int, float]] = field(default_factory=deque)
    """Full prefills: (prompt tokens, seconds)."""
    spans: deque[tuple[int, int, float]] = field(default_factory=deque)
    """Parts of prefills (chunked prefill): (first token, end, seconds) of a forward pass that
    computed tokens `[first, end)` with the ones before already in the cache."""

    def observe(self, tokens: int, seconds: float) -> None:
        """Fold in one forward pass over `tokens` prompt tokens (nothing cached) that took
        `seconds`."""
        if tokens <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        self.samples.append((tokens, seconds))
        while len(self.samples) > self.window:
            self.samples.popleft()

    def observe_span(self, start: int, end: int, seconds: float) -> None:
        """Fold in one forward pass that computed tokens `[start, end)` of a prompt whose first
        `start` tokens were cached: `t(end) - t(start)` in the model."""
        if start == 0:
            self.observe(end, seconds)
            return
        if not 0 < start < end or seconds <= 0 or not math.isfinite(seconds):
            return
        self.spans.append((start, end, seconds))
        while len(self.spans) > self.window:
            self.spans.popleft()

    def _rows(self) -> list[tuple[int, int, float]]:
        return [(0, n, t) for n, t in self.samples] + list(self.spans)

    def coefficients(self) -> tuple[float, float] | None:
        """`(a, b)`, or None before the first sample."""
        rows = self._rows()
        if not rows:
            return None
        # Rows divided by t: minimise sum(((a*dn + b*dn2) - t) / t)^2, where dn = end - start
        # and dn2 = end^2 - start^2 (t(end) - t(start); a full prefill starts at 0).
        xs = [((e - s) / t, (e * e - s * s) / t) for s, e, t in rows]
        s11 = sum(x * x for x, _ in xs)
        s12 = sum(x * y for x, y in xs)
        s22 = sum(y * y for _, y in xs)
        r1 = sum(x for x, _ in xs)
        r2 = sum(y for _, y in xs)
        det = s11 * s22 - s12 * s12
        if len({(s, e) for s, e, _ in rows}) >= 2 and det > 1e-12 * s11 * s22:
            a = (r1 * s22 - r2 * s12) / det
            b = (r2 * s11 - r1 * s12) / det
            if a >= 0 and b >= 0:
                return a, b
        # One length, or a fit that wants a negative term: the better of the one-term fits.
        linear = (r1 / s11, 0.0)
        quadratic = (0.0, r2 / s22)
        return min(linear, quadratic, key=self._residual)

    def _residual(self, ab: tuple[float, float]) -> float:
        a, b = ab
        return sum(((a * (e - s) + b * (e * e - s * s)) - t) ** 2 / (t * t)
                   for s, e, t in self._rows())

    def seconds(self, tokens: int) -> float | None:
        """Predicted time to prefill `tokens` tokens from nothing; None before any sample."""
        ab = self.coefficients()
        if ab is None:
            return None
        return ab[0] * tokens + ab[1] * tokens * tokens

    def tokens_per_s(self, tokens: int) -> float | None:
        """The average prefill speed over a prompt of `tokens` tokens (what `plan` takes)."""
        t = self.seconds(tokens)
        return tokens / t if t else None
