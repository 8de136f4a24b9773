"""`fetch_with` / `publish_with`: the caller copies straight out of and into the daemon's
shared memory (over a Unix socket) or a local buffer (streamed), same bytes as `fetch`."""

from __future__ import annotations

import threading

import pytest
import torch

from kvstore.client import KVClient
from tests.conftest import random_kv, same_bytes, small_layout

pytestmark = pytest.mark.integration
BT = 16  # small_layout's block_tokens


def block(kv: torch.Tensor, i: int) -> torch.Tensor:
    return kv[:, :, i * BT : (i + 1) * BT]


class Recorder:
    """A `consume`: copies each block it is handed into `out`, remembers the indices."""

    def __init__(self, layout, tokens: int) -> None:
        self.out = torch.zeros(layout.kv_shape(tokens), dtype=layout.torch_dtype)
        self.blocks: list[int] = []
        self.threads: set[str] = set()

    def __call__(self, blocks: list[int], views: list[torch.Tensor],
                 stop: threading.Event) -> None:
        self.threads.add(threading.current_thread().name)
        for b, view in zip(blocks, views, strict=True):
            assert tuple(view.shape) == (2, 2, BT, 2, 16)
            block(self.out, b).copy_(view)
            self.blocks.append(b)


@pytest.mark.parametrize("transfer", ["shm", "stream"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_publish_with_then_fetch_with_round_trip(daemon, dtype, transfer):
    layout = small_layout(dtype)
    tokens = list(range(500, 500 + 4 * BT + 5))  # 4 full blocks and a partial one
    kv = random_kv(layout, len(tokens))
    asked: list[int] = []

    def produce(blocks: list[int], views: list[torch.Tensor], stop: threading.Event) -> None:
        for b, view in zip(blocks, views, strict=True):
            view.copy_(block(kv, b))
            asked.append(b)

    with KVClient(daemon.target, layout, transfer=transfer) as c:
        assert c.publish_with(tokens, produce) == 4 * BT
        assert asked == [0, 1, 2, 3]
        assert same_bytes(c.fetch(tokens)[1], kv[:, :, : 4 * BT])  # what publish would store
        rec = Recorder(layout, len(tokens))
        assert c.fetch_with(tokens, rec) == 4 * BT
        assert rec.blocks == [0, 1, 2, 3]
        assert "kvstore-client" not in rec.threads  # copies run off the client's loop thread
        assert same_bytes(rec.out[:, :, : 4 * BT], kv[:, :, : 4 * BT])
        # from the third block on: the first two are never handed over
        rec = Recorder(layout, len(tokens))
        assert c.fetch_with(tokens, rec, skip_blocks=2) == 4 * BT
        assert rec.blocks == [2, 3]
        assert same_bytes(block(rec.out, 3), block(kv, 3))
        assert c.fetch_with(tokens, rec, skip_blocks=4) == 0


def test_publish_with_asks_only_for_missing_blocks_and_fetch_with_stops_at_a_gap(daemon):
    layout = small_layout()
    tokens = list(range(3 * BT))
    kv = random_kv(layout, len(tokens))
    with KVClient(daemon.target, layout) as c:
        c.publish(tokens[: 2 * BT], kv[:, :, : 2 * BT])
        asked: list[int] = []

        def produce(blocks, views, stop):
            asked.extend(blocks)
            for b, view in zip(blocks, views, strict=True):
                view.copy_(block(kv, b))

        assert c.publish_with(tokens, produce) == 3 * BT
        assert asked == [2]
        other = tokens[:BT] + [7] * (2 * BT)  # shares block 0 only
        rec = Recorder(layout, len(other))
        assert c.fetch_with(other, rec) == BT
        assert rec.blocks == [0]
        miss = Recorder(layout, BT)
        assert c.fetch_with([1] * BT, miss) == 0
        assert miss.blocks == []


def test_a_failing_consume_raises_and_the_daemon_keeps_serving(daemon):
    layout = small_layout()
    tokens = list(range(2 * BT))
    kv = random_kv(layout, len(tokens))
    with KVClient(daemon.target, layout) as c:
        c.publish(tokens, kv)

        def broken(blocks, views, stop):
            raise RuntimeError("copy failed")

        with pytest.raises(RuntimeError, match="copy failed"):
            c.fetch_with(tokens, broken)
        rec = Recorder(layout, len(tokens))
        assert c.fetch_with(tokens, rec) == 2 * BT
        assert same_bytes(rec.out, kv)


def test_daemon_down_is_a_miss_without_a_call(tmp_path):
    layout = small_layout()
    calls: list[int] = []
    with KVClient(f"unix://{tmp_path}/none.sock", layout, deadline_s=0.3) as c:
        assert c.fetch_with(list(range(BT)), lambda b, v, s: calls.append(1)) == 0
        assert c.publish_with(list(range(BT)), lambda b, v, s: calls.append(1)) == 0
    assert calls == []
