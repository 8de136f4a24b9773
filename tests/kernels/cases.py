"""Random engine caches, staging buffers and ids for the copy-kernel tests."""

from __future__ import annotations

import dataclasses

import torch

from kvstore.kernels import EngineKV, EngineLayout, staging_shape


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Logical dimensions of a random engine cache."""

    layout: EngineLayout
    dtype: torch.dtype
    num_layers: int = 3
    num_pages: int = 9
    page_size: int = 4
    heads: int = 2
    head_dim: int = 8
    block_tokens: int = 8
    batch: int = 2  # HF only
    strided: bool = False  # pages (and head_dim) padded: non-contiguous views
    misalign: bool = False  # tensors start one element past an aligned address
    shared_storage: bool = False  # all layers are views of one allocation
    physical: tuple[int, ...] | None = None  # memory order of the logical dims (a stride order)


def _shape(spec: CacheSpec) -> tuple[int, ...]:
    p, ps, h, d = spec.num_pages, spec.page_size, spec.heads, spec.head_dim
    return {
        EngineLayout.VLLM_NHD: (2, p, ps, h, d),
        EngineLayout.VLLM_HND: (2, p, h, ps, d),
        EngineLayout.FLASHINFER_NHD: (p, 2, ps, h, d),
        EngineLayout.VLLM_CPU: (p, h, ps, 2 * d),
        EngineLayout.VLLM_PACKED: (p, h, ps, 2 * d),
        EngineLayout.MLA: (p, ps, d),
        # HF: a sequence of num_pages blocks plus a partial block at the end.
        EngineLayout.HF: (spec.batch, h, p * spec.block_tokens + 3, d),
    }[spec.layout]


def random_bytes_(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fill a contiguous tensor with random bit patterns (NaNs included)."""
    flat = t.view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
    return t


def random_tensor(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    gen: torch.Generator,
    *,
    strided: bool = False,
    misalign: bool = False,
    page_dim: int = 0,
    pad_last: bool = True,
) -> torch.Tensor:
    """A random tensor of ``shape``; optionally a strided or misaligned view."""
    full = list(shape)
    if strided:
        full[page_dim] = 2 * full[page_dim] + 1
        if pad_last:
            full[-1] += 3
    numel = 1
    for n in full:
        numel *= n
    base = torch.empty(numel + 1, dtype=dtype)
    random_bytes_(base, gen)
    t = base[1 : numel + 1] if misalign else base[:numel]
    t = t.view(full)
    if strided:
        t = t.narrow(page_dim, 1, 2 * shape[page_dim]).unflatten(page_dim, (shape[page_dim], 2))
        t = t.select(page_dim + 1, 0)
        if pad_last:
            t = t[..., : shape[-1]]
    assert tuple(t.shape) == tuple(shape)
    return t


def make_engine(spec: CacheSpec, gen: torch.Generator) -> EngineKV:
    logical = _shape(spec)
    page_dim = 1 if spec.layout in (EngineLayout.VLLM_NHD, EngineLayout.VLLM_HND) else 0
    order = spec.physical or tuple(range(len(logical)))
    shape = tuple(logical[i] for i in order)  # allocated in memory order, permuted back below
    page_dim = order.index(page_dim)
    if spec.layout is EngineLayout.HF:
        page_dim = 2  # the sequence
    # vLLM's CPU layout views (page_size, 2*head_dim) as (2, page_size, head_dim):
    # those two dims must stay dense, so only the pages are padded.
    pad_last = spec.layout is not EngineLayout.VLLM_CPU
    n_tensors = spec.num_layers * (2 if spec.layout is EngineLayout.HF else 1)
    if spec.shared_storage:
        big = random_tensor(
            (n_tensors, *shape),
            spec.dtype,
            gen,
            strided=spec.strided,
            misalign=spec.misalign,
            page_dim=page_dim + 1,
            pad_last=pad_last,
        )
        tensors = list(big.unbind(0))
    else:
        tensors = [
            random_tensor(
                shape,
                spec.dtype,
                gen,
                strided=spec.strided,
                misalign=spec.misalign,
                page_dim=page_dim,
                pad_last=pad_last,
            )
            for _ in range(n_tensors)
        ]
    inverse = tuple(order.index(i) for i in range(len(order)))
    tensors = [t.permute(inverse) for t in tensors]
    if spec.layout is EngineLayout.HF:
        half = spec.num_layers
        return EngineKV.transformers(tensors[:half], tensors[half:], batch_index=spec.batch - 1)
    return EngineKV.paged(spec.layout, tensors)


def make_staging(
    engine: EngineKV, num_slots: int, block_tokens: int, gen: torch.Generator, misalign: bool
) -> torch.Tensor:
    shape = staging_shape(engine, num_slots, block_tokens)
    return random_tensor(shape, engine.dtype, gen, misalign=misalign)


def num_pages(engine: EngineKV, block_tokens: int) -> int:
    return int(engine.planes(block_tokens)[0].shape[0])


def random_ids(
    gather: bool,
    num_blocks: int,
    pages_per_block: int,
    pages: int,
    slots: int,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Page and slot ids: unique on the written side, repeats on the read side."""
    n = num_blocks * pages_per_block
    if gather:
        page_ids = torch.randint(0, pages, (n,), generator=gen)
        slot_ids = torch.randperm(slots, generator=gen)[:num_blocks]
        if n > 1:
            page_ids[-1] = page_ids[0]  # the same page read twice
    else:
        page_ids = torch.randperm(pages, generator=gen)[:n]
        slot_ids = torch.randint(0, slots, (num_blocks,), generator=gen)
        if num_blocks > 1:
            slot_ids[-1] = slot_ids[0]  # the same slot written to two places
    return page_ids.reshape(num_blocks, pages_per_block), slot_ids


def assert_same_bytes(expected: torch.Tensor, got: torch.Tensor, what: str) -> None:
    """Byte-exact equality, with the first differing offsets on failure."""
    if expected.shape != got.shape:
        raise AssertionError(f"{what}: {got.numel()} bytes, expected {expected.numel()}")
    diff = (expected != got).nonzero().reshape(-1)
    if diff.numel():
        first = diff[:8].tolist()
        raise AssertionError(
            f"{what}: {diff.numel()} of {expected.numel()} bytes differ from the torch "
            f"oracle; first at byte offsets {first} "
            f"(expected {expected[diff[:8]].tolist()}, kernel wrote {got[diff[:8]].tolist()})"
        )
