"""Cancellation at random points: engines abandon fetches and publishes mid-call.

Several tasks share two clients (one copying through shared memory, one streaming) and call
them under `asyncio.wait_for` with random timeouts from 0.2 ms to 20 ms, so calls are cancelled
before they are sent, while the daemon works, while bytes are copied, and while leases are
released; some clients also have deadlines that short. Every prompt has its own values.
Pass:
- every completed fetch returned exactly its own prompt's bytes (no response reached the
  wrong caller, no half-copied block was reported);
- a cancelled fetch writes nothing into the caller's tensor after it returned (its copy is
  stopped and waited for before the lease goes back);
- no cancelled publish corrupted anything: afterwards every prompt reads back byte-identical
  or misses;
- nothing stays in flight: Stats shows no lease, no pinned block and no RPC within the lease
  timeout; usage stays within capacity throughout.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

import kvstore.client.aio
from kvstore.client import AsyncKVClient, KVClient
from kvstore.client.backoff import BackoffPolicy
from kvstore.layout import KVLayout
from tests.conftest import random_kv, same_bytes, small_layout
from tests.reliability import CapacityWatch, soak_record, soak_seconds, stats, wait_quiescent

# Random cancellation points race real timers: a rerun absorbs a noisy neighbour on 2 cores.
pytestmark = [pytest.mark.fault, pytest.mark.integration,
              pytest.mark.flaky(reruns=2, reruns_delay=1)]
LEASE_S = 2.0
CANARY = 0xA5
MIN_CANCELLED, MIN_HITS = 60, 25


def _layout() -> KVLayout:
    return small_layout(num_layers=8, num_kv_heads=4, head_dim=64)  # 256 KiB blocks


def _more(until: float, counts: dict[str, int]) -> bool:
    """Run until `until`, and on a starved machine on until enough happened (up to 30 s)."""
    now = time.monotonic()
    return now < until or (now < until + 30 and (counts["cancelled"] < MIN_CANCELLED
                                                  or counts["hits"] < MIN_HITS))


async def _worker(seed: int, clients: list[AsyncKVClient], prompts, values, until: float,
                  counts: dict[str, int]) -> None:
    rng = random.Random(seed)
    layout = clients[0].layout
    buf = torch.empty(layout.kv_shape(64), dtype=layout.torch_dtype)
    while _more(until, counts):
        c = rng.choice(clients)
        p = rng.randrange(len(prompts))
        timeout = rng.choice((None, rng.uniform(0.0002, 0.02)))
        counts["ops"] += 1
        if rng.random() < 0.35:
            try:
                await asyncio.wait_for(c.publish(prompts[p], values[p]), timeout)
            except TimeoutError:
                counts["cancelled"] += 1
            continue
        buf.view(torch.uint8).fill_(CANARY)
        try:
            n, got = await asyncio.wait_for(c.fetch(prompts[p], into=buf), timeout)
        except TimeoutError:
            counts["cancelled"] += 1
            after = buf.clone()
            await asyncio.sleep(0.003)  # a copy still running would land now
            counts["late_writes"] += not same_bytes(buf, after)
            continue
        if n:
            counts["hits"] += 1
            blocks = got.unflatten(2, (n // 16, 16)).permute(2, 0, 1, 3, 4, 5)
            canary = any(bool((b.contiguous().view(torch.uint8) == CANARY).all()) for b in blocks)
            counts["wrong"] += canary or not same_bytes(got, values[p][:, :, :n])


async def _load(target: str, layout: KVLayout, prompts, values, seconds: float,
                counts: dict[str, int]) -> None:
    fast = BackoffPolicy(initial_s=0.001, maximum_s=0.01)  # keep calling through timeouts
    clients = [AsyncKVClient(target, layout, transfer="shm", backoff=fast),
               AsyncKVClient(target, layout, transfer="stream", backoff=fast),
               AsyncKVClient(target, layout, transfer="shm", deadline_s=0.004, backoff=fast)]
    until = time.monotonic() + seconds
    try:
        await asyncio.gather(*(_worker(s, clients, prompts, values, until, counts)
                               for s in range(6)))
    finally:
        for c in clients:
            await c.close()


def test_random_cancellation_leaks_nothing_and_misdelivers_nothing(daemon_factory, monkeypatch):
    # One block per copy piece, so a cancelled copy is stopped between blocks.
    monkeypatch.setattr(kvstore.client.aio, "COPY_PIECE_BYTES", 256 << 10)
    d = daemon_factory("--host-bytes", "4MiB", "--disk-bytes", "16MiB",
                       "--lease-timeout-s", str(LEASE_S)).start()
    layout = _layout()
    prompts = [[p * 1000 + t for t in range(64)] for p in range(12)]  # 4 blocks, 1 MiB each
    values = [random_kv(layout, 64, seed=p) for p in range(12)]
    counts = dict.fromkeys(("ops", "cancelled", "hits", "wrong", "late_writes"), 0)
    with CapacityWatch(d) as watch:
        asyncio.run(_load(d.target, layout, prompts, values, soak_seconds(4.0), counts))
        quiet = wait_quiescent(d.target, LEASE_S + 1.5)
    watch.check()
    with KVClient(d.target, layout, deadline_s=5) as c:
        for tokens, kv in zip(prompts, values, strict=True):
            n, got = c.fetch(tokens)
            counts["hits"] += n > 0
            counts["wrong"] += n > 0 and not same_bytes(got, kv[:, :, :n])
    final = wait_quiescent(d.target, 2)
    soak_record("cancellation", operations=counts["ops"], faults=counts["cancelled"],
                hits=counts["hits"], wrong=counts["wrong"], late_writes=counts["late_writes"],
                expired_leases=final.expired_leases)
    assert counts["wrong"] == 0
    assert counts["late_writes"] == 0
    assert counts["cancelled"] >= MIN_CANCELLED, counts
    assert counts["hits"] >= MIN_HITS, counts
    assert quiet.integrity_failures == 0
    assert stats(d.target).active_leases == 0
