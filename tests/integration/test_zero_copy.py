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


def _nice() -> int:
    import os

    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.parametrize("transfer", ["shm", "stream"])
def test_saves_copy_at_a_lower_cpu_priority_than_loads(daemon, transfer):
    """A publish's copies run on threads `KVSTORE_SAVE_NICE` (10) below the process, so
    background saves take only CPU the engine leaves; a fetch's copies run at the process's
    own priority, never on a thread a save lowered (nice cannot be raised back)."""
    from kvstore.client import aio

    layout = small_layout(torch.float32)
    tokens = list(range(900, 900 + 2 * BT))
    kv = random_kv(layout, len(tokens))
    seen: dict[str, set[tuple[str, int]]] = {"save": set(), "load": set()}

    def produce(blocks: list[int], views: list[torch.Tensor], stop: threading.Event) -> None:
        seen["save"].add((threading.current_thread().name, _nice()))
        for b, view in zip(blocks, views, strict=True):
            view.copy_(block(kv, b))

    def consume(blocks: list[int], views: list[torch.Tensor], stop: threading.Event) -> None:
        seen["load"].add((threading.current_thread().name, _nice()))

    base = _nice()
    with KVClient(daemon.target, layout, transfer=transfer) as c:
        for _ in range(3):  # loads after saves: still at the base priority
            assert c.publish_with(tokens, produce) in (0, 2 * BT)
            assert c.fetch_with(tokens, consume) == 2 * BT
    assert {nice for _, nice in seen["save"]} == {min(19, base + aio.save_nice())}
    assert all(name.startswith("kvstore-save") for name, _ in seen["save"])
    assert {nice for _, nice in seen["load"]} == {base}
    assert not {name for name, _ in seen["load"]} & {name for name, _ in seen["save"]}


def test_save_nice_setting_is_checked(monkeypatch):
    from kvstore.client import aio

    monkeypatch.setenv(aio.SAVE_NICE_ENV, "3")
    assert aio.save_nice() == 3
    monkeypatch.setenv(aio.SAVE_NICE_ENV, "40")
    assert aio.save_nice() == 19
    monkeypatch.setenv(aio.SAVE_NICE_ENV, "0")
    assert aio.save_nice() == 0 and aio._save_executor() is None
    monkeypatch.setenv(aio.SAVE_NICE_ENV, "low")
    with pytest.raises(ValueError, match="KVSTORE_SAVE_NICE='low'"):
        aio.save_nice()
    with pytest.raises(ValueError, match="KVSTORE_SAVE_NICE='low'"):  # at the start
        KVClient("unix:///nonexistent.sock", small_layout(torch.float32))
