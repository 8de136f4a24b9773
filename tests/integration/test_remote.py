"""The remote tier against real Redis: a standalone server, and a 3-node Cluster shared by two
daemons ("two machines on one"), with a node killed and brought back.

pytest-asyncio is not a dependency: tier-level tests drive coroutines with `asyncio.run`.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
import urllib.request
from collections.abc import Callable

import pytest
import redis

from kvstore.client import KVClient
from kvstore.integrity import HEADER_BYTES
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.process import DaemonProcess
from kvstore.tiers.remote import (
    PutResult,
    RemoteOptions,
    RemoteTier,
    RemoteUnavailableError,
    RemoteWrite,
    frame_value,
    redis_key,
)
from tests import redis_servers
from tests.conftest import random_kv, same_bytes, small_layout
from tests.metrics_docs import undocumented_exports
from tests.redis_servers import RedisClusterNodes, RedisServer, cli

pytestmark = pytest.mark.integration

NS = bytes(range(32))
LAYOUT = b"L" * 32


def _key(i: int) -> bytes:
    return b"k" + i.to_bytes(31, "big")


def _payload(i: int, n: int = 10_000) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(n))


def test_tier_round_trip_corruption_and_ttl(redis_server: RedisServer) -> None:
    keys = [_key(i) for i in range(4)]
    raw = redis.Redis(port=redis_server.port)

    async def main() -> RemoteTier:
        tier = RemoteTier(redis_server.url, RemoteOptions(ttl_s=600, timeout_s=2.0))
        writes = [RemoteWrite(NS, k, frame_value(k, LAYOUT, _payload(i)))
                  for i, k in enumerate(keys[:3])]
        assert (await tier.put(writes)).written == 3
        assert await tier.exists(NS, keys) == [True, True, True, False]
        assert 590 <= raw.ttl(redis_key(NS, keys[0])) <= 600
        got = await tier.get(NS, keys, LAYOUT)
        assert [bytes(g) if g is not None else None for g in got] == [
            _payload(0), _payload(1), _payload(2), None]
        # Another layout: a miss, but the intact value stays (the requester is wrong).
        assert await tier.get(NS, keys[:1], b"X" * 32) == [None]
        # Another namespace: its own key space.
        assert await tier.exists(b"N" * 32, keys[:1]) == [False]
        # Flip one payload byte behind the tier's back.
        name = redis_key(NS, keys[1])
        value = bytearray(raw.get(name))
        value[HEADER_BYTES + 100] ^= 0xFF
        raw.set(name, bytes(value))
        got = await tier.get(NS, keys[:3], LAYOUT)
        assert got[1] is None and got[0] is not None and got[2] is not None
        assert await tier.exists(NS, keys[:3]) == [True, False, True]  # deleted
        other = RemoteWrite(b"N" * 32, keys[0], frame_value(keys[0], LAYOUT, _payload(0)))
        assert (await tier.put([other])).written == 1
        assert await tier.clear(NS) == 2  # one namespace...
        assert await tier.exists(b"N" * 32, keys[:1]) == [True]  # ...not the others
        assert await tier.clear(None) == 1
        await tier.close()
        return tier

    tier = asyncio.run(main())
    s = tier.stats()
    assert (s.integrity_failures, s.blocks_written) == (1, 4)
    assert s.errors == 0 and s.available
    raw.close()


def test_refused_writes_are_dropped_without_opening_the_breaker(redis_server: RedisServer,
                                                                ) -> None:
    cli(redis_server.port, "CONFIG", "SET", "maxmemory-policy", "noeviction")
    cli(redis_server.port, "CONFIG", "SET", "maxmemory", "2mb")

    async def main() -> tuple[RemoteTier, PutResult, list[bool]]:
        tier = RemoteTier(redis_server.url, RemoteOptions(timeout_s=2.0))
        big = [RemoteWrite(NS, _key(i), frame_value(_key(i), LAYOUT, _payload(i, 1 << 20)))
               for i in range(4)]
        result = await tier.put(big)  # OOM once memory is past 2 MB
        present = await tier.exists(NS, [_key(i) for i in range(4)])
        await tier.close()
        return tier, result, present

    tier, result, present = asyncio.run(main())
    assert result.rejected and not result.transient
    assert present == [True] * result.written + [False] * len(result.rejected)
    s = tier.stats()
    assert s.available and s.breaker_opens == 0 and s.failed_writes == len(result.rejected)


def test_large_blocks_get_a_deadline_for_their_bytes(redis_server: RedisServer) -> None:
    """A call's deadline grows with the bytes it moves (`deadline_s`): with a 5 ms
    `timeout_s`, a 32 MiB block is written and read back whole, the breaker never opening.
    A flat 5 ms deadline times every such call out (as 0.5 s did for 64 MiB blocks on a
    loaded machine: they were never shared)."""
    from kvstore.tiers import remote as remote_module

    payload = bytes(range(256)) * (32 << 12)  # 32 MiB
    key = _key(99)

    async def main(tier: RemoteTier) -> tuple[int, list[bytes | None]]:
        try:
            written = (await tier.put([RemoteWrite(NS, key, frame_value(key, LAYOUT,
                                                                        payload))])).written
            got = await tier.get(NS, [key], LAYOUT, block_bytes=len(payload))
            return written, [bytes(g) if g is not None else None for g in got]
        finally:
            await tier.close()

    options = RemoteOptions(timeout_s=0.005, retry_s=0.5)
    tier = RemoteTier(redis_server.url, options)
    assert tier.deadline_s(len(payload)) == pytest.approx(
        0.005 + len(payload) / remote_module.TRANSFER_FLOOR_BYTES_PER_S)
    assert asyncio.run(main(tier)) == (1, [payload])
    assert tier.stats().breaker_opens == 0 and tier.stats().timeouts == 0
    flat = RemoteTier(redis_server.url, options)
    flat.deadline_s = lambda nbytes: options.timeout_s  # type: ignore[method-assign]
    with pytest.raises(RemoteUnavailableError, match="timed out"):
        asyncio.run(main(flat))


def test_dead_server_costs_one_deadline_not_one_per_call() -> None:
    # A black hole: the kernel completes the TCP handshake, nobody ever answers.
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    url = f"redis://127.0.0.1:{hole.getsockname()[1]}/0"

    async def main() -> tuple[RemoteTier, list[float]]:
        tier = RemoteTier(url, RemoteOptions(timeout_s=0.2, retry_s=0.5))
        skew = 0.0  # the breaker's clock runs ahead by this much
        tier.breaker.clock = lambda: time.monotonic() + skew
        times = []
        for _ in range(20):
            t0 = time.monotonic()
            with pytest.raises(RemoteUnavailableError, match=r"timed out|breaker open"):
                await tier.get(NS, [_key(0)], LAYOUT)
            times.append(time.monotonic() - t0)
        skew = 0.6  # past the window: one probe goes, and fails again
        with pytest.raises(RemoteUnavailableError, match="timed out"):
            await tier.exists(NS, [_key(0)])
        await tier.close()
        return tier, times

    try:
        tier, times = asyncio.run(main())
    finally:
        hole.close()
    assert 0.15 < times[0] < 0.5
    assert max(times[1:]) < 0.02, times  # refused at once while the breaker is open
    s = tier.stats()
    assert (s.breaker_opens, s.timeouts, s.skipped_calls) == (1, 2, 19)
    assert not s.available


def test_a_write_to_a_server_that_never_answers_ends_at_its_deadline() -> None:
    # Writes go through a blocking client in a thread of their own (its socket timeout is
    # seconds): the call must still end at its deadline, and closing the tier must not wait
    # for the thread.
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    url = f"redis://127.0.0.1:{hole.getsockname()[1]}/0"
    write = RemoteWrite(NS, _key(0), frame_value(_key(0), LAYOUT, _payload(0, 1 << 20)))

    async def main() -> tuple[RemoteTier, float, float]:
        tier = RemoteTier(url, RemoteOptions(timeout_s=0.2, retry_s=5.0))
        t0 = time.monotonic()
        with pytest.raises(RemoteUnavailableError, match="timed out"):
            await tier.put([write])
        took = time.monotonic() - t0
        with pytest.raises(RemoteUnavailableError, match="breaker open"):
            await tier.put([write])  # refused at once: the first one opened the breaker
        t0 = time.monotonic()
        await tier.close()
        return tier, took, time.monotonic() - t0

    try:
        tier, took, closing = asyncio.run(main())
    finally:
        hole.close()
    assert 0.15 < took < tier.deadline_s(len(write.frame)) + 0.3, took
    assert closing < 1.0, closing
    s = tier.stats()
    assert (s.timeouts, s.breaker_opens, s.failed_writes, s.blocks_written) == (1, 1, 1, 0)


def _wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def _remote_written(c: KVClient) -> int:
    stats = c.stats()
    return stats.remote.written_blocks if stats is not None else -1


def _daemon_args(url: str, *extra: str) -> tuple[str, ...]:
    return ("--host-bytes", "4MiB", "--disk-bytes", "16MiB", "--remote", url,
            "--remote-timeout-s", "0.3", "--remote-retry-s", "0.2", *extra)


def test_write_through_sheds_instead_of_blocking(redis_server: RedisServer,
                                                 daemon_factory) -> None:
    port = redis_servers.free_port()
    d = daemon_factory(*_daemon_args(redis_server.url, "--remote-queue-blocks", "2",
                                     "--metrics-port", str(port))).start()
    layout = small_layout()
    tokens = list(range(8 * 16))
    kv = random_kv(layout, len(tokens))
    with KVClient(d.target, layout) as c:
        assert c.publish(tokens, kv) == len(tokens)  # one commit of 8 blocks, queue of 2
        _wait_for(lambda: c.stats().remote.written_blocks == 2)
        r = c.stats().remote
    assert (r.queued_writes, r.shed_writes, r.written_blocks) == (2, 6, 2)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    missing = undocumented_exports(text, remote=True)
    assert not missing, f"documented in OPERATIONS.md but not exported: {sorted(missing)}"
    for line in ("kvstore_remote_shed_writes_total 6.0", "kvstore_remote_written_blocks_total 2.0",
                 "kvstore_remote_available 1.0", 'kvstore_tier_bytes_total{direction="write",'
                 f'tier="remote"}} {2 * layout.block_bytes}.0'):
        assert line in text, line
    assert d.stop() == 0  # SIGTERM drains the (empty) queue and closes the remote client


@pytest.mark.parametrize(("weights", "blocks", "reach_b"), [
    ("", 2, 2),  # within its equal share (4 of 8)
    ("", 6, 4),  # over it: its newest 2 shed
    ("bravo=3", 6, 6),  # weighted: 6 of 8 are its share
])
def test_a_tenant_flooding_write_through_leaves_another_its_share(
        redis_server: RedisServer, daemon_factory, tmp_path, weights: str, blocks: int,
        reach_b: int) -> None:
    """Redis stalls (SIGSTOP) while tenant alpha publishes four times what the write-through
    queue holds on daemon A; then bravo publishes a prompt of `blocks` there. Redis resumes:
    bravo's blocks reach daemon B, which reads them through Redis, as many as bravo's share of
    the queue holds (`tenant_weights`). Before the queue was shared between tenants, alpha's
    backlog filled it and bravo's blocks were shed: B never saw them."""
    from tests.security.test_tenants import TOKEN_A, TOKEN_B, _free_port, _tokens_file

    f = _tokens_file(tmp_path, f"alpha {TOKEN_A}\nbravo {TOKEN_B}\n")
    ports = [_free_port(), _free_port()]
    # A retry after 3 s: once the stalled Redis has failed one write, the writer waits that
    # long before taking from the queue again, so the queue holds what it is given meanwhile.
    daemons = [daemon_factory(*_daemon_args(redis_server.url, "--remote-queue-blocks", "8",
                                            "--remote-retry-s", "3",
                                            "--listen", f"127.0.0.1:{port}",
                                            "--tenant-tokens-file", str(f),
                                            "--tenant-weights", weights), name=name).start()
               for name, port in zip("AB", ports, strict=True)]
    a_tcp, b_tcp = (f"127.0.0.1:{p}" for p in ports)
    layout = small_layout()
    mine = list(range(blocks * 16))
    kv = random_kv(layout, len(mine), seed=9)
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        with KVClient(daemons[0].target, layout) as local, \
                KVClient(a_tcp, layout, token=TOKEN_A, deadline_s=5) as alpha:
            def remote() -> pb.RemoteStats:
                stats = local.stats()  # unscoped: it sees the queue
                assert stats is not None
                return stats.remote

            for r in range(4):
                flood = [10**6 * (r + 1) + t for t in range(8 * 16)]
                assert alpha.publish(flood, random_kv(layout, len(flood), seed=r)) == len(flood)
                if r == 0:
                    _wait_for(lambda: remote().breaker_opens >= 1, 5)
            assert remote().queue_depth == 8  # full of alpha's blocks
            with KVClient(a_tcp, layout, token=TOKEN_B, deadline_s=5) as bravo:
                assert bravo.publish(mine, kv) == len(mine)
            assert remote().breaker_opens == 1  # all within one wait of the writer
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    with KVClient(daemons[0].target, layout) as local:
        _wait_for(lambda: (s := local.stats()) is not None and s.remote.queue_depth == 0, 20)
    with KVClient(b_tcp, layout, token=TOKEN_B, deadline_s=5) as bravo_on_b:
        _wait_for(lambda: bravo_on_b.lookup(mine) >= reach_b * 16, 20)
        n, got = bravo_on_b.fetch(mine)
        assert n == reach_b * 16 and same_bytes(got, kv[:, :, :n])


def test_a_tenants_clear_of_one_namespace_leaves_its_others_in_redis(
        redis_server: RedisServer, daemon_factory, tmp_path) -> None:
    """Alpha publishes one prompt under two salts (two namespaces) through daemon A, clears
    the first; daemon B still reads the second through Redis, not the first. Every stored
    namespace of a tenant shares its tag: had the tag led the namespace, Redis keys (named by
    the namespace's first bytes) would have put both in one, and the Clear would take both."""
    from tests.security.test_tenants import TOKEN_A, _free_port, _tokens_file

    f = _tokens_file(tmp_path, f"alpha {TOKEN_A}\n")
    ports = [_free_port(), _free_port()]
    for name, port in zip("AB", ports, strict=True):
        daemon_factory(*_daemon_args(redis_server.url, "--listen", f"127.0.0.1:{port}",
                                     "--tenant-tokens-file", str(f)), name=name).start()
    a_tcp, b_tcp = (f"127.0.0.1:{p}" for p in ports)
    layout, tokens = small_layout(), list(range(4 * 16))
    kvs = {salt: random_kv(layout, len(tokens), seed=i) for i, salt in enumerate(("one", "two"))}
    for salt, kv in kvs.items():
        with KVClient(a_tcp, layout, token=TOKEN_A, salt=salt, deadline_s=5) as a:
            assert a.publish(tokens, kv) == len(tokens)
    for salt in kvs:
        with KVClient(b_tcp, layout, token=TOKEN_A, salt=salt, deadline_s=5) as b:
            _wait_for(lambda b=b: b.lookup(tokens) == len(tokens), 10)  # written through
    with KVClient(a_tcp, layout, token=TOKEN_A, salt="one", deadline_s=5) as a:
        assert a.clear() == 8  # its 4 local blocks and their 4 values in Redis, no more
    with KVClient(b_tcp, layout, token=TOKEN_A, salt="two", deadline_s=5) as b:
        n, got = b.fetch(tokens)  # B holds nothing local of it: read through Redis
        assert n == len(tokens) and same_bytes(got, kvs["two"])
    with KVClient(b_tcp, layout, token=TOKEN_A, salt="one", deadline_s=5) as b:
        assert b.lookup(tokens) == 0


def test_a_clear_right_after_a_publish_leaves_nothing_in_redis(redis_server: RedisServer,
                                                              daemon_factory) -> None:
    """A Clear right after a 256-block publish, its write-through still being framed and
    sent: the blocks of batches in flight landed in Redis after the Clear's SCAN/UNLINK
    and came back for every daemon (2 of 5 such trials on the code before; now the Clear
    waits for the batches taken before it). Eight trials: none leaves a key in Redis, and
    no daemon finds the prompt."""
    args = ("--host-bytes", "16MiB", "--disk-bytes", "0", "--remote", redis_server.url)
    a: DaemonProcess = daemon_factory(*args, name="A").start()
    b: DaemonProcess = daemon_factory(*args, name="B").start()
    layout = small_layout()
    with KVClient(a.target, layout, deadline_s=10) as ca, \
            KVClient(b.target, layout, deadline_s=10) as cb:
        for trial in range(8):
            tokens = list(range(trial * 10_000, trial * 10_000 + 256 * 16))
            assert ca.publish(tokens, random_kv(layout, len(tokens), seed=trial)) == len(tokens)
            assert ca.clear() >= 256
            _wait_for(lambda: (s := ca.stats()) is not None and s.remote.queue_depth == 0)
            time.sleep(0.3)  # a batch taken from the queue last is sent by now
            keys = cli(redis_server.port, "DBSIZE").strip()
            assert (keys, ca.lookup(tokens), cb.lookup(tokens)) == ("0", 0, 0), trial


def test_two_machines_share_one_cluster_and_survive_a_node(redis_cluster: RedisClusterNodes,
                                                           daemon_factory) -> None:
    args = _daemon_args(redis_cluster.url)
    a: DaemonProcess = daemon_factory(*args, name="A").start()
    b: DaemonProcess = daemon_factory(*args, name="B").start()
    layout = small_layout()
    prompts = [[p * 10_000 + t for t in range(12 * 16)] for p in range(4)]  # 12 blocks each
    kvs = [random_kv(layout, len(t), seed=p) for p, t in enumerate(prompts)]
    full = len(prompts[0])
    with KVClient(a.target, layout) as ca, KVClient(b.target, layout, deadline_s=1.0) as cb:
        # -- publish on A; once written through, B finds and fetches it byte for byte
        assert cb.lookup(prompts[0]) == 0
        assert ca.publish(prompts[0], kvs[0]) == full
        _wait_for(lambda: _remote_written(ca) >= 12)
        assert cb.lookup(prompts[0]) == full
        n, got = cb.fetch(prompts[0])
        assert n == full and same_bytes(got, kvs[0])
        sb = cb.stats()
        remote_b = next(t for t in sb.tiers if t.name == "remote")
        assert remote_b.hits == 12 and sb.remote.lookup_hits == 12
        # blocks of one prompt spread over every node (no hash tag pins them to one)
        assert all(int(cli(s.port, "DBSIZE")) > 0 for s in redis_cluster.nodes)

        # -- a second prompt reaches the Cluster but not B's local tiers
        assert ca.publish(prompts[1], kvs[1]) == full
        _wait_for(lambda: _remote_written(ca) >= 24)

        # -- kill one node: B serves its local hits, remote misses are quick misses
        redis_cluster.kill(1)
        t0 = time.monotonic()
        n, got = cb.fetch(prompts[0])  # local (promoted into B's host tier)
        assert n == full and same_bytes(got, kvs[0])
        for _ in range(3):
            hits = cb.lookup(prompts[1])
            n, got = cb.fetch(prompts[1])
            assert hits < full and n < full  # a third of the blocks live on the dead node
            if n:
                assert same_bytes(got, kvs[1][:, :, :n])
        assert cb.publish(prompts[2], kvs[2]) == full  # local publish unaffected
        assert time.monotonic() - t0 < 3.0  # 8 calls, each well inside its 1 s deadline
        assert cb.stats().remote.breaker_opens >= 1

        # -- bring the node back (same port and nodes.conf): sharing resumes
        redis_cluster.restart(1)
        assert ca.publish(prompts[3], kvs[3]) == full
        _wait_for(lambda: cb.lookup(prompts[3]) == full)
        n, got = cb.fetch(prompts[3])
        assert n == full and same_bytes(got, kvs[3])
        assert ca.stats().integrity_failures == 0 and cb.stats().integrity_failures == 0


def test_held_counts_blocks_only_the_remote_tier_has(redis_server: RedisServer,
                                                    daemon_factory) -> None:
    """`held` (Lookup `each`) on a daemon whose local tiers hold none of a prompt another
    daemon wrote through: every block is held (the remote tier's, one batched EXISTS); with
    Redis gone, none is (a probe that fails is a miss)."""
    args = _daemon_args(redis_server.url)
    a: DaemonProcess = daemon_factory(*args, name="A").start()
    b: DaemonProcess = daemon_factory(*args, name="B").start()
    layout = small_layout()
    tokens = list(range(4 * 16))
    with KVClient(a.target, layout) as ca, KVClient(b.target, layout, deadline_s=1.0) as cb:
        assert ca.publish(tokens, random_kv(layout, len(tokens), seed=4)) == len(tokens)
        _wait_for(lambda: _remote_written(ca) >= 4)
        longer = tokens + list(range(1000, 1016))
        assert cb.held(longer) == [True] * 4 + [False]
        stats = cb.stats()
        assert stats is not None and stats.lookups == 0  # a probe, not a lookup
        redis_server.stop()
        assert cb.held(longer) == [False] * 5


def test_a_prefetching_lookup_brings_the_remote_prefix_into_host(redis_server: RedisServer,
                                                                 daemon_factory) -> None:
    """`lookup(..., prefetch=True)` (a disaggregated decode instance waiting for its producer's
    blocks): the reading daemon promotes the remote hit into its host tier in the background,
    so the fetch that follows reads nothing from Redis; proved by stopping Redis first."""
    import grpc

    from kvstore.proto import kvstore_pb2 as pb
    from kvstore.proto import kvstore_pb2_grpc as pb_grpc

    args = _daemon_args(redis_server.url)
    a: DaemonProcess = daemon_factory(*args, name="A").start()
    b: DaemonProcess = daemon_factory(*args, name="B").start()
    layout = small_layout()
    tokens = list(range(12 * 16))
    kv = random_kv(layout, len(tokens), seed=3)
    with KVClient(a.target, layout) as ca, KVClient(b.target, layout, deadline_s=1.0) as cb:
        assert ca.publish(tokens, kv) == len(tokens)
        _wait_for(lambda: _remote_written(ca) >= 12)
        assert cb.lookup(tokens) == len(tokens)  # no prefetch asked: none started
        stats = cb.stats()
        assert stats is not None and stats.prefetches == 0
        assert cb.lookup(tokens, prefetch=True) == len(tokens)
        _wait_for(lambda: (s := cb.stats()) is not None and s.prefetched_blocks == 12)
        assert cb.lookup(tokens, prefetch=True) == len(tokens)  # all in host: none started
        redis_server.stop()
        n, got = cb.fetch(tokens)
        assert n == len(tokens) and same_bytes(got, kv)
        stats = cb.stats()
        assert stats is not None and stats.prefetches == 1 and stats.integrity_failures == 0
        remote = next(t for t in stats.tiers if t.name == "remote")
        assert remote.hits == 0 and stats.hit_blocks == 12  # the fetch's; the prefetch's aren't
    with grpc.insecure_channel(b.target) as channel:  # prefetch without the layout it needs
        stub = pb_grpc.KVStoreStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.Lookup(pb.LookupRequest(namespace=NS, keys=[_key(1)], prefetch=True), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "layout" in e.value.details()


def test_a_remote_batch_that_evicts_a_block_it_skipped_leaves_nothing_pinned(
        redis_server: RedisServer, daemon_factory) -> None:
    """Pages stored one by one (SGLang's keys): daemon B holds page 1 only, and a fetch of
    pages 0-3 reads 0, 2 and 3 from Redis in one batch, whose room-making evicts page 1 (B's
    host holds 3 blocks). The fetch then reads page 1 in a new batch. Every page arrives
    byte-identical, and once the fetch is done nothing stays pinned: the first batch's
    pages 2 and 3, read but not taken yet, were dropped with their pins before the fix."""
    import hashlib

    from kvstore.client.aio import AsyncKVClient
    from kvstore.keys import KEY_VERSION

    class PageKeys(tuple[str, ...]):
        pass

    class PageKeyClient(AsyncKVClient):  # as client/integrations/sglang.py's
        def keys(self, tokens: object) -> list[bytes]:
            assert isinstance(tokens, PageKeys)
            prefix = KEY_VERSION + self.namespace.digest()
            return [hashlib.sha256(prefix + page.encode()).digest() for page in tokens]

    layout = small_layout()
    bt = layout.block_tokens
    kv = random_kv(layout, 4 * bt, seed=5)
    pages = [kv[:, :, i * bt:(i + 1) * bt].contiguous() for i in range(4)]
    block = pages[0].numel() * pages[0].element_size()
    a: DaemonProcess = daemon_factory(*_daemon_args(redis_server.url), name="A").start()
    b: DaemonProcess = daemon_factory("--host-bytes", str(3 * block), "--disk-bytes", "0",
                                      "--remote", redis_server.url, name="B").start()

    def produce(which: list[int]) -> Callable[..., None]:
        def copy(blocks: list[int], views: list[object], stop: object) -> None:
            for i, view in zip(blocks, views, strict=True):
                view.copy_(pages[which[i]])  # type: ignore[attr-defined]
        return copy

    got: dict[int, object] = {}

    def consume(blocks: list[int], views: list[object], stop: object) -> None:
        for i, view in zip(blocks, views, strict=True):
            got[i] = view.clone()  # type: ignore[attr-defined]

    async def run() -> int:
        ca, cb = PageKeyClient(a.target, layout), PageKeyClient(b.target, layout)
        try:
            names = PageKeys(f"p{i}" for i in range(4))
            assert await ca.publish_with(names, produce([0, 1, 2, 3])) == 4 * bt
            for _ in range(200):  # A's write-through
                if (st := await ca.stats()) is not None and st.remote.written_blocks >= 4:
                    break
                await asyncio.sleep(0.05)
            assert await cb.publish_with(PageKeys(["p1"]), produce([1])) == bt
            return await cb.fetch_with(names, consume)
        finally:
            await ca.close()
            await cb.close()

    assert asyncio.run(run()) == 4 * bt
    assert all(same_bytes(got[i], pages[i]) for i in range(4))  # type: ignore[arg-type]
    with KVClient(b.target, layout) as cb:
        stats = cb.stats()
        assert stats is not None and stats.active_leases == 0
        host = next(t for t in stats.tiers if t.name == "host")
        assert host.pinned_blocks == 0, host
        remote = next(t for t in stats.tiers if t.name == "remote")
        assert remote.hits >= 3  # pages 0, 2 and 3 did come from Redis


def test_a_cluster_with_no_node_up_is_a_miss_not_an_error(daemon_factory) -> None:
    # A Cluster client that reaches no node raises `RedisClusterException`, which is not a
    # `RedisError`: it escaped the tier's error handling, so every lookup past the local
    # prefix failed (the client's miss, however many blocks host held) and the breaker never
    # opened.
    dead = [redis_servers.free_port() for _ in range(2)]
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in dead)
    d = daemon_factory(*_daemon_args(url)).start()
    layout = small_layout()
    tokens = list(range(4 * 16))
    kv = random_kv(layout, len(tokens))
    with KVClient(d.target, layout, deadline_s=5.0) as c:
        assert c.publish(tokens, kv) == len(tokens)
        longer = tokens + list(range(1000, 1000 + 2 * 16))  # past the local prefix: asks remote
        assert c.lookup(longer) == len(tokens)
        n, got = c.fetch(longer)
        assert n == len(tokens) and same_bytes(got, kv)
        _wait_for(lambda: c.stats().remote.breaker_opens >= 1)
        r = c.stats().remote
    assert r.written_blocks == 0 and r.errors >= 1
    assert d.stop() == 0


def test_a_redis_restart_costs_no_failed_call(redis_server: RedisServer) -> None:
    # Both clients keep connections (the blocking one of writes, one per read thread of the
    # standalone reader); after a restart each is dead, and its first use must be retried on
    # a new one, not fail the call and open the breaker.
    writes = [RemoteWrite(NS, _key(i), frame_value(_key(i), LAYOUT, _payload(i)))
              for i in range(2)]

    async def main() -> RemoteTier:
        tier = RemoteTier(redis_server.url, RemoteOptions(timeout_s=2.0))
        try:
            assert (await tier.put(writes[:1])).written == 1
            assert await tier.get(NS, [_key(0)], LAYOUT) != [None]
            redis_server.kill()
            redis_server.start()  # same port, empty
            assert (await tier.put(writes[1:])).written == 1
            got = await tier.get(NS, [_key(0), _key(1)], LAYOUT)
            assert got[0] is None and got[1] is not None and bytes(got[1]) == _payload(1)
        finally:
            await tier.close()
        return tier

    s = asyncio.run(main()).stats()
    assert (s.breaker_opens, s.errors, s.failed_writes) == (0, 0, 0)
