"""The pure-torch twin of kv_copy.cu: the CPU path and the tests' oracle.

It works on the same validated ``CopyRequest`` as the kernel, but moves data with
torch indexing on the layout's views instead of addresses and byte strides, so
a wrong stride, offset or index in the kernel path shows up as a mismatch.
"""

from __future__ import annotations

import torch

from kvstore.kernels.plan import CopyRequest, Direction

# Copies move bits, not numbers: an integer view of the same width keeps NaN
# payloads intact and works for dtypes (fp8) that lack CPU indexing kernels.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def run(req: CopyRequest) -> None:
    """Perform ``req`` (gather or scatter) with torch ops, in place."""
    if req.num_blocks == 0:
        return
    num_blocks, pages_per_block = req.page_ids.shape
    pages = req.page_ids.reshape(-1).to(req.staging.device)
    slots = req.slot_ids.to(req.staging.device)
    staging = _bits(req.staging)
    for index, engine_plane in enumerate(req.planes):
        plane = _bits(engine_plane)
        layer, kv = divmod(index, req.num_kv)
        heads, head_dim = plane.shape[2], plane.shape[3]
        if req.direction is Direction.GATHER:
            blocks = plane[pages].reshape(num_blocks, req.block_tokens, heads, head_dim)
            staging[slots, layer, kv] = blocks.to(staging.device)
        else:
            blocks = staging[slots, layer, kv].reshape(
                num_blocks * pages_per_block, req.page_size, heads, head_dim
            )
            plane[pages] = blocks.to(plane.device)
