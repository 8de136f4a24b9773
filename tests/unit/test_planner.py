"""The load-or-recompute planner: never worse than recompute under its own model."""

from __future__ import annotations

import math
import random

import pytest

from kvstore.errors import InvalidArgumentError
from kvstore.planner import (
    DEFAULT_BANDWIDTH,
    BandwidthModel,
    PrefillModel,
    end_to_end_bandwidth,
    plan,
    serial_bandwidth,
)

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


def test_serial_bandwidth_is_the_harmonic_sum_of_its_legs():
    assert serial_bandwidth(2e9, 2e9) == pytest.approx(1e9)
    assert serial_bandwidth(1e9, None) == pytest.approx(1e9)
    assert serial_bandwidth(None, None) == math.inf
    assert serial_bandwidth(1e9, 0.0) == 0.0  # a leg that moves nothing stops it all


def test_end_to_end_bandwidth_adds_the_copy_to_every_tier_and_no_read_to_host():
    bw = end_to_end_bandwidth(["host", "disk", "disk", "remote"], {"disk": 2e9},
                              copy=2e9, consume=None)
    assert bw["host"] == pytest.approx(2e9)  # a pin: only the client's copy
    assert bw["disk"] == pytest.approx(1e9)  # read, then copy
    # an unmeasured tier reads at its prior
    assert bw["remote"] == pytest.approx(1 / (1 / DEFAULT_BANDWIDTH["remote"] + 1 / 2e9))
    with_consume = end_to_end_bandwidth(["host"], {}, copy=2e9, consume=2e9)
    assert with_consume["host"] == pytest.approx(1e9)
    assert "tape" not in end_to_end_bandwidth(["tape"], {})  # unknown: never planned
    assert end_to_end_bandwidth(["host"], {})["host"] == DEFAULT_BANDWIDTH["host"]


def test_a_throttled_disk_measured_by_the_daemon_turns_the_plan_to_recompute():
    tiers = ["disk"] * 8
    fast = plan(tiers, 8 * T + 1, T, BPT, 1_000, end_to_end_bandwidth(tiers, {"disk": 2e9}))
    slow = plan(tiers, 8 * T + 1, T, BPT, 1_000, end_to_end_bandwidth(tiers, {"disk": 50e6}))
    assert fast.load_blocks == 8
    assert slow.load_blocks == 0  # 50 MB/s < 1k tok/s x 128 KiB = 131 MB/s of recompute


def test_prefill_model_recovers_linear_plus_quadratic_cost():
    m = PrefillModel()
    assert m.tokens_per_s(100) is None
    a, b = 1e-3, 2e-7
    for n in (128, 512, 1024, 4096, 300):
        m.observe(n, a * n + b * n * n)
    fa, fb = m.coefficients()
    assert fa == pytest.approx(a, rel=1e-6)
    assert fb == pytest.approx(b, rel=1e-6)
    assert m.tokens_per_s(2048) == pytest.approx(1 / (a + b * 2048), rel=1e-6)
    # longer prompts prefill slower per token
    assert m.tokens_per_s(8192) < m.tokens_per_s(256)


def test_prefill_model_one_length_and_clamped_fits():
    m = PrefillModel()
    m.observe(1000, 2.0)
    m.observe(1000, 2.0)
    assert m.tokens_per_s(1000) == pytest.approx(500)
    m = PrefillModel()
    # cost per token falling with length would need b < 0: clamped to a non-negative fit
    m.observe(100, 1.0)
    m.observe(1000, 2.0)
    a, b = m.coefficients()
    assert a >= 0 and b >= 0
    assert m.seconds(1000) > 0
    m.observe(0, 1.0)  # ignored
    m.observe(10, -1.0)
    m.observe(10, math.inf)
    assert len(m.samples) == 2


def test_prefill_model_keeps_a_window():
    m = PrefillModel(window=4)
    for n in range(1, 10):
        m.observe(n * 100, n * 0.1)
    assert [n for n, _ in m.samples] == [600, 700, 800, 900]
    assert m.tokens_per_s(800) == pytest.approx(1000)
