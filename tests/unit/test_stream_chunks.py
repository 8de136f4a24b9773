"""A STREAM fetch's data messages are encoded by hand (`service.data_chunk`, one copy of the
bytes instead of three): they must decode as the `FetchChunk` the proto defines, whatever the
index, offset and length (proto3 leaves zeros out; lengths past 127 take several varint bytes)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.service import _serializer, data_chunk


@pytest.mark.parametrize(("index", "offset", "size"), [
    (0, 0, 0), (0, 0, 1), (3, 1 << 20, 127), (7, (1 << 32) + 5, 128), (2**32 - 1, 0, 1 << 20),
])
def test_a_hand_encoded_data_chunk_decodes_as_the_proto_says(index: int, offset: int,
                                                             size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    wire = data_chunk(index, offset, data)
    got = pb.FetchChunk.FromString(wire)
    assert (got.block_index, got.chunk_offset, got.data) == (index, offset, data.tobytes())
    assert not got.hits and not got.blocks and not got.more  # a data message only
    # Through the handler's serializer: encoded bytes pass as they are, messages are encoded.
    serialize = _serializer(pb.FetchChunk)
    assert serialize(wire) is wire
    assert serialize(got) == got.SerializeToString()


def test_a_chunk_of_a_strided_view_is_refused_not_garbled() -> None:
    """`data_chunk` takes the arena's contiguous bytes; a strided buffer must fail loudly
    (bytes.join needs a contiguous buffer) rather than send other bytes."""
    with pytest.raises((TypeError, BufferError, ValueError)):
        data_chunk(0, 0, np.arange(16, dtype=np.uint8)[::2])


@pytest.mark.parametrize("chunk", [1, 7, 64, 100, 256, 1000])
def test_chunks_of_any_size_land_in_the_blocks_places(chunk: int) -> None:
    """The client copies each data message straight into the block's place in its output
    (`[L, kv, tokens, H, D]`, a block's planes strided apart): chunks that begin and end
    inside planes, span several, or are smaller than one, give the block's bytes exactly."""
    import torch

    from kvstore.client.aio import AsyncKVClient, _copy_into_planes
    from kvstore.layout import KVLayout

    layout = KVLayout(model="m", num_layers=3, num_kv_heads=2, head_dim=4,
                      dtype=torch.float32, block_tokens=4)
    client = AsyncKVClient.__new__(AsyncKVClient)  # only its layout is used here
    client.layout = layout
    blocks = torch.randn(3, *layout.block_shape)  # what the daemon holds, block-major
    out = torch.zeros(layout.kv_shape(3 * 4))
    for i in (2, 0):
        planes = client._block_planes(out, i)
        raw = blocks[i].contiguous().view(torch.uint8).reshape(-1).numpy()
        for off in range(0, raw.size, chunk):
            _copy_into_planes(planes, off, raw[off : off + chunk])
    for i in (0, 2):
        assert torch.equal(out[:, :, i * 4 : (i + 1) * 4], blocks[i])
    assert not out[:, :, 4:8].any()  # block 1 untouched
