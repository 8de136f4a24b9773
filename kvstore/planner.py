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

from collections.abc import Mapping, Sequence
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
