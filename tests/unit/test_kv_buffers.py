"""`KVBuffers` (kvstore.client.integrations.hf): K/V memory touched once, up front, handed out
again only when nothing references it, so a cache the caller holds is never overwritten."""

from __future__ import annotations

import pytest
import torch

from kvstore.client.integrations.hf import KVBuffers
from kvstore.layout import KVLayout

LAYOUT = KVLayout(model="m", num_layers=3, num_kv_heads=2, head_dim=4, dtype="float32",
                  block_tokens=8)


def test_taken_buffers_are_refused_while_any_view_of_them_lives() -> None:
    buffers = KVBuffers(LAYOUT, tokens=32)
    assert buffers.nbytes == 3 * 2 * 2 * 32 * 4 * 4
    taken = buffers.take(32)
    assert taken is not None
    keys, values = taken
    assert len(keys) == len(values) == 3
    assert keys[0].shape == (1, 2, 32, 4) and keys[0].dtype == torch.float32
    assert not keys[0].any()  # zeroed: the pages were touched when it was made
    assert buffers.take(8) is None  # in use
    kept = values[2][:, :, :5]  # the caller keeps one slice of one layer
    del taken, keys, values
    assert buffers.take(8) is None  # that slice still reads this memory
    kept.fill_(7.0)
    del kept
    again = buffers.take(8)
    assert again is not None  # nothing references it any more
    assert float(again[1][2][0, 0, 0, 0]) == 7.0  # the same memory, handed out again


def test_a_larger_request_or_a_bad_size_is_refused() -> None:
    buffers = KVBuffers(LAYOUT, tokens=16)
    assert buffers.take(17) is None
    assert buffers.take(16) is not None
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="positive number of tokens"):
            KVBuffers(LAYOUT, bad)  # type: ignore[arg-type]


def test_threads_taking_at_once_never_share_the_memory(monkeypatch) -> None:
    import threading
    import time

    from kvstore.client.integrations import hf

    buffers = KVBuffers(LAYOUT, tokens=8)
    count = hf._storage_uses

    def slow_count(t: torch.Tensor) -> int | None:  # widens the check-then-take window
        n = count(t)
        time.sleep(0.05)
        return n

    monkeypatch.setattr(hf, "_storage_uses", slow_count)
    start = threading.Barrier(8)
    got: list[object] = []

    def take() -> None:
        start.wait()
        got.append(buffers.take(8))

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert sum(g is not None for g in got) == 1
