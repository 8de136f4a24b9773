"""Copies between a paged engine KV cache and kvstore's prompt-major KV, page by page.

kvstore's client speaks prompt-major KV, `[layers, kv, tokens, heads, head_dim]`. A paged engine
keeps each layer's K and V in pages of `page_size` tokens. `PagedCache` copies any subset of a
request's pages: a load must leave alone the pages the engine computed itself, since those may
be prefix-cache pages that other requests are reading.

vLLM's CPU attention (`cpu_attn.py`, ISAs "vec" and "vec16") allocates `[num_pages, heads,
page_size, 2 * head_dim]` per layer, but inside one (page, head) the first `page_size * head_dim`
elements are K *column-major*, `[head_dim, page_size]` (the QK kernel's B operand), and the rest
V row-major, `[page_size, head_dim]`: see `reshape_and_cache` in vLLM's
`csrc/cpu/cpu_attn_vec.hpp`. Its AMX ISA packs both K and V into tile layouts, which this module
does not decode. K is then not head_dim-contiguous, which the copy kernels require, so CPU
caches are copied with torch ops here (the kernels' CPU path is torch too); CUDA caches go through
`kernels.gather`/`kernels.scatter`.

Nothing here imports an engine, so the page arithmetic and the copies are tested without one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

import kernels
from kernels.layouts import EngineKV

VLLM_CPU_ISAS = frozenset({"vec", "vec16"})
"""vLLM CPU attention ISAs whose cache layout `PagedCache.vllm_cpu` decodes."""


def token_pages(block_ids: Sequence[int], block_size: int, page_size: int, start: int,
                end: int) -> list[int]:
    """Engine page ids holding tokens `[start, end)` of one request, in token order.

    `block_ids[i]` is the scheduler's block of tokens `[i*block_size, (i+1)*block_size)`. An
    attention backend may split each scheduler block into `block_size // page_size` pages of
    its cache tensor (vLLM's "kernel block size"); page `j` of block `b` is then page
    `b * ratio + j`. `start` and `end` must be page aligned.
    """
    if page_size < 1 or block_size % page_size:
        raise ValueError(f"page size {page_size} must divide the block size {block_size}")
    if start % page_size or end % page_size or not 0 <= start <= end:
        raise ValueError(f"token range [{start}, {end}) is not aligned to pages of {page_size}")
    ratio = block_size // page_size
    pages: list[int] = []
    for page in range(start // page_size, end // page_size):
        block, part = divmod(page, ratio)
        if block >= len(block_ids):
            raise ValueError(f"token {page * page_size} lies past the request's "
                             f"{len(block_ids)} blocks")
        pages.append(block_ids[block] * ratio + part)
    return pages


@dataclass(frozen=True)
class PagedCache:
    """A paged KV cache: vLLM's CPU layer tensors, or an `EngineKV` for the copy kernels."""

    page_size: int
    num_layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    layers: tuple[torch.Tensor, ...] = ()
    """vLLM CPU caches: one `[num_pages, heads, page_size, 2 * head_dim]` tensor per layer."""
    engine: EngineKV | None = None
    """CUDA caches: copied by the kernels."""

    @classmethod
    def vllm_cpu(cls, layers: Sequence[torch.Tensor], isa: str) -> PagedCache:
        """vLLM's CPU cache: one `[num_pages, heads, page_size, 2 * head_dim]` tensor per layer
        (see the module docstring for the order inside a page)."""
        if isa not in VLLM_CPU_ISAS:
            raise ValueError(f"vLLM CPU attention ISA {isa!r} packs its cache in a layout this "
                             f"connector does not decode (supported: {sorted(VLLM_CPU_ISAS)})")
        first = layers[0]
        for i, t in enumerate(layers):
            if t.dim() != 4 or t.shape != first.shape or t.dtype != first.dtype \
                    or not t.is_contiguous() or t.device.type != "cpu" or t.shape[3] % 2:
                raise ValueError(f"layer {i}: expected a contiguous CPU tensor [pages, heads, "
                                 f"page_size, 2*head_dim] like layer 0, got {tuple(t.shape)} "
                                 f"strides {t.stride()} on {t.device}")
        _, heads, page_size, two_dim = first.shape
        return cls(page_size=page_size, num_layers=len(layers), heads=heads,
                   head_dim=two_dim // 2, dtype=first.dtype, layers=tuple(layers))

    @classmethod
    def kernels(cls, engine: EngineKV) -> PagedCache:
        """A cache the copy kernels know (`kernels.layouts`), e.g. vLLM's CUDA layouts."""
        plane = engine.planes(1 << 30)[0]  # paged layouts ignore the block size
        return cls(page_size=int(plane.shape[1]), num_layers=engine.num_layers,
                   heads=int(plane.shape[2]), head_dim=int(plane.shape[3]),
                   dtype=engine.dtype, engine=engine)

    def scatter(self, kv: torch.Tensor, page_ids: Sequence[int], first_token: int) -> None:
        """Write `kv[:, :, first_token : first_token + len(page_ids) * page_size]` (prompt-major,
        on the CPU) into `page_ids`."""
        n, ps = len(page_ids), self.page_size
        if n == 0:
            return
        part = kv[:, :, first_token : first_token + n * ps]
        if part.shape[2] != n * ps:
            raise ValueError(f"kv holds {kv.shape[2]} tokens, fewer than the {n} pages from "
                             f"token {first_token} need")
        if self.engine is not None:
            # Page-major staging, one page per slot (each slot contiguous, as the kernel wants).
            staging = part.unflatten(2, (n, ps)).permute(2, 0, 1, 3, 4, 5).contiguous()
            kernels.scatter(staging.to(self.engine.device), self.engine, list(page_ids))
            return
        index = torch.as_tensor(list(page_ids), dtype=torch.long)
        heads, dim = self.heads, self.head_dim
        for layer, t in enumerate(self.layers):
            halves = t.view(t.shape[0], heads, 2, ps * dim)
            k = halves[:, :, 0].view(-1, heads, dim, ps).permute(0, 3, 1, 2)  # K: [dim, ps]
            v = halves[:, :, 1].view(-1, heads, ps, dim).permute(0, 2, 1, 3)  # V: [ps, dim]
            # index_put_ through the strided views writes the engine's storage in place; on a
            # 2-core machine it beat staging whole pages and index_copy_ (120 vs 157 ms for
            # 2048 tokens of an 8B-shaped model).
            k[index] = part[layer, 0].unflatten(0, (n, ps))
            v[index] = part[layer, 1].unflatten(0, (n, ps))

    def gather(self, page_ids: Sequence[int]) -> torch.Tensor:
        """Read `page_ids` into new prompt-major KV `[layers, 2, len(page_ids) * page_size,
        heads, head_dim]` on the CPU."""
        n, ps = len(page_ids), self.page_size
        if self.engine is not None:
            shape = kernels.staging_shape(self.engine, n, ps)
            staging = torch.empty(shape, dtype=self.dtype, device=self.engine.device)
            if n:
                kernels.gather(self.engine, staging, list(page_ids))
            # reshape copies (the permuted dims cannot merge): that copy is the result.
            out = staging.permute(1, 2, 0, 3, 4, 5).reshape(
                self.num_layers, 2, n * ps, self.heads, self.head_dim)
            return out.cpu()
        heads, dim = self.heads, self.head_dim
        out = torch.empty((self.num_layers, 2, n * ps, heads, dim), dtype=self.dtype)
        index = torch.as_tensor(list(page_ids), dtype=torch.long)
        for layer, t in enumerate(self.layers):
            # Whole pages out first (contiguous reads), then K and V into token order: 97 ms
            # against 141 ms for indexing the strided views (2048 tokens, 8B shape, 2 cores).
            pages = t.index_select(0, index).view(n, heads, 2, ps * dim)
            k = pages[:, :, 0].view(n, heads, dim, ps).permute(0, 3, 1, 2)
            v = pages[:, :, 1].view(n, heads, ps, dim).permute(0, 2, 1, 3)
            out[layer, 0].view(n, ps, heads, dim).copy_(k)
            out[layer, 1].view(n, ps, heads, dim).copy_(v)
        return out
