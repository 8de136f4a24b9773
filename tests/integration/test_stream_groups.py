"""`fetch_with` over TCP (a disaggregated consumer loading from its producer's daemon): blocks
reach `consume` in groups as they arrive, through two reused buffers, and a fetch cut short
(a copy stopped, its deadline, the daemon killed) keeps exactly the groups copied intact."""

from __future__ import annotations

import secrets
import threading
import time

import pytest
import torch

import kvstore.client.aio as aio
from kvstore.client import KVClient
from tests.conftest import random_kv, same_bytes, small_layout
from tests.redis_servers import free_port

BT = 16  # small_layout's block tokens
BLOCKS = 10
GROUP = 3  # blocks per group in these tests (`STREAM_GROUP_BYTES` patched)


@pytest.fixture
def tcp(daemon_factory, monkeypatch):
    """A daemon listening on loopback TCP, its address and token, and a prompt stored there."""
    layout = small_layout()
    monkeypatch.setattr(aio, "STREAM_GROUP_BYTES", GROUP * layout.block_bytes)
    address, token = f"127.0.0.1:{free_port()}", secrets.token_hex(16)
    daemon = daemon_factory("--host-bytes", "8MiB", "--listen", address, "--token",
                            token).start()
    tokens = list(range(BLOCKS * BT))
    kv = random_kv(layout, len(tokens))
    with KVClient(daemon.target, layout) as own:
        assert own.publish(tokens, kv) == len(tokens)
    return daemon, address, token, layout, tokens, kv


class Recorder:
    """A `consume` that keeps a copy of each block it is given, and the calls' block lists."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.blocks: dict[int, torch.Tensor] = {}
        self.storages: set[int] = set()

    def __call__(self, blocks: list[int], views: list[torch.Tensor],
                 stop: threading.Event) -> int | None:
        self.calls.append(list(blocks))
        for b, v in zip(blocks, views, strict=True):
            self.blocks[b] = v.clone()
            self.storages.add(v.untyped_storage().data_ptr())
        return None

    def intact(self, kv: torch.Tensor, upto: int) -> bool:
        """Blocks `[0, upto)` as stored (block b: tokens [b*BT, (b+1)*BT) of `kv`)."""
        return all(same_bytes(self.blocks[b], kv[:, :, b * BT : (b + 1) * BT])
                   for b in range(upto))


def test_blocks_reach_consume_in_groups_through_two_reused_buffers(tcp):
    _, address, token, layout, tokens, kv = tcp
    with KVClient(address, layout, token=token) as c:
        assert c.streams
        first = Recorder()
        assert c.fetch_with(tokens, first) == len(tokens)
        assert first.calls == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
        assert first.intact(kv, BLOCKS)
        assert len(first.storages) == 2  # two group buffers, whatever the prompt's length
        again = Recorder()
        assert c.fetch_with(tokens, again, skip_blocks=4) == len(tokens)
        assert again.calls == [[4, 5, 6], [7, 8, 9]]
        assert again.storages <= first.storages  # the same pages, not new ones per fetch
        whole = Recorder()
        assert c.fetch_with(tokens, whole, whole=True) == len(tokens)
        assert whole.calls == [list(range(BLOCKS))]  # `whole`: one call, once all are here
        assert whole.intact(kv, BLOCKS)


def test_a_copy_stopped_part_way_keeps_the_blocks_before_it(tcp):
    _, address, token, layout, tokens, kv = tcp
    rec = Recorder()

    def short(blocks: list[int], views: list[torch.Tensor], stop: threading.Event) -> int:
        rec(blocks, views, stop)
        return 1 if blocks[0] == GROUP else len(blocks)  # the second group: its first only

    with KVClient(address, layout, token=token) as c:
        assert c.fetch_with(tokens, short) == (GROUP + 1) * BT
        assert rec.calls == [[0, 1, 2], [3, 4, 5]]  # nothing handed over after the short one
        assert rec.intact(kv, GROUP + 1)
        assert c.fetch_with(tokens, Recorder()) == len(tokens)  # the lease was let go


def test_a_copy_past_its_deadline_stops_and_keeps_the_groups_before_it(tcp):
    _, address, token, layout, tokens, kv = tcp
    rec = Recorder()

    def stalls(blocks: list[int], views: list[torch.Tensor], stop: threading.Event) -> int:
        if blocks[0] == 0:
            rec(blocks, views, stop)
            return len(blocks)
        stop.wait(30)  # a stuck copy: only the deadline's `stop` ends it
        return 0

    with KVClient(address, layout, token=token, deadline_s=0.5) as c:
        began = time.monotonic()
        assert c.fetch_with(tokens, stalls) == GROUP * BT
        assert time.monotonic() - began < 10  # the stop reached it, not the 30 s wait
    assert rec.intact(kv, GROUP)


def test_the_daemon_killed_mid_fetch_keeps_what_was_copied_whole(tcp):
    daemon, address, token, layout, tokens, kv = tcp
    rec = Recorder()

    def kills(blocks: list[int], views: list[torch.Tensor], stop: threading.Event) -> None:
        if blocks[0] == 0:
            daemon.kill()
        rec(blocks, views, stop)

    with KVClient(address, layout, token=token, deadline_s=2) as c:
        got = c.fetch_with(tokens, kills)
        # What had arrived before the kill (socket buffers may hold the whole prompt) is
        # kept, in whole groups, intact; the group copied during the kill among them.
        assert got % BT == 0 and got >= GROUP * BT
        assert rec.intact(kv, got // BT)
        assert c.fetch_with(tokens, Recorder()) == 0  # gone: a miss, not an error
