"""Overload at 3x capacity (item 11).

Capacity is the concurrency limit, `max_concurrent_rpcs` = C. The measured callers are C
same-node engines fetching random cached 4-block prompts through shared memory (the real
client, copying into their own tensors). The working set is twice the host tier, so most
fetches promote from disk, and disk reads are slowed to 5 ms each (the test-only knob): a
daemon overloads when its disk (or remote tier) is the bottleneck, and on this machine the
page cache is too fast, and the cores too shared with the callers, to get there for real.
"Unloaded" is the C callers alone: the daemon at its limit with nothing to refuse. Overload
adds 2C more callers in another process (3C in all), whose refused calls count as misses and
who recompute for 10 ms before their next request, as an engine would. The two alternate in 0.5 s
windows (the extra process stopped and continued), so that both see the same background
noise of a shared machine; p99s are over all windows of each kind.

Pass:
- the excess gets RESOURCE_EXHAUSTED (counted in Stats.shed_rpcs), and no other error;
- the admitted calls' p99 stays within `P99_BOUND` = 2x the unloaded p99 (the issue's
  bound; measured 1.3-1.5x on an idle 2-core machine, up to 1.98x while other work shared
  the cores, see docs/RELIABILITY.md; a rerun absorbs a noisy neighbour);
- memory stays within budget: host usage within capacity throughout, and the daemon's
  anonymous memory grows by less than `MEM_BUDGET` under overload;
- throughput recovers to 80% of the unloaded rate within 5 s of the overload ending;
- no lease outlives the overload (Release is never shed), with the default 30 s lease timeout.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from kvstore.client import AsyncKVClient, KVClient
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.process import ROOT
from tests.conftest import random_kv, small_layout
from tests.reliability import (
    CapacityWatch,
    Worker,
    layout_pb,
    rss_bytes,
    soak_record,
    soak_seconds,
    stats,
    wait_quiescent,
)

# Wall-clock bounds (the deadlines): a rerun absorbs a noisy neighbour on 2 cores.
pytestmark = [pytest.mark.fault, pytest.mark.integration,
              pytest.mark.flaky(reruns=2, reruns_delay=1)]
C = 4
RECOMPUTE_S = 0.010  # what a refused caller does before its next request
P99_BOUND = 2.0
MEM_BUDGET = 32 << 20
LAYOUT = small_layout(num_layers=8)  # 32 KiB blocks
PROMPTS = [[p * 1000 + t for t in range(64)] for p in range(16)]  # 4 blocks each, 2 MiB in all

_GENERATOR = r"""
import asyncio, json, random, sys, time
import grpc
from kvstore.proto import kvstore_pb2 as pb, kvstore_pb2_grpc as pb_grpc
target, n, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
recompute = float(sys.argv[4])
reqs = [pb.FetchRequest.FromString(bytes.fromhex(r)) for r in sys.argv[5:]]
codes = {}

async def caller(stub, until):
    while time.monotonic() < until:
        try:
            async for head in stub.Fetch(random.choice(reqs), timeout=5):
                if head.lease_id:
                    await stub.Release(pb.ReleaseRequest(lease_id=head.lease_id), timeout=5)
            codes["OK"] = codes.get("OK", 0) + 1
        except grpc.aio.AioRpcError as e:
            codes[e.code().name] = codes.get(e.code().name, 0) + 1
            await asyncio.sleep(recompute)  # a refused engine recomputes; it does not spin

async def main():
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        print("STARTED", flush=True)
        until = time.monotonic() + seconds
        await asyncio.gather(*(caller(stub, until) for _ in range(n)))
    print(json.dumps(codes), flush=True)

asyncio.run(main())
"""


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * 0.99))]


@dataclass
class Calls:
    """The measured callers' fetches: (phase, seconds, end time, blocks) each."""

    phase: str = "base"
    rows: list[tuple[str, float, float, int]] = field(default_factory=list)

    def served(self, phase: str) -> list[float]:
        return [t for p, t, _, n in self.rows if p == phase and n]


async def _measure(target: str, seconds: float, calls: Calls) -> None:
    """C callers for `seconds`, each fetching random prompts; a call is kept under the phase
    it started and ended in (calls across a switch are dropped)."""
    client = AsyncKVClient(target, LAYOUT, deadline_s=2)
    until = time.monotonic() + seconds

    async def caller(seed: int) -> None:
        buf = torch.empty(LAYOUT.kv_shape(64), dtype=LAYOUT.torch_dtype)
        rng = random.Random(seed)
        while time.monotonic() < until:
            phase, t0 = calls.phase, time.perf_counter()
            n, _ = await client.fetch(rng.choice(PROMPTS), into=buf)
            if calls.phase == phase:
                calls.rows.append((phase, time.perf_counter() - t0, time.monotonic(), n))
            if not n:
                await asyncio.sleep(RECOMPUTE_S)

    try:
        await asyncio.gather(*(caller(s) for s in range(C)))
    finally:
        await client.close()


async def _alternate(target: str, gen: subprocess.Popen[str], windows: int,
                     calls: Calls) -> None:
    """Measure while switching the excess load off and on every 0.5 s."""

    async def switch() -> None:
        for w in range(windows):
            calls.phase = "over" if w % 2 else "base"
            gen.send_signal(signal.SIGCONT if w % 2 else signal.SIGSTOP)
            await asyncio.sleep(0.5)
        calls.phase = "done"
        gen.send_signal(signal.SIGCONT)

    await asyncio.gather(switch(), _measure(target, windows * 0.5, calls))


def test_overload_sheds_excess_and_keeps_admitted_latency(daemon_factory):
    d = daemon_factory("--host-bytes", "1MiB", "--disk-bytes", "64MiB",
                       "--fault-disk-read-delay-s", "0.005",
                       "--max-concurrent-rpcs", str(C)).start()
    requests = []
    with KVClient(d.target, LAYOUT, deadline_s=5) as c:
        for p, tokens in enumerate(PROMPTS):
            assert c.publish(tokens, random_kv(LAYOUT, 64, seed=p)) == 64
            requests.append(pb.FetchRequest(
                namespace=c.namespace.digest(), layout=layout_pb(LAYOUT), keys=c.keys(tokens),
                transfer=pb.TRANSFER_SHM).SerializeToString().hex())
    asyncio.run(_measure(d.target, 0.5, Calls("warm-up")))  # channels, arena mapping
    anon0 = rss_bytes(d.proc.pid)["RssAnon"]
    shed0 = stats(d.target).shed_rpcs
    windows = 2 * max(3, int(soak_seconds(0) / 1.0))  # pairs of 0.5 s windows
    gen = subprocess.Popen(
        [sys.executable, "-c", _GENERATOR, d.target, str(2 * C), str(windows * 0.5 + 2),
         str(RECOMPUTE_S),
         *requests], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    peak_anon = anon0
    stop = threading.Event()

    def sample_memory() -> None:
        nonlocal peak_anon
        while not stop.wait(0.05):
            peak_anon = max(peak_anon, rss_bytes(d.proc.pid)["RssAnon"])

    sampler = Worker(target=sample_memory)
    calls, recovery = Calls(), Calls("after")
    try:
        assert gen.stdout is not None
        assert gen.stdout.readline().strip() == "STARTED"
        sampler.start()
        with CapacityWatch(d) as watch:
            asyncio.run(_alternate(d.target, gen, windows, calls))
            codes = json.loads(gen.stdout.readline())  # the excess ends
            gen.wait(10)
            t_end = time.monotonic()
            base_rate = len(calls.served("base")) / (windows // 2 * 0.5)
            recovered_at = None
            while recovered_at is None and time.monotonic() - t_end < 5.0:
                recovery.rows.clear()  # throughput per 0.5 s window, until 80% of the base
                asyncio.run(_measure(d.target, 0.5, recovery))
                if len(recovery.served("after")) >= 0.8 * base_rate * 0.5:
                    recovered_at = time.monotonic() - t_end
    finally:
        stop.set()
        gen.kill()
        if sampler.is_alive():
            sampler.join(5)
    sampler.result(0)  # a sampler that died would leave peak_anon too low
    watch.check()
    end = stats(d.target)
    shed = end.shed_rpcs - shed0
    base, over = calls.served("base"), calls.served("over")
    ratio = _p99(over) / _p99(base)
    soak_record("overload", operations=len(calls.rows) + sum(codes.values()), faults=shed, wrong=0,
                p99_unloaded_ms=round(_p99(base) * 1000, 2),
                p99_overload_ms=round(_p99(over) * 1000, 2), p99_ratio=round(ratio, 2),
                recovered_s=round(recovered_at or -1, 2),
                anon_growth_mib=round((peak_anon - anon0) / 2**20, 1))
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert codes.get("RESOURCE_EXHAUSTED", 0) > 0 and shed > 0, "nothing was shed"
    assert len(over) >= 30, "too few admitted calls under overload for a p99"
    assert ratio <= P99_BOUND, f"admitted p99 {ratio:.2f}x the unloaded p99"
    assert peak_anon - anon0 < MEM_BUDGET
    assert recovered_at is not None and recovered_at <= 5.0
    assert end.integrity_failures == 0
    wait_quiescent(d.target, 2.0)  # no lease left behind, long before the 30 s timeout
