"""Races between readers, writers and eviction.

- Item 9, eviction racing a fetch: destinations are filled with a canary first; no block a fetch
  reports loaded may still hold canary bytes, or any bytes but its own. In-process, the exact
  interleaving that used to break it (a promoted block evicted while the rest of its fetch was
  still reading disk); against a daemon, fetches under constant eviction, host-only and with
  disk promotions.
- Item 10, a writer that dies between Reserve and Commit (a real process, SIGKILLed after
  writing half its slots): nobody reads its slots, a second writer cannot be fooled into a
  block that never appears, and after `lease_timeout_s` the space is reclaimed and the keys can
  be written again, byte-identical.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kvstore.client import AsyncKVClient, KVClient
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.process import ROOT
from kvstore.server.store import TieredStore
from kvstore.tiers.base import PAGE
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier
from tests.conftest import random_kv, same_bytes, small_layout
from tests.reliability import (
    CapacityWatch,
    layout_pb,
    soak_record,
    soak_seconds,
    stats,
    stub,
    tier,
    wait_quiescent,
)

pytestmark = [pytest.mark.fault, pytest.mark.integration]
CANARY = 0xA5
MIN_BLOCKS = 200


# ---- item 9, in-process: the interleaving, made to happen
def test_promoted_block_stays_pinned_while_its_fetch_reads_the_rest(tmp_path: Path) -> None:
    length = 5000  # 2 host pages, 3 disk pages
    store = TieredStore(HostTier(3 * 2 * PAGE, shm_dir=tmp_path),
                        DiskTier(tmp_path / "disk", 16 * 3 * PAGE, sync="never"), io_threads=4)
    ns, layout = b"N" * 32, b"L" * 32
    keys = [bytes([i]) * 32 for i in range(8)]
    payload = {k: bytes([k[0] + 1]) * length for k in keys}
    gate, slow = threading.Event(), keys[1]
    read = store.disk.read_into

    def read_into(entry, dst):  # the second block's read stalls until the gate opens
        if entry.key == slow:
            gate.wait(10)
        read(entry, dst)

    store.disk.read_into = read_into

    async def publish(ks):
        lease = await store.reserve(ns, layout, ks, length)
        for e in lease.entries:
            store.host.memview(e)[:] = payload[e.key]
        store.commit(lease.id)

    async def main() -> None:
        for k in keys[:5]:  # host keeps the last 3; keys 0 and 1 are on disk only
            await publish([k])
        assert not store.host.contains(keys[0]) and store.disk.contains(keys[0])
        fetch = asyncio.create_task(store.fetch(keys[:2], layout))
        for _ in range(10_000):  # until the first promotion has landed
            if store.host.contains(keys[0]) or fetch.done():
                break
            await asyncio.sleep(0.001)
        # The second read waits for the gate: a fetch done already failed (result() raises).
        assert not fetch.done(), fetch.result()
        assert store.host.contains(keys[0]), "the first promotion never landed"
        # Two more blocks want host room now: one free slot, then the promoted block would be
        # the least recently used victim if it were not pinned.
        other = await store.reserve(ns, layout, keys[5:7], length)
        gate.set()
        lease = await fetch
        assert [e.key for e in lease.entries] == keys[:2]
        assert [bytes(store.host.memview(e)) for e in lease.entries] == [
            payload[k] for k in keys[:2]]
        assert len(other.entries) < 2, "the promoted block was evicted under its fetch"
        store.release(lease.id)
        store.release(other.id)
        assert store.host.stats().pinned_blocks == 0

    try:
        asyncio.run(main())
    finally:
        gate.set()
        store.close()


def test_two_requests_sharing_a_prefix_on_disk_both_get_it(daemon_factory):
    # Two engines (or two requests of one) fetch the same prefix from disk at once. The second
    # comes while the first's reads are in flight: it waits for them and is served from host,
    # instead of missing every block in flight (it did, and recomputed the whole prefix).
    d = daemon_factory("--host-bytes", "64KiB", "--disk-bytes", "1MiB",
                       "--fault-disk-read-delay-s", "0.3").start()
    layout = small_layout()
    tokens = list(range(64))  # 4 blocks
    other = list(range(1000, 1128))  # 8 blocks: fills host, demoting the prompt to disk
    kv = random_kv(layout, len(tokens), seed=1)
    results: dict[str, tuple[int, torch.Tensor | None]] = {}
    with KVClient(d.target, layout, deadline_s=10) as c:
        assert c.publish(tokens, kv) == len(tokens)
        assert c.publish(other, random_kv(layout, len(other), seed=2)) == len(other)
        before = stats(d.target)
        assert tier(before, "disk").blocks >= 4 and tier(before, "host").blocks == 8

        def fetch(name: str, delay: float) -> None:
            time.sleep(delay)
            with KVClient(d.target, layout, deadline_s=10) as mine:
                results[name] = mine.fetch(tokens)

        threads = [threading.Thread(target=fetch, args=(n, t)) for n, t in (("a", 0), ("b", 0.2))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    for name in ("a", "b"):
        n, got = results[name]
        assert n == len(tokens), f"fetch {name} got {n} of {len(tokens)} tokens"
        assert got is not None and same_bytes(got, kv)
    assert stats(d.target).promotions - before.promotions == 4  # read from disk once


# ---- item 9, against a daemon
async def _churn(target, layout, prompts, values, seconds, counts) -> None:
    readers = [AsyncKVClient(target, layout, transfer=t, deadline_s=2)
               for t in ("shm", "stream")]
    writer = AsyncKVClient(target, layout, deadline_s=2)
    until = time.monotonic() + seconds

    def more() -> bool:  # on a starved machine, on until enough happened (up to 30 s more)
        now = time.monotonic()
        return now < until or (now < until + 30 and counts["blocks"] < MIN_BLOCKS)

    async def write(seed: int) -> None:
        rng = random.Random(seed)
        while more():
            p = rng.randrange(len(prompts))
            await writer.publish(prompts[p], values[p])
            counts["ops"] += 1

    async def read(seed: int) -> None:
        rng = random.Random(seed)
        buf = torch.empty(layout.kv_shape(64), dtype=layout.torch_dtype)
        while more():
            p = rng.randrange(len(prompts))
            buf.view(torch.uint8).fill_(CANARY)
            n, got = await rng.choice(readers).fetch(prompts[p], into=buf)
            counts["ops"] += 1
            for b in range(n // 16):
                block = got[:, :, b * 16 : (b + 1) * 16].contiguous().view(torch.uint8)
                counts["blocks"] += 1
                counts["canary"] += bool((block == CANARY).all())
                counts["wrong"] += not same_bytes(got[:, :, b * 16 : (b + 1) * 16],
                                                  values[p][:, :, b * 16 : (b + 1) * 16])

    try:
        await asyncio.gather(*(write(s) for s in range(2)), *(read(10 + s) for s in range(4)))
    finally:
        for c in (*readers, writer):
            await c.close()


@pytest.mark.parametrize("tiers", ["host-only", "host+disk"])
def test_no_block_reported_loaded_holds_canary_bytes(daemon_factory, tiers):
    # 32 host blocks for 160 published: every publish evicts (or demotes) someone's block.
    args = ["--host-bytes", "256KiB", "--disk-bytes", "0"]
    if tiers == "host+disk":  # promotions too, slowed so they overlap the eviction more
        args = ["--host-bytes", "256KiB", "--disk-bytes", "1MiB",
                "--fault-disk-read-delay-s", "0.002"]
    d = daemon_factory(*args).start()
    layout = small_layout()
    prompts = [[p * 1000 + t for t in range(64)] for p in range(40)]
    values = [random_kv(layout, 64, seed=p) for p in range(40)]
    counts = dict.fromkeys(("ops", "blocks", "canary", "wrong"), 0)
    with CapacityWatch(d) as watch:
        asyncio.run(_churn(d.target, layout, prompts, values, soak_seconds(2.5), counts))
    watch.check()
    end = wait_quiescent(d.target, 3)
    host = tier(end, "host")
    soak_record(f"eviction_vs_fetch[{tiers}]", operations=counts["ops"],
                faults=host.evictions, blocks_checked=counts["blocks"],
                wrong=counts["wrong"] + counts["canary"])
    assert counts["canary"] == 0, "a block reported loaded still held the canary"
    assert counts["wrong"] == 0
    assert counts["blocks"] >= MIN_BLOCKS, counts
    assert host.evictions > 100, "eviction never raced the fetches"
    assert end.integrity_failures == 0


# ---- item 10
_WRITER = r"""
import json, sys, time
import grpc
from kvstore.arena import Arena
from kvstore.proto import kvstore_pb2 as pb, kvstore_pb2_grpc as pb_grpc
target, ns, layout = sys.argv[1], bytes.fromhex(sys.argv[2]), json.loads(sys.argv[3])
keys = sys.argv[4:]
stub = pb_grpc.KVStoreStub(grpc.insecure_channel(target))
r = stub.Reserve(pb.ReserveRequest(namespace=ns, layout=pb.Layout(**layout),
                                   keys=[bytes.fromhex(k) for k in keys]), timeout=5)
info = stub.Info(pb.InfoRequest(), timeout=5)
arena = Arena.attach(info.arena_path, info.arena_bytes)
for i, b in enumerate(r.blocks):  # every other block half written, the rest whole: garbage
    arena.array[b.offset : b.offset + (b.length // 2 if i % 2 else b.length)] = 0xA5
print("RESERVED", len(r.blocks), flush=True)
time.sleep(60)  # killed here, before Commit
"""


def test_writer_killed_between_reserve_and_commit(daemon_factory):
    lease_s = 1.0
    d = daemon_factory("--host-bytes", "1MiB", "--disk-bytes", "0",
                       "--lease-timeout-s", str(lease_s)).start()
    layout = small_layout()
    tokens = list(range(64))
    kv = random_kv(layout, 64)
    with KVClient(d.target, layout, deadline_s=5) as c:
        keys, ns = c.keys(tokens), c.namespace.digest()
        base = tier(stats(d.target), "host").used_bytes
        layout_json = json.dumps(layout.to_dict())
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, d.target, ns.hex(),
                                   layout_json, *(k.hex() for k in keys)],
                                  cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:
            assert writer.stdout is not None
            line = writer.stdout.readline()
            assert line.split() == ["RESERVED", "4"], line
        finally:
            writer.kill()
            writer.wait(10)
        t_dead = time.monotonic()
        held = stats(d.target)
        assert held.active_leases == 1
        assert tier(held, "host").used_bytes == base + 4 * 2 * PAGE  # reserved, invisible
        # Nobody reads its slots: not through lookup, not through fetch, over either transfer.
        assert c.lookup(tokens) == 0
        assert c.fetch(tokens) == (0, None)
        channel, s = stub(d.target)
        with channel:
            for key in keys:
                for transfer in (pb.TRANSFER_SHM, pb.TRANSFER_STREAM):
                    head = next(iter(s.Fetch(pb.FetchRequest(
                        namespace=ns, layout=layout_pb(layout), keys=[key],
                        transfer=transfer), timeout=5)))
                    assert head.hits == 0
        # A second writer meanwhile is told the blocks are being written; none appears.
        c.publish(tokens, kv)
        assert c.lookup(tokens) == 0
        # After the timeout the space is reclaimed...
        end = wait_quiescent(d.target, lease_s + 1.5)
        reclaimed_s = time.monotonic() - t_dead
        assert end.active_leases == 0 and end.expired_leases == 1
        assert tier(end, "host").used_bytes == base
        # ...and the keys can be written again: the real bytes, none of the dead writer's.
        assert c.publish(tokens, kv) == 64
        n, got = c.fetch(tokens)
        assert n == 64 and same_bytes(got, kv)
    CapacityWatch(d).check()
    soak_record("dead_writer", operations=8, kills=1, faults=1, wrong=0,
                reclaimed_ms=round(reclaimed_s * 1000))
    assert reclaimed_s < lease_s + 1.0
