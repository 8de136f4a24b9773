"""Hostile and merely slow clients, written against the raw gRPC stubs (issue 13, items 1-4,
9 and 10): a block is exactly what was published under its key, namespace and tenant, or a
miss, whatever a client does with its leases and streams.

- Item 1: a Publish stream paused past `lease_timeout_s` cannot write into a slot the daemon
  has given to someone else, and a streaming Fetch read slowly never returns bytes from a
  reused slot: a lease a call is moving bytes for is held by that call, never reaped.
- Item 2: over TCP, Reserve (then Commit without bytes) and SHM fetches are refused: the
  arena is for Unix-socket callers only, and over TCP every byte of a block arrives through the
  daemon before it is committed.
- Item 3: Commit with a fetch lease changes nothing; the lease still releases its pins.
- Item 4: streams nobody reads (or writes) end after `lease_timeout_s`, with their slot,
  pins and memory.
- Item 9: a tenant's Stats shows its own blocks only.
- Item 10: an unexpected error in Fetch is logged and answered INTERNAL, like every other call.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from kvstore import KVLayout
from kvstore.client import KVClient
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.server.process import DaemonProcess
from tests.conftest import random_kv, same_bytes, small_layout
from tests.reliability import (
    Worker,
    layout_pb,
    rss_bytes,
    stats,
    stub,
    tier,
    wait_quiescent,
    wait_until,
)
from tests.security.test_tenants import (
    ADMIN,
    TOKEN_A,
    TOKEN_B,
    _free_port,
    _tiers,
    _tokens_file,
)

pytestmark = [pytest.mark.integration, pytest.mark.fault]
LEASE_S = 1.0
# 512 KiB blocks: a prefix of them is more than gRPC buffers, so a stream that is not read
# really stalls the daemon's writes.
BIG = KVLayout(model="big", num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32,
               block_tokens=256)


def _md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _block_bytes(kv: torch.Tensor, layout: KVLayout, i: int) -> bytes:
    """Block `i` of `kv` as the daemon stores it (the client's wire layout)."""
    t = layout.block_tokens
    return bytes(kv[:, :, i * t : (i + 1) * t].contiguous().view(torch.uint8).numpy())


@pytest.fixture
def tenant_daemon(daemon_factory, tmp_path):
    port = _free_port()
    f = _tokens_file(tmp_path, f"alpha {TOKEN_A}\nbravo {TOKEN_B}\n")
    d = daemon_factory("--listen", f"127.0.0.1:{port}", "--token", ADMIN,
                       "--tenant-tokens-file", str(f), "--host-bytes", "1MiB",
                       "--disk-bytes", "0").start()
    return d, f"127.0.0.1:{port}"


# ---- item 1
def test_publish_paused_past_its_lease_never_writes_into_another_block(daemon_factory):
    """A stream sends half a block, pauses past `lease_timeout_s` while an honest client
    fills the host tier (the reaper would have handed the paused slot on), then sends the
    rest. Every block the honest client can fetch afterwards is its own, byte for byte."""
    layout = small_layout()  # 8 KiB blocks
    d = daemon_factory("--host-bytes", f"{4 * layout.block_bytes}", "--disk-bytes", "0",
                       "--lease-timeout-s", str(LEASE_S)).start()
    with KVClient(d.target, layout, deadline_s=5) as honest:
        hostile_key = honest.keys(list(range(1000, 1016)))[0]
        ns = honest.namespace.digest()
    half = layout.block_bytes // 2
    resume = threading.Event()

    def hostile_stream() -> Iterator[pb.PublishChunk]:
        yield pb.PublishChunk(namespace=ns, layout=layout_pb(layout), keys=[hostile_key],
                              block_index=0, chunk_offset=0, data=b"\xee" * half)
        resume.wait(30)
        yield pb.PublishChunk(block_index=0, chunk_offset=half, data=b"\xee" * half)

    channel, raw = stub(d.target)
    outcome: dict[str, object] = {}

    def publish() -> None:
        try:
            outcome["reply"] = raw.Publish(hostile_stream(), timeout=60)
        except grpc.RpcError as e:
            outcome["code"] = e.code()

    hostile = Worker(target=publish, daemon=True)
    hostile.start()
    wait_until(lambda: stats(d.target).active_leases == 1, 10, "the hostile block reserved")
    time.sleep(LEASE_S + 1.5)  # the pause: past the lease and a reaper period
    prompts = [list(range(16 * i, 16 * i + 16)) for i in range(8)]  # one block each
    kvs = [random_kv(layout, 16, seed=i) for i in range(8)]
    with KVClient(d.target, layout, deadline_s=5) as honest:
        for tokens, kv in zip(prompts, kvs, strict=True):
            honest.publish(tokens, kv)
        resume.set()
        hostile.result(30)
        checked = 0
        for tokens, kv in zip(prompts, kvs, strict=True):
            n, got = honest.fetch(tokens)
            if n:
                assert same_bytes(got, kv), f"prompt {tokens[0] // 16} holds foreign bytes"
                checked += 1
    assert checked >= 3, f"only {checked} honest blocks cached: the test checked too little"
    # The paused block took longer than its lease: refused, and nothing of it stored.
    assert outcome.get("code") == grpc.StatusCode.DEADLINE_EXCEEDED, outcome
    with KVClient(d.target, layout, deadline_s=5) as c:
        assert c.lookup(list(range(1000, 1016))) == 0
    wait_quiescent(d.target, 5)
    channel.close()


# A same-node engine process whose zero-copy publish stalls mid-copy (its copy thread waits
# for the test's word; the test also stops the whole process, as when it is swapped out or
# stopped by a debugger), then resumes and finishes the copy it was in.
FROZEN_WRITER = """
import sys, torch
from kvstore.client import KVClient
from tests.conftest import small_layout

def produce(blocks, views, stop):
    views[0].view(torch.uint8).fill_(0x11)
    print("COPYING", flush=True)
    sys.stdin.readline()
    for v in views:  # the rest of the copy, after the lease expired
        v.view(torch.uint8).fill_(0xEE)

with KVClient(sys.argv[1], small_layout(), deadline_s=60) as c:
    print("CACHED", c.publish_with(list(range(1000, 1032)), produce), flush=True)
"""


def _frozen_writer(target: str) -> subprocess.Popen[str]:
    """The writer, stopped (SIGSTOP) in the middle of its copy into two reserved blocks; it
    finishes the copy once continued (SIGCONT) and given a line on stdin."""
    proc = subprocess.Popen([sys.executable, "-c", FROZEN_WRITER, target], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout is not None and proc.stdout.readline().strip() == "COPYING"
    proc.send_signal(signal.SIGSTOP)
    wait_until(lambda: Path(f"/proc/{proc.pid}/stat").read_text().split(") ")[1][0] == "T",
               10, "the writer stopped")
    return proc


@pytest.mark.parametrize("fence_s", [600, 0], ids=["fenced", "fence-off"])
def test_a_same_node_writer_frozen_past_its_lease_never_writes_into_another_block(
        daemon_factory, fence_s):
    """A same-node engine freezes in the middle of a zero-copy publish for longer than
    `lease_timeout_s`; an honest client fills the host tier meanwhile; the engine resumes and
    finishes its copy into its old slots. Fenced (the default), those slots were kept out of
    use while the frozen process lived: every block the honest client fetches is its own, and
    the space comes back when the writer ends its lease. With `--write-fence-s 0` the same
    scenario puts the frozen writer's bytes into the honest client's blocks: the hazard."""
    layout = small_layout()
    d = daemon_factory("--host-bytes", f"{4 * layout.block_bytes}", "--disk-bytes", "0",
                       "--lease-timeout-s", str(LEASE_S), "--write-fence-s", str(fence_s)
                       ).start()
    writer = _frozen_writer(d.target)
    try:
        wait_until(lambda: stats(d.target).expired_leases == 1, 10, "its lease expired")
        s = stats(d.target)
        assert s.fenced_leases == (1 if fence_s else 0)
        assert s.fenced_bytes == (2 * layout.block_bytes if fence_s else 0)
        prompts = [list(range(16 * i, 16 * i + 16)) for i in range(8)]  # one block each
        kvs = [random_kv(layout, 16, seed=i) for i in range(8)]
        with KVClient(d.target, layout, deadline_s=5) as honest:
            for tokens, kv in zip(prompts, kvs, strict=True):
                honest.publish(tokens, kv)
            assert tier(stats(d.target), "host").used_bytes <= 4 * layout.block_bytes
            writer.send_signal(signal.SIGCONT)
            out, err = writer.communicate("go\n", timeout=30)
            assert writer.returncode == 0, err
            assert out.strip() == "CACHED 0", out  # its Commit came too late: nothing stored
            held = [i for i, (tokens, kv) in enumerate(zip(prompts, kvs, strict=True))
                    if honest.lookup(tokens)]
            foreign = [i for i in held if not same_bytes(honest.fetch(prompts[i])[1], kvs[i])]
        if fence_s:
            assert len(held) >= 2 and foreign == [], f"prompts {foreign} hold foreign bytes"
            # The writer ended its lease after its copy: the space is back, nothing stored.
            wait_until(lambda: stats(d.target).fenced_bytes == 0, 5, "the fence ended")
        else:
            assert foreign, "without the fence the resumed copy should have hit a block"
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()


def test_a_frozen_writer_that_is_killed_gives_its_fenced_space_back(daemon_factory):
    """A writer that never resumes (SIGKILLed while stopped): its lock goes with it, and the
    daemon frees the fenced space at its next look, not after `write_fence_s`."""
    layout = small_layout()
    d = daemon_factory("--host-bytes", f"{4 * layout.block_bytes}", "--disk-bytes", "0",
                       "--lease-timeout-s", str(LEASE_S)).start()
    writer = _frozen_writer(d.target)
    wait_until(lambda: stats(d.target).fenced_leases == 1, 10, "its lease expired, fenced")
    time.sleep(1.5)  # several reaper periods: still fenced while the process lives
    assert stats(d.target).fenced_bytes == 2 * layout.block_bytes
    writer.kill()
    writer.wait()
    wait_until(lambda: stats(d.target).fenced_bytes == 0, 5, "the fence ended with the writer")
    assert tier(stats(d.target), "host").used_bytes == 0


def test_slow_stream_fetch_never_returns_bytes_from_a_reused_slot(daemon_factory):
    """A streaming fetch is read slowly (a pause past `lease_timeout_s`) while another
    client clears the namespace and publishes other bytes into the freed space: every chunk
    the slow reader gets is the published block's, or the call fails; never foreign bytes."""
    n_blocks = 24
    d = daemon_factory("--host-bytes", f"{n_blocks * BIG.block_bytes}", "--disk-bytes", "0",
                       "--lease-timeout-s", str(LEASE_S)).start()
    tokens = list(range(n_blocks * BIG.block_tokens))
    kv = random_kv(BIG, len(tokens))
    with KVClient(d.target, BIG, deadline_s=10) as c:
        assert c.publish(tokens, kv) == len(tokens)
        keys, ns = c.keys(tokens), c.namespace.digest()
    channel, raw = stub(d.target)
    chunks = raw.Fetch(pb.FetchRequest(namespace=ns, layout=layout_pb(BIG), keys=keys,
                                       transfer=pb.TRANSFER_STREAM), timeout=60)
    head = next(chunks)
    assert head.hits == n_blocks
    received: dict[int, bytearray] = {}
    first = next(chunks)
    received.setdefault(first.block_index, bytearray()).extend(first.data)
    time.sleep(LEASE_S + 1.5)  # the slow reader
    with KVClient(d.target, BIG, deadline_s=10, salt="other") as other:
        other.clear()  # the same namespace is not the other's; clear the reader's directly
        _, admin = stub(d.target)
        admin.Clear(pb.ClearRequest(namespace=ns), timeout=5)
        other.publish(tokens, random_kv(BIG, len(tokens), seed=9))
    code = grpc.StatusCode.OK
    try:
        for chunk in chunks:
            received.setdefault(chunk.block_index, bytearray()).extend(chunk.data)
    except grpc.RpcError as e:
        code = e.code()
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED), code
    for i, got in received.items():
        want = _block_bytes(kv, BIG, i)
        assert bytes(got) == want[: len(got)], f"block {i}: foreign bytes in a fetch"
    if code == grpc.StatusCode.OK:  # the whole prefix then, every byte
        assert len(received) == n_blocks
        assert all(len(b) == BIG.block_bytes for b in received.values())
    wait_quiescent(d.target, 5)
    channel.close()


# ---- item 2
def test_tcp_reserve_cannot_commit_bytes_it_never_sent(tenant_daemon):
    """Tenant A's blocks are cleared (their bytes stay in the freed slots); tenant B reserves
    the same space over TCP and commits without sending a byte. Refused: B never reads A's
    KV, and nothing is stored under B's keys."""
    d, tcp = tenant_daemon
    layout = small_layout()
    tokens = list(range(64))
    with KVClient(tcp, layout, token=TOKEN_A, deadline_s=5) as a:
        assert a.publish(tokens, random_kv(layout, 64)) == 64
        assert a.clear() == 4
    channel = grpc.insecure_channel(tcp)
    raw = pb_grpc.KVStoreStub(channel)
    with KVClient(tcp, layout, token=TOKEN_B, deadline_s=5) as b:
        keys, ns = b.keys(tokens), b.namespace.digest()
        with pytest.raises(grpc.RpcError) as e:
            raw.Reserve(pb.ReserveRequest(namespace=ns, layout=layout_pb(layout), keys=keys),
                        metadata=_md(TOKEN_B), timeout=5)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "Unix-socket" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            raw.Commit(pb.CommitRequest(lease_id=12345), metadata=_md(TOKEN_B), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        # SHM fetches too: arena offsets are of no use over TCP, and their leases pin blocks.
        with pytest.raises(grpc.RpcError) as e:
            list(raw.Fetch(pb.FetchRequest(namespace=ns, layout=layout_pb(layout), keys=keys,
                                           transfer=pb.TRANSFER_SHM),
                           metadata=_md(TOKEN_B), timeout=5))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert b.lookup(tokens) == 0
        assert b.fetch(tokens) == (0, None)
    wait_quiescent(d.target, 5)
    channel.close()


# ---- item 3
def test_commit_with_a_fetch_lease_keeps_the_lease_and_its_pins(daemon):
    layout = small_layout()
    tokens = list(range(64))
    with KVClient(daemon.target, layout, deadline_s=5) as c:
        assert c.publish(tokens, random_kv(layout, 64)) == 64
        keys, ns = c.keys(tokens), c.namespace.digest()
    channel, raw = stub(daemon.target)
    head = next(iter(raw.Fetch(pb.FetchRequest(namespace=ns, layout=layout_pb(layout),
                                               keys=keys, transfer=pb.TRANSFER_SHM),
                               timeout=5)))
    assert head.hits == 4 and head.lease_id
    assert tier(stats(daemon.target), "host").pinned_blocks == 4
    with pytest.raises(grpc.RpcError) as e:
        raw.Commit(pb.CommitRequest(lease_id=head.lease_id), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "fetch lease" in e.value.details()
    assert raw.Release(pb.ReleaseRequest(lease_id=head.lease_id), timeout=5).released
    wait_quiescent(daemon.target, 5)  # no pin left behind
    with KVClient(daemon.target, layout, deadline_s=5) as c:  # and the tier still takes blocks
        assert c.clear(all_namespaces=True) == 4
        assert c.publish(tokens, random_kv(layout, 64, seed=3)) == 64
    channel.close()


# ---- item 4
def test_streams_nobody_reads_end_with_their_slot_pins_and_memory(daemon_factory):
    """Fetch streams nobody reads and a Publish stream that sends one message and goes
    silent take all the stream slots (a quarter of max_concurrent_rpcs): another stream is
    shed, but unary callers are still served; within a few lease timeouts the daemon ends
    every stalled stream, and no lease, pin or in-flight call is left."""
    n_blocks = 24
    d = daemon_factory("--host-bytes", f"{n_blocks * BIG.block_bytes}", "--disk-bytes", "0",
                       "--lease-timeout-s", str(LEASE_S), "--max-concurrent-rpcs", "12").start()
    tokens = list(range(n_blocks * BIG.block_tokens))
    kv = random_kv(BIG, len(tokens))
    with KVClient(d.target, BIG, deadline_s=10) as c:
        assert c.publish(tokens, kv) == len(tokens)
        keys, ns = c.keys(tokens), c.namespace.digest()
    anon0 = rss_bytes(d.proc.pid)["RssAnon"]
    channel, raw = stub(d.target)
    request = pb.FetchRequest(namespace=ns, layout=layout_pb(BIG), keys=keys,
                              transfer=pb.TRANSFER_STREAM)
    stalled = []
    for _ in range(2):
        it = raw.Fetch(request, timeout=120)
        assert next(it).hits == n_blocks  # the header; the rest is never read
        stalled.append(it)
    silent = threading.Event()

    def one_message() -> Iterator[pb.PublishChunk]:
        yield pb.PublishChunk(namespace=ns, layout=layout_pb(BIG), keys=keys[:1])
        silent.wait(60)

    publish = raw.Publish.future(one_message(), timeout=120)
    wait_until(lambda: stats(d.target).inflight_rpcs >= 3, 10, "the stalled calls admitted")
    peak = rss_bytes(d.proc.pid)["RssAnon"]
    with pytest.raises(grpc.RpcError) as e:  # the 3 stream slots are taken
        next(raw.Fetch(request, timeout=5))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # ...but not the daemon: same-node and unary callers still get in.
    assert raw.Lookup(pb.LookupRequest(namespace=ns, keys=keys), timeout=5).hits == n_blocks
    # Ended by the daemon, not by these clients (which stay connected and silent).
    wait_quiescent(d.target, 4 * LEASE_S + 5)
    with pytest.raises(grpc.RpcError) as e:
        publish.result(timeout=10)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for it in stalled:
        with pytest.raises(grpc.RpcError) as e:
            for _ in it:
                pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    silent.set()
    held_mib = (peak - anon0) / 2**20
    print(f"daemon anon memory held by 2 unread fetch streams: {held_mib:.1f} MiB")
    assert held_mib < 2 * 16, f"{held_mib:.0f} MiB held by 2 stalled streams"
    with KVClient(d.target, BIG, deadline_s=10) as c:  # still serving, byte-exact
        n, got = c.fetch(tokens)
        assert n == len(tokens) and same_bytes(got, kv)
    channel.close()


def test_a_tenant_pinning_its_blocks_cannot_evict_another_within_its_share(daemon_factory,
                                                                          tmp_path):
    """Alpha fills 3/4 of host beside bravo's 1/4, holds all of its blocks pinned with a
    streaming fetch it stops reading, and publishes more. Bravo, within its half, keeps every
    block in host. Before, with every block of alpha's pinned, its next block evicted one of
    bravo's (here its deepest, to disk): a new stream pinning each batch would repeat that."""
    port = _free_port()
    f = _tokens_file(tmp_path, f"alpha {TOKEN_A}\nbravo {TOKEN_B}\n")
    d = daemon_factory("--listen", f"127.0.0.1:{port}", "--tenant-tokens-file", str(f),
                       "--host-bytes", "8MiB", "--disk-bytes", "32MiB",
                       "--lease-timeout-s", "30").start()
    tcp = f"127.0.0.1:{port}"
    layout = small_layout(num_layers=4, num_kv_heads=4, head_dim=64)  # 128 KiB: 64 in host
    bravo_prompt, alpha_prompt = list(range(16 * 16)), [10**6 + i for i in range(48 * 16)]
    bravo_kv = random_kv(layout, len(bravo_prompt), seed=1)
    with KVClient(tcp, layout, token=TOKEN_B, deadline_s=10) as b:
        assert b.publish(bravo_prompt, bravo_kv) == len(bravo_prompt)
    with KVClient(tcp, layout, token=TOKEN_A, deadline_s=10) as a:
        assert a.publish(alpha_prompt, random_kv(layout, len(alpha_prompt))) == len(alpha_prompt)
        keys, ns = a.keys(alpha_prompt), a.namespace.digest()
    assert tier(stats(d.target), "host").blocks == 64  # full
    # Without BDP probing the HTTP/2 window stays at 64 KiB: with it, gRPC grows the window
    # until the unread 6 MiB may all arrive, and the stream ends and unpins.
    channel = grpc.insecure_channel(tcp, options=[("grpc.http2.bdp_probe", 0)])
    chunks = pb_grpc.KVStoreStub(channel).Fetch(
        pb.FetchRequest(namespace=ns, layout=layout_pb(layout), keys=keys,
                        transfer=pb.TRANSFER_STREAM), metadata=_md(TOKEN_A), timeout=60)
    assert next(chunks).hits == 48
    next(chunks)  # then alpha stops reading: its 48 blocks stay pinned
    assert tier(stats(d.target), "host").pinned_blocks == 48  # the attack's premise
    with KVClient(tcp, layout, token=TOKEN_A, deadline_s=10) as a:
        for r in range(4):  # 64 more blocks: host's size
            more = [2 * 10**6 + r * 256 + i for i in range(256)]
            a.publish(more, random_kv(layout, len(more), seed=r))
    assert tier(stats(d.target), "host").pinned_blocks == 48  # still held throughout
    with KVClient(tcp, layout, token=TOKEN_B, deadline_s=10) as b:
        assert _tiers(tcp, TOKEN_B, b, bravo_prompt) == ["host"] * 16
        n, got = b.fetch(bravo_prompt)
        assert n == len(bravo_prompt) and same_bytes(got, bravo_kv)
    chunks.cancel()
    channel.close()
    wait_quiescent(d.target, 10)


class _UnderFileLimit(DaemonProcess):
    """A daemon started under an open-file limit of 256, soft and hard (`prlimit` execs it:
    the same pid), as a service under a low limit."""

    def command(self) -> list[str]:
        return ["prlimit", "--nofile=256:256", "--", *super().command()]


def test_a_connection_flood_leaves_same_node_engines_their_daemon(tmp_path):
    """300 TCP connections that never speak (no token needed to open one) against a daemon
    started under 256 open files, with the default `max_tcp_connections`: the daemon holds at
    most half its limit (128) and closes the rest as they arrive, a same-node engine publishes
    and finds 20 blocks, and the silent connections are closed after the handshake timeout.
    Before, they took every descriptor: gRPC could accept nothing more, the engine's publish
    stored 0 blocks and its lookup found 0."""
    port = _free_port()
    f = _tokens_file(tmp_path, f"alpha {TOKEN_A}\n")
    d = _UnderFileLimit(tmp_path / "d", "--listen", f"127.0.0.1:{port}", "--tenant-tokens-file",
                        str(f), "--host-bytes", "8MiB", "--disk-bytes", "64MiB")
    flood: list[socket.socket] = []
    try:
        d.start()
        assert d.proc is not None
        assert "the TCP listener holds at most 128 connections" in d.log.read_text()
        fds = Path(f"/proc/{d.proc.pid}/fd")
        baseline = len(list(fds.iterdir()))
        for _ in range(300):
            with contextlib.suppress(OSError):  # refused or reset once the listener is full
                flood.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        time.sleep(1)  # accepted (128) or closed at once (the rest)
        assert len(list(fds.iterdir())) <= baseline + 128 + 8
        layout = small_layout()
        tokens = list(range(20 * layout.block_tokens))
        with KVClient(d.target, layout, deadline_s=10) as engine:
            assert engine.publish(tokens, random_kv(layout, len(tokens))) == len(tokens)
            assert engine.lookup(tokens) == len(tokens)
        # Silent connections are closed once the handshake times out (gRPC's default: 120 s).
        wait_until(lambda: len(list(fds.iterdir())) <= baseline + 8, 30,
                   "the silent connections were not closed")
        for s in flood:
            s.close()
        with KVClient(f"127.0.0.1:{port}", layout, token=TOKEN_A, deadline_s=10) as a:
            assert a.publish(tokens, random_kv(layout, len(tokens))) == len(tokens)  # TCP serves
    finally:
        for s in flood:
            s.close()
        d.kill()


def test_a_connection_flood_on_the_kv_events_port_leaves_the_daemon_its_descriptors(tmp_path):
    """300 TCP connections that never speak, to the KV events endpoint (ZMQ caps none, and
    opening one needs no token) of a daemon started under 256 open files: they take the
    descriptors of the events' own process, not the daemon's. A same-node engine publishes
    and finds 20 blocks meanwhile, and once the flood ends a subscriber gets events again.
    With the sockets in the daemon's process, the flood took all 256 of its descriptors."""
    from tests.integration.test_kv_events import LAYOUT, Subscriber, wait_connected

    port = _free_port()
    d = _UnderFileLimit(tmp_path / "d", "--host-bytes", "8MiB", "--disk-bytes", "64MiB",
                        "--kv-events", f"tcp://127.0.0.1:{port}")
    flood: list[socket.socket] = []
    try:
        d.start()
        assert d.proc is not None
        fds = Path(f"/proc/{d.proc.pid}/fd")
        baseline = len(list(fds.iterdir()))
        for _ in range(300):
            with contextlib.suppress(OSError):  # refused once the events' process is full
                flood.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        time.sleep(1)
        assert len(flood) > 200  # the connections were made (and held)
        assert len(list(fds.iterdir())) <= baseline + 8
        # At its limit libzmq retries the failed accepts at once, forever: the events'
        # process spins, so it runs at the lowest priority and is the OOM killer's first pick.
        children = Path(f"/proc/{d.proc.pid}/task/{d.proc.pid}/children").read_text().split()
        held = {int(c): len(list(Path(f"/proc/{c}/fd").iterdir())) for c in children}
        events_pid = max(held, key=held.__getitem__)
        assert held[events_pid] > 200  # the flood's connections are there
        assert os.getpriority(os.PRIO_PROCESS, events_pid) == 19
        assert Path(f"/proc/{events_pid}/oom_score_adj").read_text().strip() == "1000"
        tokens = list(range(20 * LAYOUT.block_tokens))
        with KVClient(d.target, LAYOUT, deadline_s=10) as engine:
            assert engine.publish(tokens, random_kv(LAYOUT, len(tokens))) == len(tokens)
            assert engine.lookup(tokens) == len(tokens)
            for s in flood:
                s.close()
            flood.clear()
            sub = Subscriber(f"tcp://127.0.0.1:{port}")
            try:
                wait_connected(sub, engine)  # events flow again
            finally:
                sub.close()
    finally:
        for s in flood:
            s.close()
        d.kill()


def _established(port: int) -> int:
    """TCP connections established to local port `port` (the daemon's ends), from the kernel
    (tcp6 too: gRPC's listener takes IPv4 connections as IPv6-mapped)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                n += 1
    return n


def test_idle_tcp_connections_are_closed_and_their_clients_reconnect(daemon_factory, tmp_path):
    """Three TCP clients make calls and then hold their connections without one: with
    `tcp_idle_timeout_s` 2 the daemon closes every one within seconds (abandoned connections
    give their slot of `max_tcp_connections` back), and each client's next call reconnects
    and is served. The control: a daemon with the default (300 s) keeps its three open."""
    port, idle_port = _free_port(), _free_port()
    f = _tokens_file(tmp_path, f"alpha {TOKEN_A}\n")
    common = ("--tenant-tokens-file", str(f), "--host-bytes", "8MiB", "--disk-bytes", "64MiB")
    daemon_factory("--listen", f"127.0.0.1:{idle_port}", "--tcp-idle-timeout-s", "2",
                   *common).start()
    daemon_factory("--listen", f"127.0.0.1:{port}", *common, name="d1").start()
    layout = small_layout()
    tokens = list(range(4 * layout.block_tokens))
    kv = random_kv(layout, len(tokens))
    kept, idle = ([KVClient(f"127.0.0.1:{p}", layout, token=TOKEN_A, deadline_s=10)
                   for _ in range(3)] for p in (port, idle_port))
    try:
        for c in kept + idle:
            assert c.publish(tokens, kv) == len(tokens) and c.lookup(tokens) == len(tokens)
            if c in idle:  # seen open at once (closing takes 2 s without a call)
                assert _established(idle_port) >= 1
        assert _established(port) >= 3
        wait_until(lambda: _established(idle_port) == 0, 20,
                   "idle connections were not closed")
        assert _established(port) >= 3  # the default keeps them
        for c in idle + kept:  # reconnected at the next call
            n, got = c.fetch(tokens)
            assert n == len(tokens) and same_bytes(got, kv)
            if c in idle:
                assert _established(idle_port) >= 1
    finally:
        for c in kept + idle:
            c.close()


def test_clients_that_never_finish_a_metrics_request_leave_the_daemon_its_descriptors(
        daemon_factory):
    """80 connections to the metrics port that never send a request, against a daemon held
    to 64 open files: at most 16 are served at once (the rest closed as they arrive) and each
    is closed after 10 s of silence, so a same-node engine still publishes and Prometheus still
    scrapes once they are gone. Before, each held a thread and a descriptor for good: they
    took every descriptor, and the engine's publish stored 0 blocks."""
    mport = _free_port()
    d = daemon_factory("--host-bytes", "8MiB", "--disk-bytes", "64MiB",
                       "--metrics-port", str(mport)).start()
    assert d.proc is not None
    fds = Path(f"/proc/{d.proc.pid}/fd")
    baseline = len(list(fds.iterdir()))
    resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (64, 64))
    flood = []
    for _ in range(80):
        with contextlib.suppress(OSError):  # a connection the server closed or did not take
            flood.append(socket.create_connection(("127.0.0.1", mport), timeout=2))
    try:
        time.sleep(1)
        assert len(list(fds.iterdir())) <= baseline + 16 + 8
        layout = small_layout()
        tokens = list(range(20 * layout.block_tokens))
        with KVClient(d.target, layout, deadline_s=10) as engine:
            assert engine.publish(tokens, random_kv(layout, len(tokens))) == len(tokens)
        wait_until(lambda: len(list(fds.iterdir())) <= baseline + 8, 30,
                   "the silent metrics connections were not closed")
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10)
        assert b"kvstore_tier_used_bytes" in scrape.read()
    finally:
        for s in flood:
            s.close()


def test_a_tenant_holding_every_slot_it_may_leaves_the_others_admitted(daemon_factory,
                                                                         tmp_path):
    """Alpha opens eight fetches at once, each held for seconds by a slow disk read, against
    a limit of eight calls: four are admitted (a tenant's half), four are shed at once with
    RESOURCE_EXHAUSTED naming the tenant's limit, and meanwhile bravo and same-node callers
    are served. Before tenants had a share, alpha took all eight and bravo was shed."""
    port = _free_port()
    f = _tokens_file(tmp_path, f"alpha {TOKEN_A}\nbravo {TOKEN_B}\n")
    d = daemon_factory("--listen", f"127.0.0.1:{port}", "--tenant-tokens-file", str(f),
                       "--host-bytes", f"{8 * BIG.block_bytes}",
                       "--disk-bytes", f"{64 * BIG.block_bytes}",
                       "--max-concurrent-rpcs", "8", "--fault-disk-read-delay-s", "5").start()
    tcp = f"127.0.0.1:{port}"
    t = BIG.block_tokens
    with KVClient(tcp, BIG, token=TOKEN_A, deadline_s=20) as a:
        assert a.publish(list(range(t)), random_kv(BIG, t)) == t
        for r in range(1, 4):  # 24 blocks more: the first goes to disk
            tokens = [10**6 * r + i for i in range(8 * t)]
            assert a.publish(tokens, random_kv(BIG, 8 * t, seed=r)) == 8 * t
        keys, ns = a.keys(list(range(t))), a.namespace.digest()
    channel, raw = stub(tcp)
    lookup = raw.Lookup(pb.LookupRequest(namespace=ns, keys=keys), metadata=_md(TOKEN_A),
                        timeout=10)
    assert list(lookup.tiers) == ["disk"]
    request = pb.FetchRequest(namespace=ns, layout=layout_pb(BIG), keys=keys,
                              transfer=pb.TRANSFER_STREAM)

    def fetch() -> tuple[float, int | str]:
        """(seconds, the hits, or the status and details of a refusal), the stream read out."""
        t0 = time.monotonic()
        try:
            messages = list(raw.Fetch(request, metadata=_md(TOKEN_A), timeout=30))
        except grpc.RpcError as e:
            return time.monotonic() - t0, f"{e.code().name}: {e.details()}"
        return time.monotonic() - t0, messages[0].hits

    with ThreadPoolExecutor(8) as pool:
        calls = [pool.submit(fetch) for _ in range(8)]
        time.sleep(1.0)  # every call has reached the daemon; the disk reads take 5 s
        # Alpha holds its four slots for seconds; bravo and same-node callers get in.
        assert raw.Lookup(pb.LookupRequest(namespace=bytes(32), keys=keys),
                          metadata=_md(TOKEN_B), timeout=5).hits == 0
        with KVClient(d.target, BIG, deadline_s=5) as local:
            assert local.lookup(list(range(t))) == 0
        assert sum(c.done() for c in calls) == 4  # the admitted four still read the disk
        got = [c.result() for c in calls]
    shed = [(s, why) for s, why in got if s < 3]
    assert len(shed) == 4, got
    assert all(str(why).startswith("RESOURCE_EXHAUSTED: tenant 'alpha' has 4 calls in progress, "
                                   "a tenant's limit is 4") for _, why in shed), shed
    # The admitted four held their slots through the 5 s read. They then stream: at most one
    # of alpha's at a time (half of the 2 stream slots), so some may be shed at that point.
    held = [why for s, why in got if s >= 3]
    assert len(held) == 4 and 1 in held, got
    channel.close()


# ---- item 9
def test_tenant_stats_show_only_its_own_blocks(tenant_daemon):
    _, tcp = tenant_daemon
    layout = small_layout()
    with KVClient(tcp, layout, token=TOKEN_A, deadline_s=5) as a:
        assert a.publish(list(range(64)), random_kv(layout, 64)) == 64
        a.lookup(list(range(64)))
    with KVClient(tcp, layout, token=TOKEN_B, deadline_s=5) as b:
        assert b.publish(list(range(32)), random_kv(layout, 32)) == 32
    channel = grpc.insecure_channel(tcp)
    raw = pb_grpc.KVStoreStub(channel)
    mine_a = raw.Stats(pb.StatsRequest(), metadata=_md(TOKEN_A), timeout=5)
    mine_b = raw.Stats(pb.StatsRequest(), metadata=_md(TOKEN_B), timeout=5)
    every = raw.Stats(pb.StatsRequest(), metadata=_md(ADMIN), timeout=5)
    assert tier(mine_a, "host").blocks == 4 and tier(mine_b, "host").blocks == 2
    assert tier(every, "host").blocks == 6
    assert tier(mine_b, "host").used_bytes == 2 * layout.block_bytes
    assert tier(mine_b, "host").capacity_bytes == tier(every, "host").capacity_bytes
    # The daemon's traffic is every tenant's together: a tenant sees none of it.
    assert every.lookups > 0 and every.stored_blocks == 6
    assert mine_b.lookups == mine_b.stored_blocks == mine_b.hit_blocks == 0
    assert mine_b.active_leases == 0 and tier(mine_b, "host").bytes_written == 0
    channel.close()


def test_a_tenant_finds_its_blocks_in_stats_and_inspect_after_a_restart(daemon_factory,
                                                                         tmp_path):
    """The daemon forgets which namespaces it has seen when it restarts, but a tenant's
    stored namespace names the tenant: alpha's Stats and Inspect still count the blocks it
    published before (flushed to disk at SIGTERM), bravo's count none of them, and the
    admin's Inspect names their tenant."""
    port = _free_port()
    f = _tokens_file(tmp_path, f"alpha {TOKEN_A}\nbravo {TOKEN_B}\n")
    args = ("--listen", f"127.0.0.1:{port}", "--token", ADMIN, "--tenant-tokens-file", str(f),
            "--host-bytes", "4MiB", "--disk-bytes", "16MiB")
    d = daemon_factory(*args).start()
    tcp, layout = f"127.0.0.1:{port}", small_layout()
    kv = random_kv(layout, 64)
    with KVClient(tcp, layout, token=TOKEN_A, deadline_s=5) as a:
        assert a.publish(list(range(64)), kv) == 64
    assert d.stop() == 0
    d.start()
    channel = grpc.insecure_channel(tcp)
    raw = pb_grpc.KVStoreStub(channel)
    mine = raw.Stats(pb.StatsRequest(), metadata=_md(TOKEN_A), timeout=5)
    assert sum(t.blocks for t in mine.tiers) == 4
    theirs = raw.Stats(pb.StatsRequest(), metadata=_md(TOKEN_B), timeout=5)
    assert sum(t.blocks for t in theirs.tiers) == 0
    listed = raw.Inspect(pb.InspectRequest(), metadata=_md(TOKEN_A), timeout=5).namespaces
    assert [n.tenant for n in listed] == ["alpha"]
    assert sum(t.blocks for t in listed[0].tiers) == 4
    assert not raw.Inspect(pb.InspectRequest(), metadata=_md(TOKEN_B), timeout=5).namespaces
    admin = raw.Inspect(pb.InspectRequest(), metadata=_md(ADMIN), timeout=5).namespaces
    assert [n.tenant for n in admin] == ["alpha"]
    with KVClient(tcp, layout, token=TOKEN_A, deadline_s=5) as a:  # and still its blocks
        n, got = a.fetch(list(range(64)))
        assert n == 64 and same_bytes(got, kv)
    channel.close()


# ---- item 10
def test_fetch_internal_error_reaches_log_and_metrics(tmp_path, caplog):
    import asyncio

    from kvstore.server.metrics import Metrics
    from kvstore.server.service import KVStoreService, add_service
    from kvstore.server.store import TieredStore
    from kvstore.tiers.host import HostTier

    store = TieredStore(HostTier(1 << 20, shm_dir=tmp_path), None)

    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated bug")

    store.fetch = broken  # type: ignore[method-assign]  # a fault no request can cause
    metrics = Metrics(store)
    service = KVStoreService(store, metrics, max_blocks_per_call=64, max_message_bytes=1 << 20)
    layout = small_layout()

    async def run() -> grpc.StatusCode:
        server = grpc.aio.server()
        add_service(service, server)
        sock = tmp_path / "s.sock"
        server.add_insecure_port(f"unix:{sock}")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
                call = pb_grpc.KVStoreStub(ch).Fetch(pb.FetchRequest(
                    namespace=bytes(32), layout=layout_pb(layout), keys=[bytes(32)]))
                try:
                    async for _ in call:
                        pass
                except grpc.aio.AioRpcError as e:
                    return e.code()
                return grpc.StatusCode.OK
        finally:
            await server.stop(0)

    with caplog.at_level("ERROR"):
        code = asyncio.run(run())
    store.close()
    assert code == grpc.StatusCode.INTERNAL
    assert "Fetch failed" in caplog.text and "simulated bug" in caplog.text
    count = metrics.registry.get_sample_value("kvstore_rpc_seconds_count",
                                              {"method": "Fetch", "code": "INTERNAL"})
    assert count == 1  # counted as INTERNAL, not as OK


def test_clients_abandoning_stream_fetches_are_not_daemon_errors(daemon_factory):
    """Clients cancelling stream fetches midway, or dropping their connection: the daemon's
    writes to those streams fail, which is the client's choice. Before, some of them were
    logged at ERROR with a traceback and counted INTERNAL: a tenant could flood the log and
    fire "internal error" alerts at will."""
    metrics, port = _free_port(), _free_port()
    n_blocks = 24
    d = daemon_factory("--host-bytes", f"{n_blocks * BIG.block_bytes}", "--disk-bytes", "0",
                       "--metrics-port", str(metrics), "--listen", f"127.0.0.1:{port}",
                       "--token", ADMIN).start()
    tcp = f"127.0.0.1:{port}"
    tokens = list(range(n_blocks * BIG.block_tokens))
    kv = random_kv(BIG, len(tokens))
    with KVClient(tcp, BIG, deadline_s=10, token=ADMIN) as c:
        assert c.publish(tokens, kv) == len(tokens)
        keys, ns = c.keys(tokens), c.namespace.digest()
    request = pb.FetchRequest(namespace=ns, layout=layout_pb(BIG), keys=keys,
                              transfer=pb.TRANSFER_STREAM)
    for i in range(60):
        channel, raw = stub(tcp)
        it = raw.Fetch(request, timeout=30, metadata=_md(ADMIN))
        for _ in range(1 + i % 5):
            next(it)
        if i % 2:
            it.cancel()
        channel.close()  # (the even ones: dropped without a cancel)
    wait_quiescent(d.target, 15)
    with KVClient(tcp, BIG, deadline_s=10, token=ADMIN) as c:  # still serving, byte-exact
        n, got = c.fetch(tokens)
        assert n == len(tokens) and same_bytes(got, kv)
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10
                                  ).read().decode()
    assert 'code="INTERNAL"' not in text
    assert 'kvstore_rpc_seconds_count{code="CANCELLED",method="Fetch"}' in text
    logged = d.log.read_text()
    assert "ERROR" not in logged and "Traceback" not in logged, logged[-3000:]
