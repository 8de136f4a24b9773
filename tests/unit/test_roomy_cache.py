"""`roomy_cache` (kvstore.client.integrations.hf): a `DynamicCache` over buffers with room, so a
warm prefill's forward appends its tokens in place instead of copying the fetched prefix."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is the integration under test")

from kvstore.client.integrations.hf import roomy_cache

HEADS, DIM = 2, 4


def buffers(capacity: int, length: int, layers: int = 2) -> tuple[list[torch.Tensor],
                                                                    list[torch.Tensor]]:
    keys = [torch.randn(1, HEADS, capacity, DIM) for _ in range(layers)]
    values = [torch.randn(1, HEADS, capacity, DIM) for _ in range(layers)]
    return keys, values


def test_appends_in_place_and_reads_like_a_dynamic_cache() -> None:
    """The cache holds the buffers' first `length` tokens without a copy; an update writes the
    new tokens into the room after them (the buffer is the same memory) and returns exactly
    what a plain DynamicCache returns: the old tokens, then the new."""
    from transformers import DynamicCache

    keys, values = buffers(capacity=10, length=6)
    cache = roomy_cache(keys, values, 6)
    assert cache.get_seq_length() == 6
    assert cache.layers[0].keys.data_ptr() == keys[0].data_ptr()
    plain = DynamicCache(ddp_cache_data=[(k[:, :, :6].clone(), v[:, :, :6].clone())
                                         for k, v in zip(keys, values, strict=True)])
    new_k, new_v = torch.randn(1, HEADS, 3, DIM), torch.randn(1, HEADS, 3, DIM)
    got = cache.update(new_k, new_v, 1)
    want = plain.update(new_k, new_v, 1)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert got[0].data_ptr() == keys[1].data_ptr()  # in place: no copy of the prefix
    assert torch.equal(keys[1][:, :, 6:9], new_k)
    assert cache.layers[1].get_seq_length() == 9


def test_full_buffer_doubles_keeping_its_tokens() -> None:
    keys, values = buffers(capacity=4, length=4)
    cache = roomy_cache(keys, values, 4)
    before = keys[0].clone()
    new_k, new_v = torch.randn(1, HEADS, 2, DIM), torch.randn(1, HEADS, 2, DIM)
    k, _ = cache.update(new_k, new_v, 0)
    assert k.shape[-2] == 6 and torch.equal(k[:, :, :4], before) and torch.equal(k[:, :, 4:],
                                                                                   new_k)
    assert k.data_ptr() != keys[0].data_ptr()  # a new buffer of twice the room
    k2, _ = cache.update(new_k, new_v, 0)  # room left: in place in the new buffer
    assert k2.data_ptr() == k.data_ptr() and k2.shape[-2] == 8


def test_crop_keeps_the_buffer_and_a_replaced_tensor_falls_back() -> None:
    """A crop is a shorter view: later tokens overwrite the cropped ones in place. A layer
    whose tensors were replaced (as beam search's reorder does) concatenates like a plain
    DynamicLayer from then on, never writing into the old buffer."""
    keys, values = buffers(capacity=12, length=8)
    cache = roomy_cache(keys, values, 8)
    cache.crop(-3)
    new_k, new_v = torch.randn(1, HEADS, 1, DIM), torch.randn(1, HEADS, 1, DIM)
    k, _ = cache.update(new_k, new_v, 0)
    assert k.shape[-2] == 6 and k.data_ptr() == keys[0].data_ptr()
    assert torch.equal(keys[0][:, :, 5:6], new_k)
    layer = cache.layers[1]
    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()  # replaced
    old = keys[1].clone()
    k, _ = cache.update(new_k, new_v, 1)
    assert k.shape[-2] == 6 and torch.equal(k[:, :, 5:], new_k)
    assert torch.equal(keys[1], old)  # the old buffer untouched
