"""Saves out of a vLLM CPU cache (`PagedCache.gather_views`), C routine and torch fallback,
against an index-by-index reader of the "vec" layout: every dtype, tile remainders in both
directions of the C transpose, random pages, partial last pages, arena block views, and
destinations with other strides (which the torch path copies in one pass too); nothing outside
the requested tokens is written."""

from __future__ import annotations

import pytest
import torch

from kvstore.client.integrations import paged
from kvstore.client.integrations.paged import PagedCache

SENTINEL = -3.0


def random_cache(layers: int, pages: int, heads: int, ps: int, dim: int, dtype: torch.dtype,
                 seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(pages, heads, ps, 2 * dim, generator=g).to(dtype)
            for _ in range(layers)]


def read_tokens(cache: list[torch.Tensor], pages: list[int], count: int) -> torch.Tensor:
    """`[layers, 2, count, heads, dim]` read token by token: per (page, head), K is `[dim, ps]`
    (column-major) then V `[ps, dim]` (vLLM's `reshape_and_cache`, cpu_attn_vec.hpp)."""
    num_pages, heads, ps, two_dim = cache[0].shape
    dim = two_dim // 2
    out = torch.empty(len(cache), 2, count, heads, dim, dtype=cache[0].dtype)
    for layer, t in enumerate(cache):
        flat = t.reshape(num_pages, heads, 2 * ps * dim)
        for token in range(count):
            page, slot = pages[token // ps], token % ps
            for head in range(heads):
                k, v = flat[page, head, : ps * dim], flat[page, head, ps * dim :]
                out[layer, 0, token, head] = k[slot::ps]  # K's column `slot`
                out[layer, 1, token, head] = v[slot * dim : (slot + 1) * dim]
    return out


needs_native = pytest.mark.skipif(paged.native_copy() is None,
                                  reason="no C compiler: only the torch copy exists here")
PATHS = [pytest.param(True, marks=needs_native, id="C"), pytest.param(False, id="torch")]
SHAPES = [  # (dtype, layers, heads, head_dim, page size)
    (torch.bfloat16, 2, 2, 64, 16),  # whole 8x8 tiles
    (torch.float32, 2, 2, 32, 8),  # whole 4x4 tiles
    (torch.bfloat16, 2, 3, 20, 12),  # 8x8 tiles plus remainders either way
    (torch.float32, 1, 2, 10, 6),  # 4x4 tiles plus remainders either way
    (torch.float16, 2, 1, 6, 5),  # no whole tile: element by element
]


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize(("dtype", "layers", "heads", "dim", "ps"), SHAPES)
def test_gather_into_block_views_matches_reference(native, dtype, layers, heads, dim, ps,
                                                   monkeypatch) -> None:
    monkeypatch.setenv(paged.NATIVE_ENV, "1" if native else "0")
    cache_t = random_cache(layers, 9, heads, ps, dim, dtype, seed=ps)
    cache = PagedCache.vllm_cpu(cache_t, "vec")
    pages = [7, 2, 8, 0, 5]  # a request's pages, out of order
    count = 4 * ps + ps // 2 + 1  # the last page partial
    want = read_tokens(cache_t, pages, count)
    # Blocks of 2 pages as the daemon's arena holds them, the last one partly filled.
    blocks = torch.full((3, layers, 2, 2 * ps, heads, dim), SENTINEL, dtype=dtype)
    cache.gather_views([(blocks[0], 0, pages[0:2]), (blocks[1], 0, pages[2:4]),
                        (blocks[2], 0, pages[4:5], count - 4 * ps)])
    got = torch.cat(list(blocks), dim=2)
    assert torch.equal(got[:, :, :count], want)
    assert (got[:, :, count:] == SENTINEL).all()


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_into_strided_destinations(native, dtype, monkeypatch) -> None:
    """A prompt-major tensor from a token offset, a layer/kv-strided slice (the C routine's
    strides), and a destination whose tokens are not heads*dim apart (the torch path's)."""
    monkeypatch.setenv(paged.NATIVE_ENV, "1" if native else "0")
    layers, heads, dim, ps = 3, 2, 16, 8
    cache_t = random_cache(layers, 6, heads, ps, dim, dtype, seed=11)
    cache = PagedCache.vllm_cpu(cache_t, "vec")
    pages = [4, 1, 3]
    want = read_tokens(cache_t, pages, 3 * ps)

    prompt = torch.full((layers, 2, 5 * ps, heads, dim), SENTINEL, dtype=dtype)
    cache.gather_views([(prompt, ps, pages)])
    assert torch.equal(prompt[:, :, ps : 4 * ps], want)
    assert (prompt[:, :, :ps] == SENTINEL).all() and (prompt[:, :, 4 * ps :] == SENTINEL).all()

    wide = torch.full((2 * layers, 2, 3 * ps, heads, dim), SENTINEL, dtype=dtype)
    cache.gather_views([(wide[::2], 0, pages)])  # every other layer
    assert torch.equal(wide[::2], want) and (wide[1::2] == SENTINEL).all()

    padded = torch.full((layers, 2, 3 * ps, heads, dim + 3), SENTINEL, dtype=dtype)
    cache.gather_views([(padded[..., :dim], 0, pages)])  # rows dim+3 apart: torch copies it
    assert torch.equal(padded[..., :dim], want) and (padded[..., dim:] == SENTINEL).all()


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_c_and_torch_save_the_same_bytes(dtype, monkeypatch) -> None:
    """An 8B-shaped slice (8 heads, head_dim 128, 128-token pages): both paths, byte for byte."""
    cache_t = random_cache(2, 5, 8, 128, 128, dtype, seed=3)
    cache = PagedCache.vllm_cpu(cache_t, "vec")
    out = {}
    for native in ("1", "0"):
        monkeypatch.setenv(paged.NATIVE_ENV, native)
        out[native] = cache.gather([4, 0, 2])
    assert torch.equal(out["1"].view(torch.uint8), out["0"].view(torch.uint8))
    assert torch.equal(out["1"], read_tokens(cache_t, [4, 0, 2], 3 * 128))
