"""`tiers.bulk_get.BulkGetter`, the remote tier's reader of a standalone server: against a real
`redis-server` (values, nil, errors, AUTH, SELECT), and against a socket that misbehaves in
ways a healthy Redis does not (replies cut anywhere, a connection closed mid-value), which a
real server cannot be made to do on cue.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import redis.cluster
from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from kvstore.integrity import HEADER_BYTES
from kvstore.tiers.bulk_get import BulkGetter
from kvstore.tiers.remote import (
    RemoteOptions,
    RemoteTier,
    RemoteUnavailableError,
    RemoteWrite,
    frame_value,
    redis_key,
)
from tests import redis_servers
from tests.redis_servers import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture
def locked_server(tmp_path: Path) -> Iterator[RedisServer]:
    if not redis_servers.available():
        pytest.skip(redis_servers.SKIP_REASON)
    server = RedisServer(tmp_path / "redis", password="s3cret-pw").start()
    yield server
    server.stop()


def test_values_nil_and_errors_come_back_in_order(redis_server: RedisServer) -> None:
    r = redis.Redis(port=redis_server.port)
    big, small = os.urandom((4 << 20) + 3), b"x"
    r.set(b"big", big)
    r.set(b"small", small)
    r.set(b"empty", b"")
    r.rpush(b"list", b"a")  # GET of a list: WRONGTYPE, an error in its place
    getter = BulkGetter("127.0.0.1", redis_server.port)
    try:
        for _ in range(3):  # the connection is reused, replies never out of step
            got = getter.get([b"big", b"missing", b"list", b"small", b"empty", b"big"])
            assert got[0] == big and got[1] is None and got[3] == small and got[4] == b""
            assert isinstance(got[2], ResponseError) and "WRONGTYPE" in str(got[2])
            assert got[5] == big
    finally:
        getter.close()
    with pytest.raises(RedisConnectionError, match="closed"):
        getter.get([b"small"])


def test_a_restarted_server_costs_no_failed_read(redis_server: RedisServer) -> None:
    # The thread's kept connection died with the server: its first use fails, and the getter
    # sends the GETs again on a new connection rather than fail the call (which would open
    # the remote tier's breaker: a second of misses after every Redis restart).
    redis.Redis(port=redis_server.port).set(b"k", b"v")
    getter = BulkGetter("127.0.0.1", redis_server.port)
    try:
        assert getter.get([b"k"]) == [b"v"]
        redis_server.kill()
        redis_server.start()  # same port; empty (no persistence)
        redis.Redis(port=redis_server.port).set(b"k", b"after")
        assert getter.get([b"k"]) == [b"after"]
    finally:
        getter.close()


def test_auth_and_select(locked_server: RedisServer) -> None:
    r = redis.Redis(port=locked_server.port, password="s3cret-pw", db=3)
    r.set(b"k", b"in db 3")
    good = BulkGetter("127.0.0.1", locked_server.port, password="s3cret-pw", db=3)
    assert good.get([b"k"]) == [b"in db 3"]
    assert BulkGetter("127.0.0.1", locked_server.port, password="s3cret-pw").get([b"k"]) == [None]
    with pytest.raises(AuthenticationError, match="AUTH refused"):
        BulkGetter("127.0.0.1", locked_server.port, password="wrong").get([b"k"])
    unauthenticated = BulkGetter("127.0.0.1", locked_server.port).get([b"k"])
    # NOAUTH: an error, never a value; of redis-py's class for it (a connection error, which
    # opens the remote tier's breaker, as with redis-py's own client)
    assert isinstance(unauthenticated[0], AuthenticationError)
    good.close()


def test_the_remote_tier_reads_a_password_protected_server(locked_server: RedisServer) -> None:
    key, layout = b"k" * 32, b"L" * 32
    payload = os.urandom(1 << 20)

    async def main(url: str) -> list[memoryview | None]:
        tier = RemoteTier(url)
        try:
            assert (await tier.put([RemoteWrite(b"n" * 32, key, frame_value(key, layout,
                                                                             payload))])).written
            return await tier.get(b"n" * 32, [key], layout)
        finally:
            await tier.close()

    got = asyncio.run(main(f"redis://:s3cret-pw@127.0.0.1:{locked_server.port}/2"))
    assert got[0] is not None and bytes(got[0]) == payload

    async def refused(url: str) -> None:
        tier = RemoteTier(url)
        try:
            with pytest.raises(RemoteUnavailableError, match="AUTH refused"):
                await tier.get(b"n" * 32, [key], layout)
        finally:
            await tier.close()

    asyncio.run(refused(f"redis://:wrong@127.0.0.1:{locked_server.port}/2"))


class _Scripted:
    """A loopback server that answers each connection with `script(conn)`."""

    def __init__(self, script: Callable[[socket.socket, int], None]) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.script = script
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.recv(65536)  # the pipeline (small here)
                self.script(conn, self.connections)

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def _scripted(script: Callable[[socket.socket, int], None]) -> Iterator[tuple[_Scripted,
                                                                               BulkGetter]]:
    """A `_Scripted` server and a getter connected to it, both closed after."""
    server = _Scripted(script)
    getter = BulkGetter("127.0.0.1", server.port, timeout_s=5.0)
    try:
        yield server, getter
    finally:
        getter.close()
        server.close()


def test_a_reply_cut_into_single_bytes_is_read_whole() -> None:
    value = os.urandom(70_000)  # longer than the line buffer
    reply = b"$-1\r\n" + b"$%d\r\n" % len(value) + value + b"\r\n" + b"-ERR nope\r\n"

    def trickle(conn: socket.socket, _: int) -> None:
        for i in range(0, 200):  # the first bytes one at a time: lines split anywhere
            conn.sendall(reply[i : i + 1])
        conn.sendall(reply[200:])
        conn.recv(1)  # until the client closes

    with _scripted(trickle) as (_, getter):
        got = getter.get([b"a", b"b", b"c"])
        assert got[0] is None and got[1] == value
        assert isinstance(got[2], ResponseError) and str(got[2]) == "nope"  # as redis-py says it


def test_a_connection_closed_mid_value_fails_the_call_and_the_next_reconnects() -> None:
    value = os.urandom(10_000)

    def script(conn: socket.socket, n: int) -> None:
        if n == 1:  # half a value, then gone
            conn.sendall(b"$%d\r\n" % len(value) + value[:5000])
            return
        conn.sendall(b"$%d\r\n" % len(value) + value + b"\r\n")
        conn.recv(1)

    with _scripted(script) as (server, getter):
        with pytest.raises(RedisConnectionError, match="closed the connection"):
            getter.get([b"a"])
        assert getter.get([b"a"]) == [value]  # a new connection, not the broken one's tail
        assert server.connections == 2


def test_garbage_from_the_server_is_a_failed_call_not_a_value() -> None:
    replies = [b"+OK\r\n", b"$3\r\nabcXY", b"$x9\r\n"]  # wrong type; no CRLF after; no length

    def script(conn: socket.socket, n: int) -> None:
        conn.sendall(replies[n - 1])
        conn.recv(1)

    with _scripted(script) as (server, getter):
        with pytest.raises(RedisConnectionError, match="unexpected reply"):
            getter.get([b"a"])
        with pytest.raises(RedisConnectionError, match="CRLF"):
            getter.get([b"a"])
        with pytest.raises(RedisConnectionError, match="bad bulk length"):
            getter.get([b"a"])
        assert server.connections == 3  # each failure closed its connection


@pytest.mark.parametrize("nodes", ["at-once", "in-turn"])
def test_a_cluster_read_routes_each_key_and_recovers_from_a_stale_map(
        redis_cluster: redis_servers.RedisClusterNodes, nodes: str, monkeypatch) -> None:
    from redis.exceptions import MovedError

    from kvstore.tiers import bulk_get
    from kvstore.tiers.bulk_get import ClusterBulkGetter

    monkeypatch.setattr(bulk_get, "PARALLEL_NODES", nodes == "at-once")

    nodes = [("127.0.0.1", s.port) for s in redis_cluster.nodes]
    writer = redis.cluster.RedisCluster(host="127.0.0.1", port=nodes[0][1])
    names = [b"key-%d" % i for i in range(30)]  # over every node's slots
    values = {n: os.urandom(1000 + i) for i, n in enumerate(names)}
    for n, v in values.items():
        writer.set(n, v)
    writer.close()
    getter = ClusterBulkGetter(nodes[1:])  # any node leads to the map
    try:
        got = getter.get([*names, b"missing"])
        assert got[:-1] == [values[n] for n in names] and got[-1] is None
        # A map gone stale (a resharding, a failover): every key sent to one node. The others'
        # keys come back MOVED, as misses, never as another key's value; the next call reads
        # the map again and finds them all.
        getter._slots = [nodes[0]] * len(getter._slots)
        stale = getter.get(names)
        moved = [v for v in stale if isinstance(v, MovedError)]
        assert 0 < len(moved) < len(names)
        assert all(v == values[n] for n, v in zip(names, stale, strict=True)
                   if not isinstance(v, MovedError))
        assert getter._slots is None
        assert getter.get(names) == [values[n] for n in names]
        # A node down: its keys fail in place (the tier's breaker opens on those), the other
        # nodes' keys still come back.
        redis_cluster.kill(1)
        down = getter.get(names)
        failed = [v for v in down if isinstance(v, RedisConnectionError)]
        assert 0 < len(failed) < len(names)
        assert all(v == values[n] for n, v in zip(names, down, strict=True)
                   if not isinstance(v, RedisConnectionError))
    finally:
        getter.close()


# ---- values read straight into the caller's memory (`RemoteTier.get_into`, `held`)
KEY, LAYOUT, NS = b"k" * 32, b"L" * 32, b"n" * 32


@pytest.mark.parametrize("give_up", ["deadline", "cancel"])
def test_a_read_given_up_writes_nothing_into_the_callers_memory_afterwards(give_up: str) -> None:
    # The store reads payloads straight into host reservations and frees them when the read
    # fails. A read past its deadline (or cancelled) whose thread went on receiving would
    # then write into memory another block may hold by now. The server sends half a value,
    # stalls (3 s), then sends the rest: nothing may land after `get_into` ended, and it must
    # end without waiting for the server.
    payload = os.urandom(1 << 20)
    frame = bytes(frame_value(KEY, LAYOUT, payload))
    reply = b"$%d\r\n" % len(frame) + frame + b"\r\n"
    half = len(reply) // 2
    resumed = threading.Event()

    def stall(conn: socket.socket, _: int) -> None:
        conn.sendall(reply[:half])
        threading.Event().wait(3.0)
        with contextlib.suppress(OSError):
            conn.sendall(reply[half:])
        resumed.set()
        with contextlib.suppress(OSError):
            conn.recv(1)

    server = _Scripted(stall)
    dst = bytearray(b"\xaa" * len(payload))

    async def main() -> None:
        tier = RemoteTier(f"redis://127.0.0.1:{server.port}",
                          RemoteOptions(timeout_s=0.3 if give_up == "deadline" else 30.0))
        try:
            began = asyncio.get_running_loop().time()
            call = asyncio.ensure_future(tier.get_into(NS, [KEY], LAYOUT, [memoryview(dst)]))
            if give_up == "deadline":
                with pytest.raises(RemoteUnavailableError, match="timed out"):
                    await call
            else:
                await asyncio.sleep(0.3)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
            assert asyncio.get_running_loop().time() - began < 2.0  # not held until 3 s
            at_end = bytes(dst)
            assert at_end != b"\xaa" * len(payload)  # the first half had landed: the test reads
            # The tier stays open (closing it would close the socket): the server resumes.
            assert await asyncio.to_thread(resumed.wait, 5)
            await asyncio.sleep(0.2)
            assert bytes(dst) == at_end  # and nothing landed after the call ended
        finally:
            await tier.close()

    try:
        asyncio.run(main())
    finally:
        server.close()


def test_values_read_in_place_are_verified_there(redis_server: RedisServer) -> None:
    r = redis.Redis(port=redis_server.port)
    size = 256 << 10
    keys = [bytes([i]) * 32 for i in range(6)]
    payloads = [os.urandom(size) for _ in keys]

    async def main() -> None:
        tier = RemoteTier(redis_server.url, RemoteOptions(timeout_s=2.0))
        try:
            writes = [RemoteWrite(NS, k, frame_value(k, LAYOUT, p))
                      for k, p in zip(keys[:5], payloads, strict=False)]
            writes[3] = RemoteWrite(NS, keys[3], frame_value(keys[3], LAYOUT, payloads[3][:-8]))
            writes[4] = RemoteWrite(NS, keys[4], frame_value(keys[4], b"M" * 32, payloads[4]))
            assert (await tier.put(writes)).written == 5
            r.setrange(redis_key(NS, keys[2]), HEADER_BYTES + 100, b"\x00\xff")  # damaged
            # keys: good, good, damaged, another size, another layout, absent
            assert await tier.held(NS, keys, LAYOUT, size) == [True, True, True, False, False,
                                                               False]
            dsts = [bytearray(b"\x55" * size) for _ in keys]
            got = await tier.get_into(NS, keys, LAYOUT, [memoryview(d) for d in dsts])
            assert got == [True, True, False, False, False, False]
            assert dsts[:2] == payloads[:2]
            # a value of another size never lands (one of another layout may: `held` said no)
            assert dsts[3] == dsts[5] == b"\x55" * size
            stats = tier.stats()
            assert stats.integrity_failures == 1 and stats.deleted == 1
            assert r.exists(redis_key(NS, keys[2])) == 0  # the damaged value is gone
            assert r.exists(redis_key(NS, keys[4])) == 1  # another layout's is kept
        finally:
            await tier.close()

    asyncio.run(main())


def test_a_redis_acl_user_with_the_documented_commands(redis_server: RedisServer, caplog) -> None:
    # The ACL line docs/OPERATIONS.md gives operators is enough for every call of the tier;
    # a user made for an older daemon (no GETRANGE) gets misses and one log line naming it.
    from kvstore.server.process import ROOT

    doc = (ROOT / "docs" / "OPERATIONS.md").read_text()
    line = next(t for t in doc.splitlines() if t.startswith("ACL SETUSER kvstore"))
    rules = line.split()[3:]
    rules[1] = ">kvs-acl-password"  # the doc's PASSWORD placeholder
    admin = redis.Redis(port=redis_server.port)
    admin.execute_command("ACL", "SETUSER", "kvstore", *rules)
    admin.execute_command("ACL", "SETUSER", "old", "on", ">kvs-acl-password", "~kvs1:*",
                          *[r for r in rules[2:] if r != "+getrange"])
    keys = [bytes([i]) * 32 for i in range(3)]
    payload = os.urandom(256 << 10)

    async def run(user: str) -> tuple[list[bool], list[bool], int]:
        tier = RemoteTier(f"redis://{user}:kvs-acl-password@127.0.0.1:{redis_server.port}/0",
                          RemoteOptions(timeout_s=2.0))
        try:
            writes = [RemoteWrite(NS, k, frame_value(k, LAYOUT, payload)) for k in keys]
            assert (await tier.put(writes)).written == len(keys)
            assert await tier.exists(NS, keys) == [True] * len(keys)
            held = await tier.held(NS, keys, LAYOUT, len(payload))
            dsts = [bytearray(len(payload)) for _ in keys]
            got = await tier.get_into(NS, keys, LAYOUT, [memoryview(d) for d in dsts])
            assert all(d == payload for d, ok in zip(dsts, got, strict=True) if ok)
            return held, got, await tier.clear(NS)
        finally:
            await tier.close()

    assert asyncio.run(run("kvstore")) == ([True] * 3, [True] * 3, 3)
    held, _, _ = asyncio.run(run("old"))
    assert held == [False] * 3  # every remote read would be a miss: logged, once
    refused = [r for r in caplog.records if "refuses GETRANGE" in r.getMessage()]
    assert len(refused) == 1 and refused[0].levelname == "ERROR"


def test_a_cluster_acl_user_with_the_documented_commands(
        redis_cluster: redis_servers.RedisClusterNodes, caplog) -> None:
    # docs/OPERATIONS.md's Cluster line, set on every node, is enough for every call of the
    # tier over a Cluster; the standalone line is not (CLUSTER SLOTS, COMMAND), and the
    # daemon says so once instead of redis-py's "Cluster mode is not enabled".
    from kvstore.server.process import ROOT

    doc = [t for t in (ROOT / "docs" / "OPERATIONS.md").read_text().splitlines()
           if t.startswith("ACL SETUSER kvstore")]
    lines = {"cluster": next(t for t in doc if "+cluster|slots" in t),
             "standalone": next(t for t in doc if "+cluster|slots" not in t)}
    for user, line in lines.items():
        rules = line.split()[3:]
        rules[1] = ">kvs-acl-password"  # the doc's PASSWORD placeholder
        for node in redis_cluster.nodes:
            redis_servers.cli(node.port, "ACL", "SETUSER", user, *rules, timeout=5)
    keys = [bytes([i]) * 32 for i in range(12)]  # over every node's slots
    payload = os.urandom(64 << 10)
    nodes = ",".join(f"127.0.0.1:{s.port}" for s in redis_cluster.nodes)

    async def run(user: str) -> tuple[list[bool], list[bool], list[bool], int]:
        tier = RemoteTier(f"redis+cluster://{user}:kvs-acl-password@{nodes}",
                          RemoteOptions(timeout_s=2.0))
        try:
            writes = [RemoteWrite(NS, k, frame_value(k, LAYOUT, payload)) for k in keys]
            assert (await tier.put(writes)).written == len(keys)
            dsts = [bytearray(len(payload)) for _ in keys]
            got = await tier.get_into(NS, keys, LAYOUT, [memoryview(d) for d in dsts])
            assert all(d == payload for d, ok in zip(dsts, got, strict=True) if ok)
            return (await tier.exists(NS, keys), await tier.held(NS, keys, LAYOUT, len(payload)),
                    got, await tier.clear(NS))
        finally:
            await tier.close()

    assert asyncio.run(run("cluster")) == ([True] * 12, [True] * 12, [True] * 12, 12)
    with pytest.raises(RemoteUnavailableError, match="Cluster mode is not enabled"):
        asyncio.run(run("standalone"))
    said = [r for r in caplog.records if "+cluster|slots and +command" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "ERROR"


def test_a_cluster_read_given_up_on_a_stalled_node_writes_nothing_afterwards(
        redis_cluster: redis_servers.RedisClusterNodes) -> None:
    # A Cluster node that stops answering mid-call (SIGSTOP: a machine paused, a GC-like
    # stall): the read across the Cluster ends at its deadline; once the node answers
    # again, its late replies land nowhere (the payloads are host memory the store has freed
    # by then), and the next read finds every key.
    import signal

    keys = [bytes([i]) * 32 for i in range(24)]  # over every node's slots
    payloads = {k: os.urandom(64 << 10) for k in keys}
    # The node holding the first key: read first were the nodes read one after another.
    seed = redis.cluster.RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    first = seed.get_node_from_key(redis_key(NS, keys[0])).port
    on_node = {k: seed.get_node_from_key(redis_key(NS, k)).port for k in keys}
    seed.close()
    stalled = next(s for s in redis_cluster.nodes if s.port == first)
    dsts = [bytearray(b"\xaa" * (64 << 10)) for _ in keys]

    async def main() -> None:
        tier = RemoteTier(redis_cluster.url, RemoteOptions(timeout_s=1.0, retry_s=0.1))
        try:
            writes = [RemoteWrite(NS, k, frame_value(k, LAYOUT, payloads[k])) for k in keys]
            assert (await tier.put(writes)).written == len(keys)
            on_stalled = int(cli_dbsize(stalled.port))
            assert 0 < on_stalled < len(keys)
            os.kill(stalled.proc.pid, signal.SIGSTOP)
            try:
                began = asyncio.get_running_loop().time()
                try:
                    got = await tier.get_into(NS, keys, LAYOUT, [memoryview(d) for d in dsts])
                except RemoteUnavailableError:
                    got = [False] * len(keys)
                assert asyncio.get_running_loop().time() - began < 3.0  # its deadline, ~1 s
                assert sum(not ok for ok in got) >= on_stalled  # its keys at least: misses
                at_end = [bytes(d) for d in dsts]
                # The other nodes were read meanwhile, not after it (`PARALLEL_NODES`).
                assert all(d == payloads[k] for k, d in zip(keys, dsts, strict=True)
                           if on_node[k] != first)
            finally:
                os.kill(stalled.proc.pid, signal.SIGCONT)
            await asyncio.sleep(0.5)  # the node answers what it was sent
            assert [bytes(d) for d in dsts] == at_end  # nothing landed after the call ended
            for ok, k, d in zip(got, keys, dsts, strict=True):
                assert not ok or d == payloads[k]  # a key reported read is that key's value
            deadline = asyncio.get_running_loop().time() + 10
            while True:  # past the breaker's window, every key comes back
                again = [bytearray(64 << 10) for _ in keys]
                try:
                    if all(await tier.get_into(NS, keys, LAYOUT,
                                               [memoryview(d) for d in again])):
                        break
                except RemoteUnavailableError:
                    pass
                assert asyncio.get_running_loop().time() < deadline, "no recovery"
                await asyncio.sleep(0.2)
            assert again == [bytearray(payloads[k]) for k in keys]
        finally:
            await tier.close()

    asyncio.run(main())


def cli_dbsize(port: int) -> str:
    return redis_servers.cli(port, "DBSIZE", timeout=2).strip()


def test_closing_the_tier_ends_a_cluster_read_stuck_on_a_paused_node(
        redis_cluster: redis_servers.RedisClusterNodes) -> None:
    # A daemon shutting down while a read waits on a paused node (a long deadline): closing
    # the tier ends that read at once, its keys misses, instead of holding the shutdown.
    import signal

    keys = [bytes([i]) * 32 for i in range(24)]
    payload = os.urandom(16 << 10)
    paused = redis_cluster.nodes[2]

    async def main() -> None:
        tier = RemoteTier(redis_cluster.url, RemoteOptions(timeout_s=30.0))
        writes = [RemoteWrite(NS, k, frame_value(k, LAYOUT, payload)) for k in keys]
        assert (await tier.put(writes)).written == len(keys)
        dsts = [bytearray(len(payload)) for _ in keys]
        os.kill(paused.proc.pid, signal.SIGSTOP)
        try:
            call = asyncio.ensure_future(
                tier.get_into(NS, keys, LAYOUT, [memoryview(d) for d in dsts]))
            await asyncio.sleep(0.5)
            assert not call.done()  # stuck on the paused node
            began = asyncio.get_running_loop().time()
            await tier.close()
            try:
                got = await call
            except RemoteUnavailableError:
                got = [False] * len(keys)
            assert asyncio.get_running_loop().time() - began < 5.0  # not its 30 s deadline
            assert not all(got)  # the paused node's keys at least: misses
            assert all(d == payload for d, ok in zip(dsts, got, strict=True) if ok)
        finally:
            os.kill(paused.proc.pid, signal.SIGCONT)

    asyncio.run(main())
