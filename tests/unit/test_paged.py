"""Page arithmetic and paged-cache copies of the vLLM connector, without vLLM."""

from __future__ import annotations

import pytest
import torch

import kvstore.client.integrations.paged as paged_mod
import kvstore.kernels as kernels_api
from kvstore.client.integrations.paged import PagedCache, token_pages
from kvstore.kernels.layouts import EngineKV, EngineLayout

LAYERS, HEADS, DIM, PAGE, PAGES = 2, 2, 8, 4, 6


def test_token_pages_maps_blocks_to_kernel_pages() -> None:
    # Scheduler blocks of 8 tokens, each split into two cache pages of 4.
    assert token_pages([5, 2, 7], 8, 4, 0, 24) == [10, 11, 4, 5, 14, 15]
    assert token_pages([5, 2, 7], 8, 4, 8, 20) == [4, 5, 14]
    assert token_pages([5, 2, 7], 8, 8, 8, 24) == [2, 7]
    assert token_pages([5], 8, 8, 8, 8) == []


@pytest.mark.parametrize(("block", "page", "start", "end"),
                         [(8, 3, 0, 8), (8, 4, 2, 8), (8, 4, 0, 6), (8, 4, 0, 16)])
def test_token_pages_rejects_misaligned_or_out_of_range(block, page, start, end) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - the messages differ per case
        token_pages([1], block, page, start, end)


def vllm_vec_cache(kv: torch.Tensor, pages: list[int]) -> list[torch.Tensor]:
    """A vLLM CPU cache written the way vLLM's "vec" ISA writes it (`reshape_and_cache` in
    csrc/cpu/cpu_attn_vec.hpp, transcribed index for index): K column-major, V row-major."""
    layers = []
    for layer in range(kv.shape[0]):
        flat = torch.zeros(PAGES * HEADS * PAGE * 2 * DIM)
        block_stride, head_stride = HEADS * 2 * PAGE * DIM, 2 * PAGE * DIM
        value_base = PAGE * DIM  # value_cache = the second half of the (page, head) rows
        for token in range(kv.shape[2]):
            block, offset = pages[token // PAGE], token % PAGE
            for head in range(HEADS):
                base = block * block_stride + head * head_stride
                for i in range(DIM):
                    flat[base + offset + i * PAGE] = kv[layer, 0, token, head, i]
                    flat[base + value_base + offset * DIM + i] = kv[layer, 1, token, head, i]
        layers.append(flat.view(PAGES, HEADS, PAGE, 2 * DIM))
    return layers


def prompt_kv(tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((LAYERS, 2, tokens, HEADS, DIM), generator=g)


def test_vllm_cpu_gather_reads_what_vllm_wrote() -> None:
    kv = prompt_kv(3 * PAGE)
    pages = [4, 1, 3]
    cache = PagedCache.vllm_cpu(vllm_vec_cache(kv, pages), "vec")
    assert torch.equal(cache.gather(pages), kv)
    assert torch.equal(cache.gather(pages[1:]), kv[:, :, PAGE:])


def scatters_as_vllm_writes(kv: torch.Tensor, want: list[torch.Tensor], isa: str) -> None:
    """`kv` scattered into pages [1, 3] of a cache of 7s (page 4, its first, holds tokens
    computed locally): exactly `want`'s bytes there (vLLM's own writing of `kv` into pages
    [4, 1, 3]), the other pages untouched."""
    layers = [torch.full_like(t, 7.0) for t in want]
    PagedCache.vllm_cpu(layers, isa).scatter(kv, [1, 3], first_token=kv.shape[2] // 3)
    for got, ref in zip(layers, want, strict=True):
        assert torch.equal(got[[1, 3]], ref[[1, 3]])
        assert bool((got[[0, 2, 4, 5]] == 7.0).all())  # untouched, the local page included


def test_vllm_cpu_scatter_writes_what_vllm_would_and_nothing_else() -> None:
    kv = prompt_kv(3 * PAGE)
    scatters_as_vllm_writes(kv, vllm_vec_cache(kv, [4, 1, 3]), "vec")


def test_vllm_cpu_refuses_isas_it_does_not_decode() -> None:
    with pytest.raises(ValueError, match="neon"):
        PagedCache.vllm_cpu([torch.zeros(PAGES, HEADS, PAGE, 2 * DIM)], "neon")
    with pytest.raises(ValueError, match="2-byte elements"):  # AMX tiles pair bf16 values
        PagedCache.vllm_cpu([torch.zeros(PAGES, HEADS, 32, 64)], "amx")


AMX_PAGE, AMX_DIM = 32, 32  # vLLM picks "amx" for pages of a multiple of 32 tokens


def vllm_amx_cache(kv: torch.Tensor, pages: list[int]) -> list[torch.Tensor]:
    """A vLLM CPU cache written the way its "amx" ISA writes it, offset by offset as found by
    writing one element at a time through vLLM's `cpu_attn_reshape_and_cache` (bf16): K in
    tiles of 16 tokens by pairs of dims, V in tiles of 16 dims by pairs of tokens."""
    ps, dim = AMX_PAGE, AMX_DIM
    layers = []
    for layer in range(kv.shape[0]):
        flat = torch.zeros(PAGES * HEADS * ps * 2 * dim, dtype=kv.dtype)
        for token in range(kv.shape[2]):
            block, t = pages[token // ps], token % ps
            for head in range(HEADS):
                base = (block * HEADS + head) * 2 * ps * dim
                for d in range(dim):
                    k_at = (t // 16) * 16 * dim + (d // 2) * 32 + (t % 16) * 2 + d % 2
                    v_at = ps * dim + (d // 16) * (ps // 2) * 32 + (t // 2) * 32 \
                        + (d % 16) * 2 + t % 2
                    flat[base + k_at] = kv[layer, 0, token, head, d]
                    flat[base + v_at] = kv[layer, 1, token, head, d]
        layers.append(flat.view(PAGES, HEADS, ps, 2 * dim))
    return layers


def amx_kv(tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((LAYERS, 2, tokens, HEADS, AMX_DIM), generator=g).to(torch.bfloat16)


def test_vllm_amx_gather_reads_what_vllm_wrote_partial_pages_and_heads_too() -> None:
    kv = amx_kv(3 * AMX_PAGE)
    pages = [4, 1, 3]
    cache = PagedCache.vllm_cpu(vllm_amx_cache(kv, pages), "amx")
    assert torch.equal(cache.gather(pages), kv)
    out = torch.zeros_like(kv)
    cache.gather_views([(out, 0, pages, 2 * AMX_PAGE + 5)])  # the last page partial
    assert torch.equal(out[:, :, : 2 * AMX_PAGE + 5], kv[:, :, : 2 * AMX_PAGE + 5])
    assert not out[:, :, 2 * AMX_PAGE + 5 :].any()
    assert torch.equal(cache.head_slice(1, 1).gather(pages), kv[..., 1:2, :])
    strided = torch.zeros(LAYERS, 2, 3 * AMX_PAGE, HEADS, 2 * AMX_DIM, dtype=kv.dtype)[..., ::2]
    cache.gather_views([(strided, 0, pages)])  # dims not contiguous: through `_planes`
    assert torch.equal(strided, kv)


def test_vllm_amx_scatter_writes_what_vllm_would_and_nothing_else() -> None:
    kv = amx_kv(3 * AMX_PAGE, seed=1)
    want = vllm_amx_cache(kv, [4, 1, 3])
    scatters_as_vllm_writes(kv, want, "amx")
    # One head of two (a tensor-parallel shard's), from a strided view: that head's bytes.
    shard = [torch.full_like(t, 7.0) for t in want]
    PagedCache.vllm_cpu(shard, "amx").head_slice(1, 1).scatter(kv[..., 1:2, :], [1, 3], AMX_PAGE)
    for got, ref in zip(shard, want, strict=True):
        assert torch.equal(got[[1, 3], 1], ref[[1, 3], 1])
        assert bool((got[:, 0] == 7.0).all()) and bool((got[[0, 2, 4, 5]] == 7.0).all())
    # A partial last page: its first 5 tokens written, the slots after them left as they were.
    fresh = [torch.full_like(t, 7.0) for t in want]
    PagedCache.vllm_cpu(fresh, "amx").scatter_views([(kv, 0, [4], 5)])
    back = PagedCache.vllm_cpu(fresh, "amx").gather([4])
    assert torch.equal(back[:, :, :5], kv[:, :, :5])
    assert bool((back[:, :, 5:] == 7.0).all())


def test_kernel_layouts_round_trip() -> None:
    # vLLM's CUDA flash-attention layout, copied by the kernels' CPU twin here.
    layers = [torch.zeros(2, PAGES, PAGE, HEADS, DIM) for _ in range(LAYERS)]
    cache = PagedCache.kernels(EngineKV.paged(EngineLayout.VLLM_NHD, layers))
    kv = prompt_kv(2 * PAGE, seed=1)
    cache.scatter(kv, [5, 0], first_token=0)
    assert torch.equal(layers[1][0, 5], kv[1, 0, :PAGE])
    assert torch.equal(layers[0][1, 0], kv[0, 1, PAGE:])
    assert torch.equal(cache.gather([5, 0]), kv)


def test_whole_stored_blocks_scatter_as_kernel_slots_one_launch_per_run(monkeypatch) -> None:
    # Stored blocks of 2 pages, as the daemon's arena holds them: blocks 0 and 1 back to back,
    # block 3 after a gap, and a partial view (inside a block) that takes the page path.
    bt, pages_total = 2 * PAGE, 12
    arena = prompt_kv(4 * bt, seed=3).reshape(LAYERS, 2, 4, bt, HEADS, DIM) \
        .permute(2, 0, 1, 3, 4, 5).contiguous()  # [blocks, layers, kv, bt, heads, dim]
    views = [(arena[0], 0, [7, 2], bt), (arena[1], 0, [11, 0], bt), (arena[3], 0, [5, 9], bt),
             (arena[2], PAGE, [4], PAGE)]

    def cache() -> tuple[PagedCache, list[torch.Tensor]]:
        layers = [torch.full((2, pages_total, PAGE, HEADS, DIM), float("nan"))
                  for _ in range(LAYERS)]
        return PagedCache.kernels(EngineKV.paged(EngineLayout.VLLM_NHD, layers)), layers

    launches: list[tuple[int, ...]] = []
    real = kernels_api.scatter

    def counting(staging, engine, page_ids, *args, **kwargs):
        launches.append(tuple(staging.shape[:1]) + tuple(staging.shape[3:4]))
        return real(staging, engine, page_ids, *args, **kwargs)

    monkeypatch.setattr(paged_mod.kernels, "scatter", counting)
    fast, fast_layers = cache()
    fast.scatter_views(views)
    # Two runs of whole blocks (slots of a whole block each), then the partial view's pages.
    assert launches == [(2, bt), (1, bt), (1, PAGE)]
    slow, slow_layers = cache()
    for kv, first, pages, _ in views:  # the page-major path, page by page
        slow._engine_scatter(slow.engine, kv, pages, first)
    for got, want in zip(fast_layers, slow_layers, strict=True):
        assert torch.equal(got.isnan(), want.isnan())  # the same pages written, no others
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(fast_layers[1][:, 0], arena[1, 1, :, PAGE:])  # block 1, page 2 -> 0
    assert fast_layers[0][:, 3].isnan().all()  # a page no view named: untouched
