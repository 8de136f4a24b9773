"""The load-or-recompute planner: never worse than recompute under its own model."""

from __future__ import annotations

import random

import pytest

from kvstore.errors import InvalidArgumentError
from kvstore.planner import BandwidthModel, plan

BPT = 128 * 1024  # Llama-3-8B bf16
T = 256


def test_fast_tier_loads_everything_but_the_last_token():
    p = plan(["host"] * 8, total_tokens=8 * T, block_tokens=T, bytes_per_token=BPT,
             prefill_tokens_per_s=10_000)
    assert p.load_blocks == 7  # the 8th block holds the last token: it is computed
    assert p.ttft_s < p.recompute_s


def test_slow_tier_is_not_worth_loading():
    # 0.5 GB/s against 10k tok/s x 128 KiB = 1.3 GB/s of recompute: loading loses
    p = plan(["remote"] * 8, 8 * T + 1, T, BPT, 10_000)
    assert p.load_blocks == 0
    assert p.ttft_s == pytest.approx(p.recompute_s)


def test_a_slow_block_is_loaded_when_fast_blocks_behind_it_pay_for_it():
    tiers = ["remote"] + ["host"] * 7
    p = plan(tiers, 8 * T + 1, T, BPT, 10_000)
    assert p.load_blocks == 8
    only_slow = plan(["remote"], 8 * T + 1, T, BPT, 10_000)
    assert only_slow.load_blocks == 0


def test_short_prompt_pays_no_fixed_cost_for_nothing():
    p = plan(["disk"], T + 1, T, 1024, 1e9, latency={"disk": 1.0})
    assert p.load_blocks == 0


def test_never_worse_than_recompute_and_optimal_among_prefixes():
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 12)
        tiers = [rng.choice(["host", "disk", "remote"]) for _ in range(n)]
        bw = {t: rng.uniform(0.1e9, 10e9) for t in ("host", "disk", "remote")}
        lat = {t: rng.uniform(0, 0.01) for t in ("host", "disk", "remote")}
        tps = rng.uniform(1e3, 5e4)
        total = n * T + rng.randint(1, T)
        p = plan(tiers, total, T, BPT, tps, bw, lat)
        assert p.ttft_s <= p.recompute_s + 1e-12
        for k in range(n + 1):  # brute force every prefix under the same model
            seen: set[str] = set()
            load = 0.0
            for t in tiers[:k]:
                load += T * BPT / bw[t] + (lat[t] if t not in seen else 0.0)
                seen.add(t)
            assert p.ttft_s <= load + (total - k * T) / tps + 1e-9


def test_unknown_tier_stops_the_plan():
    p = plan(["host", "tape", "host"], 3 * T + 1, T, BPT, 1_000, bandwidth={"tape": 0})
    assert p.load_blocks == 1


def test_bad_arguments():
    with pytest.raises(InvalidArgumentError, match="prefill_tokens_per_s"):
        plan(["host"], T, T, BPT, 0)


def test_bandwidth_model_moves_towards_observations():
    m = BandwidthModel()
    before = m.bandwidth["disk"]
    for _ in range(20):
        m.observe("disk", 1 << 30, (1 << 30) / 3e9 + m.latency["disk"])
    assert before < m.bandwidth["disk"]
    assert m.bandwidth["disk"] == pytest.approx(3e9, rel=0.02)
    m.observe("disk", 0, 1.0)  # ignored
    m.observe("new", 1e9, 1.0)
    assert m.bandwidth["new"] > 0
