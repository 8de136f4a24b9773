"""Load or recompute against a real daemon: measured bandwidth in Lookup and Stats, `plan`,
`fetch(max_blocks=)`."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from kvstore import InvalidArgumentError
from kvstore.client import AsyncKVClient, KVClient
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from tests.conftest import random_kv, same_bytes, small_layout

pytestmark = pytest.mark.integration

DELAY = 0.05  # --fault-disk-read-delay-s: every disk read stalls this long (a slow disk)
BLOCKS = 4  # blocks per prompt: one round of reads on the daemon's 4 I/O threads


def prompt(i: int) -> list[int]:
    return [i * 1000 + t for t in range(BLOCKS * 16 + 5)]  # BLOCKS full blocks and a tail


def on_disk(daemon_factory, *args: str):
    """A daemon whose prompts 0 and 1 are on disk only (published, then a restart)."""
    d = daemon_factory("--host-bytes", "8MiB", "--disk-bytes", "32MiB", *args).start()
    layout = small_layout()
    with KVClient(d.target, layout) as c:
        for i in (0, 1):
            assert c.publish(prompt(i), random_kv(layout, len(prompt(i)), seed=i)) == BLOCKS * 16
    d.stop()  # SIGTERM flushes host blocks to disk
    d.start()
    return d, layout


def lookup(target: str, keys: list[bytes], namespace: bytes) -> pb.LookupReply:
    with grpc.insecure_channel(target) as ch:
        return pb_grpc.KVStoreStub(ch).Lookup(pb.LookupRequest(namespace=namespace, keys=keys))


def tier(stats: pb.StatsReply, name: str) -> pb.TierStats:
    return next(t for t in stats.tiers if t.name == name)


def test_lookup_and_stats_report_bandwidth_measured_by_a_disk_fetch(daemon_factory):
    d, layout = on_disk(daemon_factory, "--fault-disk-read-delay-s", str(DELAY))
    with KVClient(d.target, layout) as c:
        ns = c.namespace.digest()
        before = lookup(d.target, c.keys(prompt(1)), ns)
        assert list(before.tiers) == ["disk"] * BLOCKS
        assert dict(before.read_bandwidth) == {}  # not measured yet: absent
        assert tier(c.stats(), "disk").read_bandwidth == 0
        assert c.copy_bandwidth is None

        n, kv = c.fetch(prompt(0))  # BLOCKS reads from disk, promoted to host
        assert n == BLOCKS * 16
        assert same_bytes(kv, random_kv(layout, len(prompt(0)), seed=0)[:, :, :n])
        assert c.copy_bandwidth is not None and c.copy_bandwidth > 0

        stats = c.stats()
        measured = tier(stats, "disk").read_bandwidth
        # Each read stalled DELAY, so the fetch cannot have read faster than this: the value
        # is a measurement, not the planner's 1 GB/s prior.
        assert 0 < measured <= BLOCKS * layout.block_bytes / DELAY
        assert tier(stats, "host").read_bandwidth == 0  # a host hit is a pin: never measured

        after = lookup(d.target, c.keys(prompt(1)), ns)
        assert dict(after.read_bandwidth) == {"disk": pytest.approx(measured)}
        host = lookup(d.target, c.keys(prompt(0)), ns)  # promoted: in host now
        assert list(host.tiers) == ["host"] * BLOCKS
        assert dict(host.read_bandwidth) == {}  # only the tiers of the reply, and host never


def test_measured_bandwidth_survives_a_clean_restart(daemon_factory):
    d, layout = on_disk(daemon_factory, "--fault-disk-read-delay-s", str(DELAY))
    with KVClient(d.target, layout) as c:
        c.fetch(prompt(0))  # measured: a stalled disk
        measured = tier(c.stats(), "disk").read_bandwidth
    assert measured > 0
    assert d.stop() == 0  # SIGTERM: saved with the rest of the daemon's state
    d.start()
    with KVClient(d.target, layout) as c:
        assert tier(c.stats(), "disk").read_bandwidth == pytest.approx(measured)
    d.stop()
    # A disk 8x slower after the restart: its first fetch replaces the saved figure outright
    # (an average with it would stay above 0.7x the old, fast one).
    d = daemon_factory("--host-bytes", "8MiB", "--disk-bytes", "32MiB",
                       "--fault-disk-read-delay-s", str(8 * DELAY)).start()
    with KVClient(d.target, layout) as c:
        assert tier(c.stats(), "disk").read_bandwidth == pytest.approx(measured)
        c.fetch(prompt(1))
        assert 0 < tier(c.stats(), "disk").read_bandwidth < 0.5 * measured
    (d.data_dir / "read_bandwidth.json").write_text('{"disk": "fast", "remote": -1}')
    d.kill()  # a file it cannot trust (and a crash, which saves nothing): priors again
    d.start()
    with KVClient(d.target, layout) as c:
        assert tier(c.stats(), "disk").read_bandwidth == 0


def test_plan_recomputes_from_a_slow_tier_and_loads_from_a_fast_one(daemon_factory):
    d, layout = on_disk(daemon_factory, "--fault-disk-read-delay-s", str(DELAY))
    bpt = layout.bytes_per_token
    with KVClient(d.target, layout) as c:
        # Recompute makes KV at 5000 x 512 B = 2.6 MB/s: slower than the disk tier's prior
        # (1 GB/s, 2 ms per call), faster than the stalled disk (<= 0.66 MB/s, see above).
        fast_prefill = 5000.0
        # Before any disk read the planner has only the prior: it loads.
        assert c.plan(prompt(1), fast_prefill).load_blocks == BLOCKS
        c.fetch(prompt(0))  # the daemon measures its (stalled) disk
        slow = c.plan(prompt(1), fast_prefill)
        assert slow.load_blocks == 0 and slow.tiers == ()
        assert slow.ttft_s == pytest.approx(slow.recompute_s)
        # The same tier is worth it for an engine that prefills slowly...
        patient = c.plan(prompt(1), 10.0)
        assert patient.load_blocks == BLOCKS and patient.tiers == ("disk",) * BLOCKS
        assert patient.load_tokens == BLOCKS * 16
        # ...and bytes_per_token scales the comparison: tiny blocks load at any speed.
        assert c.plan(prompt(1), fast_prefill, bytes_per_token=1).load_blocks == BLOCKS
        assert bpt > 1
        # The host tier (prompt 0, promoted) is only the client's copy away: loaded.
        assert c.plan(prompt(0), 1000.0).load_blocks == BLOCKS
        # The last token is always computed: a prompt of exactly BLOCKS blocks plans BLOCKS-1.
        assert c.plan(prompt(0)[: BLOCKS * 16], 10.0).load_blocks == BLOCKS - 1
        # Load exactly the planned prefix.
        n, kv = c.fetch(prompt(1), max_blocks=2)
        assert n == 32
        assert same_bytes(kv, random_kv(layout, len(prompt(1)), seed=1)[:, :, :32])


def test_plan_is_recompute_when_the_daemon_is_down_or_stalled(daemon_factory, tmp_path):
    layout = small_layout()
    with KVClient(f"unix://{tmp_path}/nobody.sock", layout, deadline_s=0.3) as c:
        p = c.plan(prompt(0), 1000.0)
        assert (p.load_blocks, p.tiers) == (0, ())
        with pytest.raises(InvalidArgumentError, match="prefill_tokens_per_s"):
            c.plan(prompt(0), 0.0)  # the caller's mistake still raises, daemon or not
    d = daemon_factory("--host-bytes", "8MiB", "--disk-bytes", "0").start()
    with KVClient(d.target, layout, deadline_s=0.3) as c:
        c.publish(prompt(0), random_kv(layout, len(prompt(0))))
        assert c.plan(prompt(0), 10.0).load_blocks == BLOCKS
        assert d.proc is not None
        os.kill(d.proc.pid, signal.SIGSTOP)  # a daemon that hangs: no answer at all
        try:
            t0 = time.monotonic()
            p = c.plan(prompt(0), 10.0)
            elapsed = time.monotonic() - t0
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        assert (p.load_blocks, p.tiers) == (0, ())
        assert elapsed < 2.0  # the 0.3 s deadline, with a wide margin for a loaded machine


def test_fetch_max_blocks(daemon):
    layout = small_layout()
    tokens = prompt(0)
    kv = random_kv(layout, len(tokens))
    with KVClient(daemon.target, layout) as c:
        c.publish(tokens, kv)
        assert c.fetch(tokens, max_blocks=0) == (0, None)
        n, got = c.fetch(tokens, max_blocks=3)
        assert n == 48 and same_bytes(got, kv[:, :, :48])
        assert c.fetch(tokens, max_blocks=99)[0] == BLOCKS * 16
        assert c.fetch(tokens)[0] == BLOCKS * 16  # unchanged without it
        with pytest.raises(InvalidArgumentError, match="max_blocks"):
            c.fetch(tokens, max_blocks=-1)

        seen: list[int] = []
        end = c.fetch_with(tokens, lambda blocks, views, stop: seen.extend(blocks),
                           skip_blocks=1, max_blocks=3)
        assert end == 48 and seen == [1, 2]


def test_async_plan(daemon):
    import asyncio

    layout = small_layout()

    async def main() -> None:
        async with AsyncKVClient(daemon.target, layout) as c:
            await c.publish(prompt(0), random_kv(layout, len(prompt(0))))
            p = await c.plan(prompt(0), 10.0)
            assert p.load_blocks == BLOCKS and p.tiers == ("host",) * BLOCKS
            n, _ = await c.fetch(prompt(0), max_blocks=p.load_blocks)
            assert n == p.load_tokens
            assert (await c.plan(prompt(5), 10.0)).load_blocks == 0  # nothing cached

    asyncio.run(main())


def test_remote_tier_bandwidth_is_measured_through_real_redis(daemon_factory, redis_server):
    """Two daemons sharing one Redis: the second reads a prompt through and then reports the
    remote tier's measured bandwidth in Stats and in Lookup."""
    args = ("--host-bytes", "8MiB", "--disk-bytes", "32MiB", "--remote", redis_server.url)
    a = daemon_factory(*args, name="a").start()
    b = daemon_factory(*args, name="b").start()
    layout = small_layout()
    with KVClient(a.target, layout) as c:
        c.publish(prompt(0), random_kv(layout, len(prompt(0))))
        c.publish(prompt(1), random_kv(layout, len(prompt(1)), seed=1))
        deadline = time.monotonic() + 10
        while c.stats().remote.written_blocks < 2 * BLOCKS:
            assert time.monotonic() < deadline, "write-through did not finish"
            time.sleep(0.05)
    with KVClient(b.target, layout) as c:
        ns = c.namespace.digest()
        before = lookup(b.target, c.keys(prompt(1)), ns)
        assert list(before.tiers) == ["remote"] * BLOCKS
        assert dict(before.read_bandwidth) == {}
        assert c.fetch(prompt(0))[0] == BLOCKS * 16  # read through from Redis
        measured = tier(c.stats(), "remote").read_bandwidth
        assert measured > 0
        after = lookup(b.target, c.keys(prompt(1)), ns)
        assert dict(after.read_bandwidth) == {"remote": pytest.approx(measured)}
        assert tier(c.stats(), "disk").read_bandwidth == 0  # no disk read happened here
