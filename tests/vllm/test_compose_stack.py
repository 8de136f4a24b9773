"""docker-compose.yml's services, run natively with exactly their flags (tests/vllm/compose.py):
redis, the model, the daemon and vLLM's OpenAI server. Long prompts are cached and served
again, from the daemon's host tier and, after the daemon loses its local tiers, from the
remote tier (issue 12 item 3).

Per prompt length `L = k*128 + 1` (whole vLLM blocks plus one token), through the OpenAI API:
1. the prompt, cold: vLLM computes it, the connector saves its `k` blocks;
2. again: vLLM's own prefix cache serves `k` blocks and computes the last token;
3. after `POST /reset_prefix_cache`: kvstore serves the `k` blocks, vLLM computes the last
   token. Its tokens and top-2 log-probabilities equal run 2's: both computed exactly one
   token over the same cached prefix. (A full prefill, run 1, computes in another order and
   differs from both in the last bits: it is reported, not asserted; at 16,001 tokens its
   8 greedy tokens differed from the cached runs' once.)
Then the daemon is stopped, its data volume emptied and the same command started again: a
new machine of the fleet. Run 3 again: the blocks come from redis.

Prompt lengths: `KVTEST_COMPOSE_LENGTHS` (default 2049,8193,16001). Each cold prompt is a
full prefill of the compose model (16 layers, float32), which dominates the test's time and
grows with the square of the length (here, 2 cores: 34 s, 278 s and 1,019 s while other tests
shared the cores): a length whose cold prefill, extrapolated from the shorter ones measured
here, would overrun `KVTEST_COMPOSE_BUDGET_S` (default 2700 s in all) is not sent, and the
test then ends as skipped, naming what it did and did not run.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run `bash scripts/setup_vllm.sh`",
                allow_module_level=True)

from tests.vllm.compose import MODEL_NAME, Native, Service, http, services, stack

pytestmark = [pytest.mark.vllm, pytest.mark.integration]
BLOCK = 128  # the compose file's --block-size
LENGTHS = [int(n) for n in os.environ.get("KVTEST_COMPOSE_LENGTHS",
                                           "2049,8193,16001").split(",")]
MAX_TOKENS = 8
REQUEST_S = 3600.0  # one request at most (a cold 16k-token prefill on 2 slow cores)
BUDGET_S = float(os.environ.get("KVTEST_COMPOSE_BUDGET_S", "2700"))
LOGPROB_TOL = 1e-4  # runs 2 and 3 compute the same token over the same bytes


def prompt(n: int) -> list[int]:
    rng = random.Random(n)
    return [rng.randrange(3, 32000) for _ in range(n)]


def complete(native: Native, ids: list[int]) -> dict[str, Any]:
    """One greedy completion with the token ids and top-2 log-probabilities of each step
    (`return_tokens_as_token_ids`: with --skip-tokenizer-init vLLM cannot name tokens)."""
    body = {"model": native.path(f"/models/{MODEL_NAME}"), "prompt": ids,
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 2, "return_tokens_as_token_ids": True}
    began = time.monotonic()
    choice = http(native.url + "/v1/completions", body, timeout=REQUEST_S)["choices"][0]
    lp = choice["logprobs"]
    return {"tokens": choice["token_ids"], "top": lp["top_logprobs"],
            "logprobs": lp["token_logprobs"], "seconds": time.monotonic() - began}


def daemon_stats(native: Native) -> Any:
    import torch

    from kvstore.client import KVClient
    from kvstore.layout import KVLayout

    layout = KVLayout(model="stats", num_layers=1, num_kv_heads=1, head_dim=8,
                      dtype=torch.float32, block_tokens=16)  # Stats ignores the layout
    with KVClient(f"unix://{native.socket}", layout, deadline_s=10) as c:
        stats = c.stats()
    if stats is None:
        raise AssertionError("the daemon did not answer Stats")
    return stats


def rpc_counts(native: Native) -> dict[str, float]:
    """Served RPCs per method (code OK), from the daemon's Prometheus endpoint."""
    url = f"http://127.0.0.1:{native.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvstore_rpc_seconds_count{") and 'code="OK"' in line:
            method = line.split('method="', 1)[1].split('"', 1)[0]
            counts[method] = float(line.rsplit(" ", 1)[1])
    return counts


def same_output(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert got["tokens"] == want["tokens"], f"{what}: tokens {got['tokens']} != {want['tokens']}"
    for step, (a, b) in enumerate(zip(got["top"], want["top"], strict=True)):
        assert a.keys() == b.keys(), f"{what}: step {step} top-2 {a} != {b}"
        worst = max(abs(a[t] - b[t]) for t in a)
        assert worst <= LOGPROB_TOL, f"{what}: step {step} log-probabilities {a} != {b}"


def reset(native: Native) -> None:
    # Saves still running hold their blocks: vLLM resets once they are done.
    deadline = time.monotonic() + 120
    while True:
        try:
            http(native.url + "/reset_prefix_cache", {})
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def wait_written_through(native: Native, blocks: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        remote = daemon_stats(native).remote
        if remote.written_blocks >= blocks and remote.queue_depth == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"write-through did not finish: {remote}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def compose() -> Iterator[tuple[Native, dict[str, Service]]]:
    if "redis" not in services():
        pytest.skip("docker-compose.yml has no redis service")
    native = Native(Path(tempfile.mkdtemp(prefix="kvc-", dir="/tmp")))  # short socket paths
    # Test-only additions: the prefix-cache reset endpoint, and no 300 s limit on one step
    # (a cold 16k-token prefill on a slow 2-core machine takes longer).
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "3600"}
    try:
        with stack(native, remote=True, vllm_env=env) as started:
            yield native, started
    finally:
        shutil.rmtree(native.root, ignore_errors=True)  # gigabytes of blocks (16k tokens)


@pytest.mark.timeout(4 * 3600)
def test_long_prompts_hit_kvstore_through_the_openai_server(compose) -> None:
    native, started = compose
    outputs: dict[int, dict[str, Any]] = {}
    skipped: list[str] = []
    began = time.monotonic()
    for n in sorted(LENGTHS):
        assert (n - 1) % BLOCK == 0, "lengths are whole blocks plus one token"
        k = (n - 1) // BLOCK
        if outputs:  # attention makes a prefill grow with the square of the prompt
            last = max(outputs)
            estimate = outputs[last]["cold"]["seconds"] * (n / last) ** 2
            if time.monotonic() - began + estimate > BUDGET_S:
                skipped.append(f"{n} tokens (cold prefill estimated at {estimate:.0f} s)")
                continue
        ids = prompt(n)
        before = daemon_stats(native)
        cold = complete(native, ids)
        prefix_hit = complete(native, ids)  # vLLM's own prefix cache: k blocks
        reset(native)
        served = daemon_stats(native).hit_blocks
        warm = complete(native, ids)
        assert daemon_stats(native).hit_blocks - served == k, \
            f"{n} tokens: kvstore served {daemon_stats(native).hit_blocks - served} of {k} " \
            f"blocks:\n{started['vllm'].log()}"
        same_output(warm, prefix_hit, f"{n} tokens, kvstore load vs vLLM's prefix cache")
        after = daemon_stats(native)
        assert after.stored_blocks - before.stored_blocks >= k
        outputs[n] = {"cold": cold, "prefix": prefix_hit, "kvstore": warm}
        print(f"{n} tokens: cold {cold['seconds']:.1f} s, vLLM prefix cache "
              f"{prefix_hit['seconds']:.2f} s, kvstore {warm['seconds']:.2f} s; tokens equal "
              f"to the full prefill's: {warm['tokens'] == cold['tokens']}")
    lengths = sorted(outputs)
    counts = rpc_counts(native)
    assert counts.get("Commit", 0) == counts.get("Reserve", 0) > 0, counts
    stats = daemon_stats(native)
    assert stats.expired_leases == 0

    # The remote tier: the daemon comes back with empty local tiers (a new machine, the same
    # redis); every block of the prompts is served from redis.
    wait_written_through(native, sum((n - 1) // BLOCK for n in lengths))
    daemon = started["kvstore"]
    daemon.stop()
    for path in Path(native.path("/data")).iterdir():
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    started["kvstore"] = Service("kvstore", daemon.argv, native.root / "kvstore-2.log",
                                 {**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 60
    while not os.path.exists(native.socket):
        assert time.monotonic() < deadline, started["kvstore"].log()
        time.sleep(0.2)
    time.sleep(1.0)  # the engine's clients find the new daemon (they probe every 0.1 s)
    for n in lengths:
        k = (n - 1) // BLOCK
        reset(native)
        stats = daemon_stats(native)
        got = complete(native, prompt(n))
        after = daemon_stats(native)
        assert after.hit_blocks - stats.hit_blocks == k, \
            f"{n} tokens from redis: {after.hit_blocks - stats.hit_blocks} of {k} blocks"
        same_output(got, outputs[n]["prefix"], f"{n} tokens, remote tier vs vLLM's prefix cache")
    assert daemon_stats(native).remote.lookup_hits > 0
    if skipped:
        pytest.skip(f"passed for {lengths} tokens; not sent within the {BUDGET_S:.0f} s budget "
                    f"(KVTEST_COMPOSE_BUDGET_S): {', '.join(skipped)}")
