"""Same-node fetches in windows: the daemon answers after `fetch_window_bytes` of disk reads
with `more`, and the client asks for the rest before copying what it got, so the daemon's
reads overlap the client's copy. The window is shrunk to 3 blocks here; the bytes, the prefix
and the leases must be as with one call."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import kvstore.client.aio
from kvstore.client import KVClient
from tests.conftest import random_kv, same_bytes, small_layout
from tests.reliability import stats, tier, wait_quiescent

pytestmark = pytest.mark.integration
LAYOUT = small_layout()  # 16-token blocks of 8 KiB
BT = LAYOUT.block_tokens
WINDOW = ("--fetch-window-bytes", str(3 * LAYOUT.block_bytes))


def host_of(blocks: int) -> str:
    return str(blocks * LAYOUT.block_bytes)


@pytest.fixture
def heads(monkeypatch) -> list[int]:
    """The first block of every Fetch the client sends (instrumentation: the calls run)."""
    starts: list[int] = []
    real = kvstore.client.aio.AsyncKVClient._fetch_head

    async def counted(self, keys, start, **kw):
        starts.append(start)
        return await real(self, keys, start, **kw)

    monkeypatch.setattr(kvstore.client.aio.AsyncKVClient, "_fetch_head", counted)
    return starts


def on_disk_only(daemon_factory, blocks: int, *args: str):
    """A daemon whose `blocks`-block prompt is on disk only (published, then restarted)."""
    d = daemon_factory("--host-bytes", host_of(blocks), "--disk-bytes", "8MiB").start()
    tokens = list(range(blocks * BT))
    kv = random_kv(LAYOUT, len(tokens))
    with KVClient(d.target, LAYOUT) as c:
        assert c.publish(tokens, kv) == len(tokens)
    assert d.stop() == 0  # flushed to disk; the restarted daemon's host tier is empty
    return daemon_factory("--disk-bytes", "8MiB", *WINDOW, *args), tokens, kv


def test_fetch_spans_windows_byte_identically(daemon_factory, heads):
    d, tokens, kv = on_disk_only(daemon_factory, 10, "--host-bytes", host_of(10))
    d.start()
    with KVClient(d.target, LAYOUT) as c:
        heads.clear()
        n, got = c.fetch(tokens)
        assert n == len(tokens) and same_bytes(got, kv)
        assert heads == [0, 3, 6, 9]  # windows of 3 promoted blocks
        heads.clear()
        into = torch.zeros_like(kv)
        n, _ = c.fetch(tokens, into=into)  # now all in host: one call
        assert n == len(tokens) and same_bytes(into, kv) and heads == [0]
    d.stop()
    d.start()  # on disk only again
    with KVClient(d.target, LAYOUT) as c:
        seen: list[int] = []
        out = torch.zeros_like(kv)

        def consume(blocks, views, stop: threading.Event) -> None:
            for b, view in zip(blocks, views, strict=True):
                out[:, :, b * BT : (b + 1) * BT].copy_(view)
                seen.append(b)

        assert c.fetch_with(tokens, consume, skip_blocks=2) == len(tokens)
        assert seen == list(range(2, 10))
        assert same_bytes(out[:, :, 2 * BT :], kv[:, :, 2 * BT :])
    wait_quiescent(d.target, 2.0)  # every window's lease was released


def test_a_whole_fetch_comes_in_one_round_unless_host_lacks_room(daemon_factory, heads):
    """`fetch_with(..., whole=True)` (the vLLM connector's layer-by-layer loads): the daemon
    stages the whole prefix before answering, so `consume` gets every block in one call, byte-
    identical; where host cannot hold it all, the rest still comes in further rounds."""
    d, tokens, kv = on_disk_only(daemon_factory, 10, "--host-bytes", host_of(10))
    d.start()

    def fetch_whole(c: KVClient, kv: torch.Tensor) -> list[list[int]]:
        n, calls, out = whole_into(c, tokens, kv)
        assert n == len(tokens) and same_bytes(out, kv)
        return calls

    with KVClient(d.target, LAYOUT) as c:
        heads.clear()
        assert fetch_whole(c, kv) == [list(range(10))]
        assert heads == [0]  # 10 disk reads, past the 3-block window, in one call
    wait_quiescent(d.target, 2.0)
    d.stop()
    # A host tier of 6 blocks: the whole prefix cannot be staged at once.
    small, tokens, kv = on_disk_only(daemon_factory, 10, "--host-bytes", host_of(6))
    small.start()
    with KVClient(small.target, LAYOUT) as c:
        calls = fetch_whole(c, kv)
        assert len(calls) > 1 and [b for call in calls for b in call] == list(range(10))
    wait_quiescent(small.target, 2.0)


def whole_into(c: KVClient, tokens: list[int], kv: torch.Tensor,
               ) -> tuple[int, list[list[int]], torch.Tensor]:
    """`fetch_with(..., whole=True)` into a zeroed copy of `kv`: (tokens, consume's calls, out)."""
    calls: list[list[int]] = []
    out = torch.zeros_like(kv)

    def consume(blocks, views, stop: threading.Event) -> None:
        calls.append(list(blocks))
        for b, view in zip(blocks, views, strict=True):
            out[:, :, b * BT : (b + 1) * BT].copy_(view)

    return c.fetch_with(tokens, consume, whole=True), calls, out


@pytest.mark.flaky(reruns=2, reruns_delay=1)  # wall-clock margins of 0.1-0.3 s on 2 cores
def test_a_slow_disk_answers_a_whole_fetch_by_half_its_deadline(daemon_factory, heads):
    """No disk read starts that would end after half the client's time (at the pace of the
    call's slowest read so far): the daemon answers with the prefix it read, `more` set, and
    the client asks for the rest. Each read stalls 0.4 s, four at a time (the daemon's I/O
    threads); 12 blocks, a 1.5 s deadline. Round 1 (due at 0.75 s) reads 4 blocks by 0.4 s,
    and the next 4 would end at 0.8 s; round 2 (due at 0.4 + 1.1 / 2 s) and round 3 read 4
    each: all 12 by 1.2 s. With 0.5 s stalls rounds end at 0.5 and 1.0 s and the third at
    the deadline: 8 blocks are kept. In one round, waiting for every read, 12 blocks would come
    at 1.5 s, at the deadline, and nothing would be kept."""
    d, tokens, kv = on_disk_only(daemon_factory, 12, "--host-bytes", host_of(12),
                                 "--fault-disk-read-delay-s", "0.4")
    d.start()
    with KVClient(d.target, LAYOUT, deadline_s=1.5) as c:
        heads.clear()
        n, calls, out = whole_into(c, tokens, kv)
        assert n == len(tokens) and same_bytes(out, kv)
        assert calls == [list(range(4)), list(range(4, 8)), list(range(8, 12))], calls
        assert heads == [0, 4, 8]
    assert stats(d.target).late_fetches == 2
    wait_quiescent(d.target, 2.0)
    d.stop()
    stalled, tokens, kv = on_disk_only(daemon_factory, 12, "--host-bytes", host_of(12),
                                       "--fault-disk-read-delay-s", "0.5")
    stalled.start()
    with KVClient(stalled.target, LAYOUT, deadline_s=1.5) as c:
        t = time.monotonic()
        n, calls, out = whole_into(c, tokens, kv)
        assert time.monotonic() - t < 1.5 + 0.3
        assert n == 8 * BT and calls[:2] == [list(range(4)), list(range(4, 8))], calls
        assert same_bytes(out[:, :, :n], kv[:, :, :n])
    # The round the deadline cut short ends (its reads, its lease), long before the reaper's.
    wait_quiescent(stalled.target, 3.0)
    assert stats(stalled.target).expired_leases == 0


def test_prefix_ends_inside_a_window(daemon_factory, heads):
    d, tokens, kv = on_disk_only(daemon_factory, 5, "--host-bytes", host_of(10))
    d.start()
    longer = tokens + list(range(10_000, 10_000 + 5 * BT))
    with KVClient(d.target, LAYOUT) as c:
        heads.clear()
        n, got = c.fetch(longer)
        assert n == 5 * BT and same_bytes(got, kv)
        assert heads == [0, 3]  # the second window served 2 blocks, without `more`: the end
        assert c.fetch(longer, max_blocks=4)[0] == 4 * BT
        assert c.fetch(longer[5 * BT :])[0] == 0  # a miss from the first window
    wait_quiescent(d.target, 2.0)


@pytest.mark.flaky(reruns=2, reruns_delay=1)  # the early request must land during a 0.5 s copy
def test_window_asked_ahead_without_staging_space_is_asked_again(daemon_factory, heads,
                                                                monkeypatch):
    # Host holds exactly one window: while window 1 is pinned for the copy, window 2 (asked
    # for ahead) finds no staging space. It must be asked for again, not taken as the end.
    d, tokens, kv = on_disk_only(daemon_factory, 9, "--host-bytes", host_of(3))
    d.start()
    real_copy = kvstore.client.aio.AsyncKVClient._copy_out

    def slow_copy(self, *args):  # a slow copy: the window asked ahead lands while it runs
        time.sleep(0.5)
        return real_copy(self, *args)

    monkeypatch.setattr(kvstore.client.aio.AsyncKVClient, "_copy_out", slow_copy)
    with KVClient(d.target, LAYOUT, deadline_s=5) as c:
        heads.clear()
        n, got = c.fetch(tokens)
        assert n == len(tokens) and same_bytes(got, kv)
        assert heads == [0, 3, 3, 6, 6], heads  # windows 2 and 3 asked for twice
    wait_quiescent(d.target, 2.0)


@pytest.mark.flaky(reruns=2, reruns_delay=1)  # wall-clock margins of 0.5 s on 2 shared cores
def test_window_asked_ahead_is_released_when_the_fetch_fails(daemon_factory, heads):
    # Every disk read stalls 1 s (a window's reads run together); the client's deadline is
    # 1.5 s. Window 1 arrives at 1 s; window 2, asked for then, is still being read when the
    # deadline ends the call, which keeps window 1 (issue 12: a load cut short keeps the prefix
    # it completed). Window 2's lease, granted after the client gave up, must be released.
    d, tokens, kv = on_disk_only(daemon_factory, 9, "--host-bytes", host_of(9),
                                 "--fault-disk-read-delay-s", "1.0", "--lease-timeout-s", "30")
    d.start()
    with KVClient(d.target, LAYOUT, deadline_s=1.5) as c:
        t = time.monotonic()
        n, got = c.fetch(tokens)  # the deadline ends it: window 1 is kept, nothing after
        assert n == 3 * BT and same_bytes(got, kv[:, :, :n])
        assert time.monotonic() - t < 1.5 + 0.3
        assert heads[:2] == [0, 3]  # the second window was asked for ahead
    # The second window's call counts as in flight (its RPC, its lease) from its arrival, about
    # 1 s before the deadline: this polls until it has ended, long before lease_timeout_s.
    wait_quiescent(d.target, 3.0)
    assert stats(d.target).expired_leases == 0  # released, not left to lease_timeout_s


@pytest.mark.parametrize("transfer", ["shm", "stream"])
def test_prompt_larger_than_the_host_tier_does_not_push_itself_out(daemon_factory, transfer):
    # 14 blocks on disk, room for 10 in host, windows of 3. Promoted whole, the prompt would
    # push itself out of host: each promotion past the 10th evicting one of its own blocks,
    # which the next fetch reads back (and promotes again, evicting another). It keeps its
    # first 4 blocks (10 less two windows) instead; the rest is read into scratch space, freed
    # at release: no block of it evicted, none written, a second fetch promotes nothing.
    d, tokens, kv = on_disk_only(daemon_factory, 14, "--host-bytes", host_of(10))
    d.start()
    with KVClient(d.target, LAYOUT, transfer=transfer) as c:
        for round_ in range(3):
            before = stats(d.target)
            n, got = c.fetch(tokens)
            after = wait_quiescent(d.target, 2.0)
            assert n == len(tokens) and same_bytes(got, kv)
            host, disk = tier(after, "host"), tier(after, "disk")
            assert after.demotions == before.demotions
            assert host.evictions == tier(before, "host").evictions == 0
            assert disk.bytes_written == tier(before, "disk").bytes_written
            assert after.promotions - before.promotions == (4 if round_ == 0 else 0)
            assert host.hits - tier(before, "host").hits == (0 if round_ == 0 else 4)
            assert disk.hits - tier(before, "disk").hits == (14 if round_ == 0 else 10)
            # The host holds the prompt's first 4 blocks, and no scratch space is left behind.
            assert host.blocks == 4 and host.used_bytes == 4 * LAYOUT.block_bytes
        assert c.fetch(tokens[: 4 * BT])[0] == 4 * BT
        assert tier(stats(d.target), "disk").hits == 14 + 10 + 10  # that one from host only
