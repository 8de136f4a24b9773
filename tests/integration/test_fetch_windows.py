"""Same-node fetches in windows: the next window is asked for before the current one is
copied (the daemon's disk reads overlap the client's copy). Windows are shrunk here so that a
small prompt spans several; the bytes, the prefix and the leases must be as with one window."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import client.aio
from client import KVClient
from tests.conftest import random_kv, same_bytes, small_layout
from tests.reliability import stats, wait_quiescent

pytestmark = pytest.mark.integration
LAYOUT = small_layout()  # 16-token blocks of 8 KiB
BT = LAYOUT.block_tokens


def host_of(blocks: int) -> str:
    return str(blocks * LAYOUT.block_bytes)


@pytest.fixture
def windows_of_3(monkeypatch):
    monkeypatch.setattr(client.aio, "FETCH_WINDOW_BYTES", 3 * LAYOUT.block_bytes)
    heads: list[tuple[int, int]] = []
    real = client.aio.AsyncKVClient._fetch_head

    async def counted(self, keys, start, window):  # instrumentation: the real call runs
        heads.append((start, window))
        return await real(self, keys, start, window)

    monkeypatch.setattr(client.aio.AsyncKVClient, "_fetch_head", counted)
    return heads


def test_fetch_spans_windows_byte_identically(daemon_factory, windows_of_3):
    # Host holds 6 blocks (two windows): a 10-block prompt comes back partly from disk.
    d = daemon_factory("--host-bytes", host_of(6), "--disk-bytes", "8MiB").start()
    tokens = list(range(10 * BT))
    kv = random_kv(LAYOUT, len(tokens))
    with KVClient(d.target, LAYOUT) as c:
        assert c.publish(tokens, kv) == len(tokens)
        windows_of_3.clear()
        n, got = c.fetch(tokens)
        assert n == len(tokens) and same_bytes(got, kv)
        assert windows_of_3 == [(0, 3), (3, 3), (6, 3), (9, 3)]
        into = torch.zeros_like(kv)
        n, got = c.fetch(tokens, into=into)
        assert n == len(tokens) and same_bytes(into, kv)
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


def test_prefix_ends_inside_a_window(daemon, windows_of_3):
    tokens = list(range(10 * BT))
    kv = random_kv(LAYOUT, len(tokens))
    with KVClient(daemon.target, LAYOUT) as c:
        assert c.publish(tokens[: 5 * BT], kv[:, :, : 5 * BT]) == 5 * BT
        windows_of_3.clear()
        n, got = c.fetch(tokens)
        assert n == 5 * BT and same_bytes(got, kv[:, :, : 5 * BT])
        # Window 2 was asked for ahead (window 1 was full); it served 2 of 3: the end.
        assert windows_of_3 == [(0, 3), (3, 3)]
        assert c.fetch(tokens, max_blocks=4)[0] == 4 * BT
        assert c.fetch(tokens[5 * BT :])[0] == 0  # a miss from the first window
    wait_quiescent(daemon.target, 2.0)


def test_window_asked_ahead_without_staging_space_is_asked_again(daemon_factory,
                                                                windows_of_3, monkeypatch):
    # Host holds exactly one window: while window 1 is pinned for the copy, window 2 (asked
    # for ahead) finds no staging space. It must be asked for again, not taken as the end.
    d = daemon_factory("--host-bytes", host_of(3), "--disk-bytes", "8MiB").start()
    tokens = list(range(9 * BT))
    kv = random_kv(LAYOUT, len(tokens))
    real_copy = client.aio.AsyncKVClient._copy_out

    def slow_copy(self, *args):  # a slow copy: the window asked ahead lands while it runs
        time.sleep(0.2)
        return real_copy(self, *args)

    monkeypatch.setattr(client.aio.AsyncKVClient, "_copy_out", slow_copy)
    with KVClient(d.target, LAYOUT, deadline_s=5) as c:
        assert c.publish(tokens, kv) == len(tokens)
        windows_of_3.clear()
        n, got = c.fetch(tokens)
        assert n == len(tokens) and same_bytes(got, kv)
        assert len(windows_of_3) > 3, windows_of_3  # some window was asked for twice
    wait_quiescent(d.target, 2.0)


def test_window_asked_ahead_is_released_when_the_fetch_fails(daemon_factory, windows_of_3):
    # Host holds 3 blocks; every disk read stalls 0.4 s. The first window is in host; the
    # second, asked for ahead, is still being read from disk when the client's deadline ends
    # the call: its lease, granted after the client gave up, must still be released.
    d = daemon_factory("--host-bytes", host_of(3), "--disk-bytes", "8MiB").start()
    tokens = list(range(9 * BT))
    kv = random_kv(LAYOUT, len(tokens))
    with KVClient(d.target, LAYOUT) as c:
        assert c.publish(tokens, kv) == len(tokens)
    assert d.stop() == 0
    d = daemon_factory("--host-bytes", host_of(3), "--disk-bytes", "8MiB",
                       "--fault-disk-read-delay-s", "0.4", "--lease-timeout-s", "30").start()
    with KVClient(d.target, LAYOUT, deadline_s=2) as c:  # bring the first 3 blocks to host
        assert c.fetch(tokens[: 3 * BT])[0] == 3 * BT
    with KVClient(d.target, LAYOUT, deadline_s=0.2) as c:
        t = time.monotonic()
        assert c.fetch(tokens) == (0, None)  # the deadline ends it: a miss, never a part
        assert time.monotonic() - t < 0.2 + 0.3
        time.sleep(1.5)  # the stalled reads finish; their lease reaches the abandoned call
    wait_quiescent(d.target, 3.0)
    assert stats(d.target).expired_leases == 0  # released, not left to lease_timeout_s
