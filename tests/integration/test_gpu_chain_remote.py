"""The whole chain gpu -> host -> disk -> remote, through a real daemon process and a real Redis
server (the Debian package's `redis-server` on loopback, `tests/redis_servers.py`).

The daemon is `test_gpu_chain.py`'s (gpu on cpu: 4 blocks, host: 6, LRU) with a disk of 4
records and the Redis server as its remote tier. Four prompts of 4 blocks, each in its own
namespace, push the first one down the chain and out of every local tier while the remote tier
keeps it (written through at commit); every step's placement per tier (Inspect) follows from
the rules and is asserted exactly. Then it comes back from Redis byte-identical and is promoted
up into host and gpu; or, with Redis stopped, it is a miss while the local tiers keep serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from kvstore.client import KVClient
from kvstore.server.process import DaemonProcess
from kvstore.server.store import TieredStore
from kvstore.tiers.base import PAGE
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.gpu import GpuTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.remote import RemoteOptions, RemoteTier
from tests.conftest import random_kv, same_bytes, small_layout
from tests.integration.test_gpu_chain import BB, BT, chain_args, counters, lifted, placement, prompt
from tests.redis_servers import RedisServer, cli
from tests.reliability import CapacityWatch, stats, wait_quiescent, wait_until
from tests.unit.test_store import LAYOUT, LENGTH, NS_A, key, payload, publish
from tests.unit.test_store_remote import settle

pytestmark = pytest.mark.integration
NAMES = ("p1", "p2", "p3", "p4", "p5")
LAYOUTS = {m: small_layout(model=m) for m in NAMES}  # a namespace each
TOKENS = {m: prompt(i) for i, m in enumerate(NAMES, 1)}  # 4 blocks each
KV = {m: random_kv(LAYOUTS[m], len(TOKENS[m]), seed=i) for i, m in enumerate(NAMES)}
DISK_RECORDS = 4  # a disk record is a header page and the block
# After `lose_p1_locally`: P1 is in no local tier.
P1_ONLY_REMOTE = {"p2": {"gpu": 4, "disk": 2}, "p3": {"host": 2, "disk": 2}, "p4": {"host": 4}}


def start(daemon_factory, redis: RedisServer) -> DaemonProcess:
    return daemon_factory(*chain_args(disk_bytes=DISK_RECORDS * (BB + PAGE)),
                          "--remote", redis.url, "--remote-timeout-s", "0.3",
                          "--remote-retry-s", "0.2").start()


def written(d: DaemonProcess) -> int:
    return stats(d.target).remote.written_blocks


def publish_through(d: DaemonProcess, c: KVClient, name: str, total: int) -> None:
    """Publish a prompt and wait until write-through has sent `total` blocks (and nothing is
    pinned for it any more: a block framed for Redis is pinned, which would change victims)."""
    assert c.publish(TOKENS[name], KV[name]) == len(TOKENS[name])
    wait_until(lambda: written(d) == total, 5.0, f"{total} blocks written through")
    wait_quiescent(d.target, 2.0)


def fetch_same(c: KVClient, name: str) -> None:
    n, got = c.fetch(TOKENS[name])
    assert n == len(TOKENS[name]) and same_bytes(got, KV[name])


def lose_p1_locally(d: DaemonProcess, cs: dict[str, KVClient], redis: RedisServer) -> None:
    """P1 published, lifted into gpu, then pushed down to disk and out of every local tier by
    P2-P4 (each written through to Redis at commit)."""
    publish_through(d, cs["p1"], "p1", 4)
    assert placement(d.target) == {"p1": {"host": 4}}
    fetch_same(cs["p1"], "p1")  # copied up into gpu, host keeps it
    lifted(d.target, 4)  # after the fetch answered
    assert placement(d.target) == {"p1": {"gpu": 4, "host": 4}}
    # Host full: its least-recent blocks (P1's tail) go down to disk; gpu keeps P1 whole.
    publish_through(d, cs["p2"], "p2", 8)
    assert placement(d.target) == {"p1": {"gpu": 4, "host": 2, "disk": 2},
                                   "p2": {"host": 4}}
    # P2 is lifted into gpu, whose victims (P1) go down to host where host lacks them (the
    # tail), host's (P1's head) down to disk, host's next ones dropped (disk holds them).
    fetch_same(cs["p2"], "p2")
    lifted(d.target, 8)
    assert placement(d.target) == {"p1": {"host": 2, "disk": 4},
                                   "p2": {"gpu": 4, "host": 4}}
    # P3 takes host's least-recent four: P1's (on disk: dropped) and P2's tail, written to
    # disk, whose least-recent (P1's tail) are dropped from the last level.
    publish_through(d, cs["p3"], "p3", 12)
    assert placement(d.target) == {"p1": {"disk": 2}, "p2": {"gpu": 4, "host": 2, "disk": 2},
                                   "p3": {"host": 4}}
    # P4: P2's head and P3's tail go down to disk, pushing P1's last two out of it.
    publish_through(d, cs["p4"], "p4", 16)
    assert placement(d.target) == P1_ONLY_REMOTE
    assert int(cli(redis.port, "DBSIZE")) == 16  # Redis holds every block of the four


def clients(d: DaemonProcess) -> dict[str, KVClient]:
    return {m: KVClient(d.target, LAYOUTS[m]) for m in NAMES}


def test_prompt_goes_down_to_remote_and_comes_back_up_to_gpu(redis_server, daemon_factory):
    d = start(daemon_factory, redis_server)
    cs = clients(d)
    try:
        with CapacityWatch(d) as watch:
            lose_p1_locally(d, cs, redis_server)
            before = counters(d.target)
            # Read-through: the remote tier extends the lookup past the (empty) local prefix.
            assert cs["p1"].lookup(TOKENS["p1"]) == len(TOKENS["p1"])
            assert stats(d.target).remote.lookup_hits == 4
            # The fetch reads P1 from Redis, byte-identical, promotes it into host and copies
            # it up into gpu (within its 4 blocks). gpu's victims (P2) go down to host, pushing
            # host's down to disk and disk's out: P3 is now only in Redis, as P1 was.
            fetch_same(cs["p1"], "p1")
            lifted(d.target, 16)
            assert placement(d.target) == {"p1": {"gpu": 4, "host": 4},
                                           "p2": {"host": 2, "disk": 2}, "p4": {"disk": 2}}
            # Per tier [blocks, hits, bytes read, bytes written]. Before: gpu took 8 lifted
            # blocks (P1, P2), host 16 published and 4 gpu victims (and served its 8 hits), disk
            # 10 host victims, Redis 16 written through. The fetch: 4 blocks read from Redis and
            # promoted into host, 4 lifted into gpu, gpu's 4 victims written down into host, 8
            # of host's to disk.
            assert before["tiers"] == {"gpu": [4, 0, 0, 8 * BB], "host": [6, 8, 8 * BB, 20 * BB],
                                       "disk": [4, 0, 0, 10 * BB],
                                       "remote": [0, 0, 0, 16 * BB]}
            assert counters(d.target) == {
                "tiers": {"gpu": [4, 0, 0, 12 * BB], "host": [6, 8, 8 * BB, 28 * BB],
                          "disk": [4, 0, 0, 18 * BB], "remote": [0, 4, 4 * BB, 16 * BB]},
                "promotions": 16, "demotions": 26}
            # Promoted: the next fetch is gpu's (this client maps the slab: it reads the blocks
            # there, not host's copies), nothing read from Redis again.
            fetch_same(cs["p1"], "p1")
            r = wait_quiescent(d.target, 2.0)
            assert [(t.name, t.hits) for t in r.tiers] == [
                ("gpu", 4), ("host", 8), ("disk", 0), ("remote", 4)]
            assert r.integrity_failures == 0 and r.remote.integrity_failures == 0
            watch.check()
    finally:
        for c in cs.values():
            c.close()
    assert d.stop() == 0


def test_redis_stopped_mid_run_is_a_miss_and_local_tiers_keep_serving(
        redis_server, daemon_factory, caplog):
    d = start(daemon_factory, redis_server)
    cs = clients(d)
    try:
        with CapacityWatch(d) as watch:
            lose_p1_locally(d, cs, redis_server)
            redis_server.kill()  # the only copy of P1 is gone with it
            began = time.monotonic()
            assert cs["p1"].lookup(TOKENS["p1"]) == 0
            n, got = cs["p1"].fetch(TOKENS["p1"])
            assert (n, got) == (0, None)  # a miss: never an error, never other bytes
            assert placement(d.target) == P1_ONLY_REMOTE  # the failed read moved nothing
            # The local tiers serve what they hold, byte-identical: P4 from host (lifted into
            # gpu; its victims push P3's tail out of disk), then P3's and P2's heads from disk
            # (pushed out of host by the fetch before). Their tails were only in Redis: misses.
            served = {}
            for name in ("p4", "p3", "p2"):
                local = cs[name].lookup(TOKENS[name])  # Redis down: the local prefix
                n, got = cs[name].fetch(TOKENS[name])
                assert n == local and same_bytes(got, KV[name][:, :, :n])
                served[name] = n // BT
                if name == "p4":  # the others are read into scratch space: never lifted
                    lifted(d.target, 12)
            assert served == {"p4": 4, "p3": 2, "p2": 2}
            assert placement(d.target) == {"p4": {"gpu": 4, "host": 4}, "p3": {"disk": 2},
                                           "p2": {"disk": 2}}
            assert cs["p5"].publish(TOKENS["p5"], KV["p5"]) == len(TOKENS["p5"])
            fetch_same(cs["p5"], "p5")
            assert time.monotonic() - began < 5.0  # no call waited out its 1 s deadline
            r = wait_quiescent(d.target, 2.0)
            assert not r.remote.available and r.remote.breaker_opens >= 1
            assert r.integrity_failures == 0
            watch.check()
    finally:
        for c in cs.values():
            c.close()
    # The client saw answers, not failed calls (it would log each failure as a warning).
    assert not [rec for rec in caplog.records
                if rec.name.startswith("kvstore.client") and rec.levelno >= logging.WARNING]
    assert d.stop() == 0
    assert "Traceback" not in d.log.read_text()


def test_write_through_frames_blocks_the_gpu_tier_holds(redis_server, tmp_path: Path):
    """The write-through task reads each block from the level a fetch would (host, then the
    fastest holding it), gpu included. It used to take the first tier holding the block, so a
    block in gpu (published and fetched before its turn, or demoted from host while gpu kept
    it) could not be framed and its whole batch was dropped."""
    host = HostTier(3 * 2 * PAGE, shm_dir=tmp_path)
    disk = DiskTier(tmp_path / "disk", 16 * 3 * PAGE, sync="never")
    remote = RemoteTier(redis_server.url, RemoteOptions(timeout_s=2.0))
    store = TieredStore(host, disk, io_threads=2, gpu=GpuTier(4 * 2 * PAGE, "cpu"),
                        remote=remote)
    first, second = [key(i) for i in range(3)], [key(i) for i in range(10, 13)]

    async def main() -> list[bytes | None]:
        assert store.write_queue is not None and store.gpu is not None
        await publish(store, first)
        store.release((await store.fetch(first, LAYOUT)).id)  # lifted before its write
        await store.lifts_idle()
        assert all(store.gpu.contains(k) and host.contains(k) for k in first)
        lost = await store.write_queue.take(2, 1 << 30, lambda k: 0)  # first[0:2] lost...
        store.write_queue.done()
        await settle(store)  # ...first[2] written from gpu or host
        await publish(store, second)  # demotes `first` to disk (gpu keeps it), queued again
        assert all(store.gpu.contains(k) and disk.contains(k) and not host.contains(k)
                   for k in first)
        await settle(store)
        got = await remote.get(NS_A, [*first, *second], LAYOUT)
        await remote.close()
        assert [w.key for w in lost] == first[:2]
        return [bytes(g) if g is not None else None for g in got]

    try:
        assert asyncio.run(main()) == [payload(k) for k in [*first, *second]]
    finally:
        store.close()
    assert store.counters.remote_dropped_writes == 0 and len(payload(first[0])) == LENGTH
