"""Each engine layout means what its engine means by it.

The kernel and the oracle share ``EngineKV.planes``; if a plane view were wrong,
they would agree and both be wrong. So these tests write a request's K/V the
way each engine writes its cache (explicit per-layout indexing, written out
here independently of kernels/layouts.py), gather through the CPU path and the
host-shim kernel, and check the canonical block token by token.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvstore import kernels
from kvstore.kernels import EngineKV, EngineLayout
from kvstore.kernels.plan import Direction, plan_launch, prepare
from tests.kernels.cases import assert_same_bytes
from tests.kernels.shim import ShimRunner, storage_bytes

L, H, D, PAGE, BLOCK, PAGES = 2, 3, 8, 4, 8, 10
N_BLOCKS = 2
SEQ = N_BLOCKS * BLOCK

# A writer stores token `tok` of layer `layer` (k, v: [H, D], or a latent [D])
# at engine page `page`, offset `off`, the way that engine's cache-write op does.
Writer = Callable[[list[torch.Tensor], int, int, int, int, torch.Tensor, torch.Tensor], None]


def write_vllm_nhd(cache, layer, tok, page, off, k, v):  # reshape_and_cache_flash
    cache[layer][0, page, off] = k
    cache[layer][1, page, off] = v


def write_vllm_hnd(cache, layer, tok, page, off, k, v):
    cache[layer][0, page, :, off] = k
    cache[layer][1, page, :, off] = v


def write_flashinfer(cache, layer, tok, page, off, k, v):
    cache[layer][page, 0, off] = k
    cache[layer][page, 1, off] = v


def write_vllm_cpu(cache, layer, tok, page, off, k, v):
    # As vLLM's CPU attention test does: view [pages, H, 2*page_size, D] and
    # split dim 2 in two halves, K first.
    packed = cache[layer].view(PAGES, H, 2 * PAGE, D)
    key_cache, value_cache = packed.chunk(2, dim=2)
    key_cache[page, :, off] = k
    value_cache[page, :, off] = v


def write_mla(cache, layer, tok, page, off, k, v):
    cache[layer][page, off] = k[0]


def new_cache(layout: EngineLayout, dtype: torch.dtype) -> list[torch.Tensor]:
    shape = {
        EngineLayout.VLLM_NHD: (2, PAGES, PAGE, H, D),
        EngineLayout.VLLM_HND: (2, PAGES, H, PAGE, D),
        EngineLayout.FLASHINFER_NHD: (PAGES, 2, PAGE, H, D),
        EngineLayout.VLLM_CPU: (PAGES, H, PAGE, 2 * D),
        EngineLayout.MLA: (PAGES, PAGE, D),
    }[layout]
    return [torch.zeros(shape, dtype=dtype) for _ in range(L)]


WRITERS: dict[EngineLayout, Writer] = {
    EngineLayout.VLLM_NHD: write_vllm_nhd,
    EngineLayout.VLLM_HND: write_vllm_hnd,
    EngineLayout.FLASHINFER_NHD: write_flashinfer,
    EngineLayout.VLLM_CPU: write_vllm_cpu,
    EngineLayout.MLA: write_mla,
}


def tokens(layout: EngineLayout, dtype: torch.dtype) -> torch.Tensor:
    """Distinct values per (layer, kv, token, head, dim): [L, kv, SEQ, heads, D]."""
    kv = layout.num_kv
    heads = 1 if layout is EngineLayout.MLA else H
    n = L * kv * SEQ * heads * D
    return (torch.arange(n, dtype=torch.float32) % 2003).to(dtype).reshape(L, kv, SEQ, heads, D)


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return request.param


@pytest.mark.parametrize("layout", list(WRITERS), ids=lambda x: x.value)
def test_paged_layout_semantics(shim: ShimRunner, layout: EngineLayout, dtype: torch.dtype) -> None:
    values = tokens(layout, dtype)
    block_table = [7, 2, 9, 0]  # SEQ / PAGE pages, deliberately out of order
    cache = new_cache(layout, dtype)
    for layer in range(L):
        for tok in range(SEQ):
            page, off = block_table[tok // PAGE], tok % PAGE
            v = values[layer, 1, tok] if layout.num_kv == 2 else None
            WRITERS[layout](cache, layer, tok, page, off, values[layer, 0, tok], v)
    engine = EngineKV.paged(layout, cache)
    expected = values.reshape(L, layout.num_kv, N_BLOCKS, BLOCK, -1, D).permute(2, 0, 1, 3, 4, 5)
    page_ids = torch.tensor(block_table).reshape(N_BLOCKS, BLOCK // PAGE)

    staging = torch.zeros(kernels.staging_shape(engine, N_BLOCKS, BLOCK), dtype=dtype)
    kernels.gather(engine, staging, page_ids)  # CPU path: the torch twin
    assert torch.equal(staging, expected)

    kernel_staging = torch.zeros_like(staging)
    req = prepare(Direction.GATHER, engine, kernel_staging, page_ids)
    plan = plan_launch(req, sm_count=132)
    result = shim.run(plan, [*cache, kernel_staging], req.page_ids, req.slot_ids)
    got = result.after[kernel_staging.untyped_storage().data_ptr()]
    assert_same_bytes(storage_bytes(staging.untyped_storage()), got, f"{layout.value} kernel")

    # Scatter into an empty cache puts every token back where the engine wrote it.
    empty = EngineKV.paged(layout, new_cache(layout, dtype))
    kernels.scatter(staging, empty, page_ids)
    for mine, theirs in zip(empty.layers, cache, strict=True):
        assert torch.equal(mine, theirs)


def test_transformers_layout_semantics(dtype: torch.dtype) -> None:
    batch, extra = 3, 5  # a partial block at the end of the sequence
    keys = [torch.randn(batch, H, SEQ + extra, D).to(dtype) for _ in range(L)]
    values = [torch.randn(batch, H, SEQ + extra, D).to(dtype) for _ in range(L)]
    engine = EngineKV.transformers(keys, values, batch_index=1)
    staging = torch.zeros(kernels.staging_shape(engine, N_BLOCKS, BLOCK), dtype=dtype)
    kernels.gather(engine, staging, [1, 0], slot_ids=[0, 1])
    for layer in range(L):
        for kv, src in enumerate((keys, values)):
            # Slot 0 holds sequence block 1, slot 1 holds block 0; [tok, head, dim].
            want0 = src[layer][1, :, BLOCK : 2 * BLOCK].transpose(0, 1)
            want1 = src[layer][1, :, :BLOCK].transpose(0, 1)
            assert torch.equal(staging[0, layer, kv], want0)
            assert torch.equal(staging[1, layer, kv], want1)
    with pytest.raises(kernels.BlockIdError, match="outside the 2 engine pages"):
        kernels.gather(engine, staging, [2])  # only the partial block is left


def test_round_trip_every_layout_cpu(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    for layout in WRITERS:
        cache = new_cache(layout, dtype)
        engine = EngineKV.paged(layout, cache)
        staging = torch.randn(kernels.staging_shape(engine, 3, BLOCK), generator=gen).to(dtype)
        page_ids = [[5, 1], [8, 3], [0, 9]]
        kernels.scatter(staging, engine, page_ids)
        back = torch.zeros_like(staging)
        kernels.gather(engine, back, page_ids, slot_ids=[0, 1, 2])
        assert torch.equal(back, staging), layout
        untouched = [2, 4, 6, 7]  # pages no block maps to stay zero
        assert all(not p[untouched].any() for p in engine.planes(BLOCK)), layout
