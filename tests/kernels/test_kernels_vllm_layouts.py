"""vLLM's KV-cache layouts, as read from vLLM's own source, through the copy kernels.

Each case allocates a cache the way that vLLM release does and writes a request's K/V (or MLA
latents) the way its attention backend does; both are transcribed here from vLLM's code,
independently of kernels/layouts.py. `kernels.vllm_engine_kv` then picks the layout from the
backend name, the version and the tensors alone, and the test checks a gather token by token
(CPU path, and kv_copy.cu under the host shim) and a scatter (the kernel) byte for byte against
the cache the backend wrote. Anything not read from vLLM is refused, naming what it saw.

Sources (each release's wheel): `get_kv_cache_shape`/`get_kv_cache_stride_order` of
flash_attn.py, flashinfer.py, triton_attn.py, flex_attention.py and mla_attention.py up to
0.28; `vllm/v1/kv_cache_layout.py` and `create_kv_cache_views` (kv_cache_interface.py) from
0.29; the backends' `do_kv_cache_update` for how K/V are split; `cpu_mla.py` for the CPU MLA
writer (block size 16, latent 512 + 64).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from kvstore import kernels
from kvstore.kernels import EngineLayout, LayoutError
from kvstore.kernels.plan import Direction, plan_launch, prepare
from tests.kernels.cases import assert_same_bytes, random_bytes_
from tests.kernels.shim import ShimRunner, storage_bytes

L, H, D, N = 2, 3, 8, 4  # layers, KV heads, head size, vLLM block (page) size
PAGES = 6  # vLLM blocks per layer
TABLE = [4, 1, 5, 0]  # the request's vLLM block ids, in token order (two kvstore blocks)
DEEPSEEK_V2 = (512, 64)  # kv_lora_rank, qk_rope_head_dim: a 576-wide latent
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# vllm/v1/kv_cache_layout.py (0.29-0.33): stride permutations of the logical [L, B, H, N, C].
KV_CACHE_LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
NHD, HND = "NHD", "HND"


def layout_views(order: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype):
    """vLLM >= 0.29 `create_kv_cache_views`: one allocation for all layers, strides found by
    walking the stride order from the innermost dim; one `[B, H, N, C]` view per layer."""
    strides, step = [0] * 5, 1
    for dim in reversed(order):
        strides[dim], step = step, step * shape[dim]
    raw = torch.zeros(step, dtype=dtype)
    return list(torch.as_strided(raw, shape, strides).unbind(0))


def stride_order_views(shape: tuple[int, ...], order: tuple[int, ...], dtype: torch.dtype):
    """vLLM <= 0.28 `_reshape_attention_kv_cache`: each layer allocated in stride order, then
    permuted back to `get_kv_cache_shape`."""
    inverse = [order.index(i) for i in range(len(order))]
    return [torch.zeros([shape[i] for i in order], dtype=dtype).permute(inverse) for _ in range(L)]


def packed(memory: str) -> Callable[[torch.dtype], list[torch.Tensor]]:
    """0.26-0.28 `get_kv_cache_shape` (num_blocks, num_kv_heads, block_size, 2 * head_size)
    with `get_kv_cache_stride_order` NHD (0, 2, 1, 3) or HND (0, 1, 2, 3)."""
    order = (0, 2, 1, 3) if memory == NHD else (0, 1, 2, 3)
    return lambda dtype: stride_order_views((PAGES, H, N, 2 * D), order, dtype)


def blocks_first(memory: str) -> Callable[[torch.dtype], list[torch.Tensor]]:
    """0.23-0.25 (num_blocks, 2, block_size, num_kv_heads, head_size), stride order NHD
    (0, 1, 2, 3, 4) or HND (0, 1, 3, 2, 4); Flex's (0, 2, 1, 3, 4) is `"flex"`."""
    order = {NHD: (0, 1, 2, 3, 4), HND: (0, 1, 3, 2, 4), "flex": (0, 2, 1, 3, 4)}[memory]
    return lambda dtype: stride_order_views((PAGES, 2, N, H, D), order, dtype)


def kv_first(memory: str) -> Callable[[torch.dtype], list[torch.Tensor]]:
    """0.22 flash-attention (2, num_blocks, block_size, num_kv_heads, head_size)."""
    order = (0, 1, 2, 3, 4) if memory == NHD else (0, 1, 3, 2, 4)
    return lambda dtype: stride_order_views((2, PAGES, N, H, D), order, dtype)


def kv_cache_layout(
    name: str, mla: bool = False, block_size: int = N
) -> Callable[[torch.dtype], list[torch.Tensor]]:
    """0.29-0.33: [B, H, N, C] per layer; C = 2 * head_size, or the MLA latent with H = 1."""
    heads, content = (1, sum(DEEPSEEK_V2)) if mla else (H, 2 * D)
    shape = (L, PAGES, heads, block_size, content)
    return lambda dtype: layout_views(KV_CACHE_LAYOUTS[name], shape, dtype)


def mla_3d(block_size: int = N) -> Callable[[torch.dtype], list[torch.Tensor]]:
    """<= 0.28 MLACommonBackend (num_blocks, block_size, head_size), stride order (0, 1, 2)."""
    shape = (PAGES, block_size, sum(DEEPSEEK_V2))
    return lambda dtype: [torch.zeros(shape, dtype=dtype) for _ in range(L)]


# Writers: token `off` of vLLM block `page`; k, v are [heads, head_size], or k a latent row.
Writer = Callable[[torch.Tensor, int, int, torch.Tensor, torch.Tensor | None], None]


def write_packed(cache, page, off, k, v):
    # >= 0.26 FlashAttentionImpl.do_kv_cache_update (and Triton, Flex, FlashInfer): "(B, H, N,
    # 2*D) -> ((B, N, H, D), (B, N, H, D))", then reshape_and_cache_flash stores
    # key[token] at key_cache[block, offset].
    key_cache, value_cache = cache.transpose(1, 2).split(D, dim=-1)
    key_cache[page, off] = k
    value_cache[page, off] = v


def write_blocks_first(cache, page, off, k, v):
    key_cache, value_cache = cache.unbind(1)  # 0.23-0.25 flash_attn / flex / triton
    key_cache[page, off] = k
    value_cache[page, off] = v


def write_kv_first(cache, page, off, k, v):
    key_cache, value_cache = cache.unbind(0)  # 0.22 flash_attn / flex
    key_cache[page, off] = k
    value_cache[page, off] = v


def write_mla(cache, page, off, latent, _v):
    # concat_and_cache_mla: kv_cache[block, offset] = [kv_c_normed | k_pe]; from 0.29 the
    # layer's [B, 1, N, C] view is squeezed first (MLAAttention.bind_kv_cache).
    rank = DEEPSEEK_V2[0]
    rows = cache.squeeze(1) if cache.dim() == 4 else cache
    rows[page, off, :rank] = latent[0, :rank]
    rows[page, off, rank:] = latent[0, rank:]


def write_cpu_mla(cache, page, off, latent, _v):
    # CPUMLAImpl.do_kv_cache_update (0.28-0.33): flat = kv_cache.view(-1, kv_lora_rank + pe_dim)
    rank = DEEPSEEK_V2[0]
    flat = cache.view(-1, sum(DEEPSEEK_V2))
    slot = page * cache.shape[-2] + off
    flat[slot, :rank] = latent[0, :rank]
    flat[slot, rank:] = latent[0, rank:]


@dataclass(frozen=True)
class VllmCase:
    id: str
    backend: str
    version: str
    alloc: Callable[[torch.dtype], list[torch.Tensor]]
    write: Writer
    engine: EngineLayout
    page_size: int = N

    @property
    def block_tokens(self) -> int:
        """kvstore's block: two vLLM blocks (the request's four pages make two)."""
        return 2 * self.page_size

    @property
    def mla(self) -> bool:
        return self.engine is EngineLayout.MLA

    @property
    def heads_dim(self) -> tuple[int, int]:
        return (1, sum(DEEPSEEK_V2)) if self.mla else (H, D)


CASES = [
    *(
        VllmCase(f"0.33-FLASH_ATTN-{name}", "FLASH_ATTN", "0.33.0", kv_cache_layout(name),
                 write_packed, EngineLayout.VLLM_PACKED)
        for name in KV_CACHE_LAYOUTS
    ),
    VllmCase("0.33-FLASHINFER-LBHNC", "FLASHINFER", "0.33.0", kv_cache_layout("LBHNC"),
             write_packed, EngineLayout.VLLM_PACKED),
    VllmCase("0.32-TRITON_ATTN-LBNHC", "TRITON_ATTN", "0.32.0+cpu", kv_cache_layout("LBNHC"),
             write_packed, EngineLayout.VLLM_PACKED),
    VllmCase("0.29-FLEX_ATTENTION-LBNHC", "FLEX_ATTENTION", "0.29.0", kv_cache_layout("LBNHC"),
             write_packed, EngineLayout.VLLM_PACKED),
    VllmCase("0.26-FLASH_ATTN-NHD", "FLASH_ATTN", "0.26.0", packed(NHD), write_packed,
             EngineLayout.VLLM_PACKED),
    VllmCase("0.28-FLASHINFER-HND", "FLASHINFER", "0.28.0", packed(HND), write_packed,
             EngineLayout.VLLM_PACKED),
    VllmCase("0.25-FLASH_ATTN-NHD", "FLASH_ATTN", "0.25.1", blocks_first(NHD),
             write_blocks_first, EngineLayout.FLASHINFER_NHD),
    VllmCase("0.23-FLASHINFER-HND", "FLASHINFER", "0.23.0", blocks_first(HND),
             write_blocks_first, EngineLayout.FLASHINFER_NHD),
    VllmCase("0.25-FLEX_ATTENTION", "FLEX_ATTENTION", "0.25.1", blocks_first("flex"),
             write_blocks_first, EngineLayout.FLASHINFER_NHD),
    VllmCase("0.22-FLASH_ATTN-NHD", "FLASH_ATTN", "0.22.1", kv_first(NHD), write_kv_first,
             EngineLayout.VLLM_NHD),
    VllmCase("0.22-FLASH_ATTN-HND", "FLASH_ATTN", "0.22.1", kv_first(HND), write_kv_first,
             EngineLayout.VLLM_NHD),
    VllmCase("0.28-TRITON_MLA", "TRITON_MLA", "0.28.0", mla_3d(), write_mla, EngineLayout.MLA),
    VllmCase("0.28-CPU_MLA-16", "CPU_MLA", "0.28.0", mla_3d(16), write_cpu_mla, EngineLayout.MLA,
             page_size=16),
    *(
        VllmCase(f"0.33-FLASHMLA-{name}", "FLASHMLA", "0.33.0", kv_cache_layout(name, mla=True),
                 write_mla, EngineLayout.MLA)
        for name in ("LBNHC", "BLHNC")
    ),
    VllmCase("0.32-CPU_MLA-16", "CPU_MLA", "0.32.0+cpu",
             kv_cache_layout("LBNHC", mla=True, block_size=16), write_cpu_mla, EngineLayout.MLA,
             page_size=16),
    # AMX_MLA's amx_mla_concat_and_cache writes the same plain rows (tests/vllm/test_cpu_isa.py
    # checks it against the op itself, where the CPU has AMX).
    VllmCase("0.32-AMX_MLA-32", "AMX_MLA", "0.32.0+cpu",
             kv_cache_layout("LBNHC", mla=True, block_size=32), write_cpu_mla, EngineLayout.MLA,
             page_size=32),
]  # fmt: skip
"""One case per layout, per stride order vLLM allocates it in (the host shim makes a case
slower than the CPU path, so each backend that shares a layout gets one order, not all)."""


def fill(case: VllmCase, dtype: torch.dtype, gen: torch.Generator):
    """The request's K/V as the backend wrote them, and the canonical blocks they must give."""
    heads, width = case.heads_dim
    kv = 1 if case.mla else 2
    seq = len(TABLE) * case.page_size
    values = random_bytes_(torch.empty(L, kv, seq, heads, width, dtype=dtype), gen)
    cache = case.alloc(dtype)
    for layer in range(L):
        for tok in range(seq):
            page, off = TABLE[tok // case.page_size], tok % case.page_size
            v = None if case.mla else values[layer, 1, tok]
            case.write(cache[layer], page, off, values[layer, 0, tok], v)
    blocks = seq // case.block_tokens
    expected = values.reshape(L, kv, blocks, case.block_tokens, heads, width).permute(
        2, 0, 1, 3, 4, 5
    )
    return cache, expected.contiguous()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_vllm_layout_through_the_kernel(shim: ShimRunner, case: VllmCase, dtype: torch.dtype):
    cache, expected = fill(case, dtype, torch.Generator().manual_seed(len(case.id)))
    heads, width = case.heads_dim
    head_size = width if case.mla else D
    engine = kernels.vllm_engine_kv(
        case.backend, case.version, cache, num_kv_heads=heads, head_size=head_size
    )
    assert engine.layout is case.engine
    page_ids = torch.tensor(TABLE).reshape(-1, 2)
    shape = kernels.staging_shape(engine, len(page_ids), case.block_tokens)
    staging = torch.zeros(shape, dtype=dtype)
    kernels.gather(engine, staging, page_ids)  # the CPU path
    assert torch.equal(bits(staging), bits(expected)), "CPU gather"

    out = torch.zeros_like(staging)
    req = prepare(Direction.GATHER, engine, out, page_ids)
    result = shim.run(plan_launch(req, sm_count=132), [*cache, out], req.page_ids, req.slot_ids)
    got = result.after[out.untyped_storage().data_ptr()]
    assert_same_bytes(bits(expected), got, f"{case.id} gather kernel")

    # Scatter into a fresh cache of the same allocation: byte-identical to what vLLM wrote.
    fresh = case.alloc(dtype)
    target = kernels.vllm_engine_kv(
        case.backend, case.version, fresh, num_kv_heads=heads, head_size=head_size
    )
    req = prepare(Direction.SCATTER, target, staging, page_ids)
    result = shim.run(plan_launch(req, sm_count=132), [*fresh, staging], req.page_ids, req.slot_ids)
    for mine, theirs in zip(fresh, cache, strict=True):
        st = mine.untyped_storage()
        assert_same_bytes(
            storage_bytes(theirs.untyped_storage()), result.after[st.data_ptr()], case.id
        )


def test_every_vllm_layout_has_a_case() -> None:
    hit = set()
    for case in CASES:
        layer = case.alloc(torch.float16)[0]
        heads, width = case.heads_dim
        lay = kernels.vllm_layout(
            case.backend,
            case.version,
            layer.shape,
            layer.stride(),
            num_kv_heads=heads,
            head_size=width if case.mla else D,
        )
        hit.add(kernels.VLLM_LAYOUTS.index(lay))
    assert hit == set(range(len(kernels.VLLM_LAYOUTS)))


def test_cpu_mla_block_16_rows_are_vllm_latents() -> None:
    # CPU MLA (0.28-0.33): block size 16, one 576-wide row per token [kv_c_normed | k_pe].
    shape = (L, PAGES, 1, 16, sum(DEEPSEEK_V2))
    cache = layout_views(KV_CACHE_LAYOUTS["LBNHC"], shape, torch.bfloat16)
    kv_c = torch.randn(32, DEEPSEEK_V2[0]).to(torch.bfloat16)
    k_pe = torch.randn(32, DEEPSEEK_V2[1]).to(torch.bfloat16)
    for layer in cache:
        for tok, page in enumerate([3] * 16 + [1] * 16):
            write_cpu_mla(layer, page, tok % 16, torch.cat([kv_c[tok], k_pe[tok]])[None], None)
    engine = kernels.vllm_engine_kv("CPU_MLA", "0.32.0", cache, num_kv_heads=1, head_size=576)
    staging = torch.zeros(kernels.staging_shape(engine, 1, 32), dtype=torch.bfloat16)
    kernels.gather(engine, staging, [[3, 1]])
    assert staging.shape == (1, L, 1, 32, 1, 576)
    assert torch.equal(staging[0, 1, 0, :, 0, :512], kv_c)
    assert torch.equal(staging[0, 1, 0, :, 0, 512:], k_pe)


def shaped(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return shape, torch.empty(shape, device="meta").stride()


@pytest.mark.parametrize(
    ("backend", "version", "shape", "heads", "head_size", "match"),
    [
        # B12X packs K and V as two "heads": with 2 KV heads its shape equals the packed one.
        ("B12X", "0.33.0", (9, 2, 16, 256), 2, 128, "two head slots"),
        ("CPU_ATTN", "0.32.0", (9, 2, 16, 256), 2, 128, "paged.py"),
        ("AMX_MLA", "0.33.0", (9, 1, 32, 576), 1, 576, r"0\.32 \(mla.*only; .*CPU_MLA"),
        ("TRITON_ATTN_DIFFKV", "0.33.0", (9, 2, 16, 192), 2, 128, "different head sizes"),
        ("FLASHMLA_SPARSE", "0.33.0", (9, 1, 64, 656), 1, 576, "no known cache layout"),
        ("ROCM_ATTN", "0.33.0", (9, 2, 16, 256), 2, 128, "no known cache layout"),
        ("FLASH_ATTN", "0.34.0", (9, 2, 16, 256), 2, 128, r"read for vLLM .*0\.26-0\.33"),
        ("FLASH_ATTN", "0.21.2", (2, 9, 16, 2, 128), 2, 128, "read for vLLM"),
        ("FLASH_ATTN", "main", (9, 2, 16, 256), 2, 128, "read for vLLM"),
        ("CPU_MLA", "0.27.0", (9, 16, 576), 1, 576, "read for vLLM"),
        # The pre-0.26 shape under 0.33, and 0.33's packed shape claimed as 0.25.
        ("FLASH_ATTN", "0.33.0", (9, 2, 16, 2, 128), 2, 128, "expected the packed_kv layout"),
        ("FLASH_ATTN", "0.25.1", (9, 2, 16, 256), 2, 128, "expected the blocks_first layout"),
        # FlashInfer NVFP4 (2 * heads slots of fp4 data + scales), Triton per-token-head int8
        # (inline fp32 scales), MLA fp8_ds_mla (656-byte rows): quantized, refused.
        ("FLASHINFER", "0.33.0", (9, 4, 16, 72), 2, 128, "quantized or repacked"),
        ("TRITON_ATTN", "0.33.0", (9, 2, 16, 264), 2, 128, "quantized or repacked"),
        ("FLASHMLA", "0.33.0", (9, 1, 64, 656), 1, 576, "quantized or repacked"),
        ("TRITON_MLA", "0.28.0", (9, 1, 16, 576), 1, 576, "expected the mla_latent layout"),
    ],
)
def test_unknown_vllm_layouts_are_refused(
    backend: str, version: str, shape: tuple[int, ...], heads: int, head_size: int, match: str
) -> None:
    shape, stride = shaped(shape)
    with pytest.raises(LayoutError, match=match) as info:
        kernels.vllm_layout(
            backend, version, shape, stride, num_kv_heads=heads, head_size=head_size
        )
    text = str(info.value)
    assert backend in text
    assert version in text
    assert str(tuple(shape)) in text
    assert str(tuple(stride)) in text
    assert isinstance(info.value, kernels.KernelArgumentError)


def test_refusals_are_invalid_argument_errors() -> None:
    from kvstore.errors import InvalidArgumentError

    layer = torch.zeros(4, 1, 16, 576)
    with pytest.raises(InvalidArgumentError, match="CPU_ATTN"):
        kernels.vllm_engine_kv("CPU_ATTN", "0.33.0", [layer], num_kv_heads=1, head_size=576)


def test_content_dim_must_be_contiguous() -> None:
    t = torch.zeros(4, 2, 16, 2, 256)[..., 0, :]  # last dim fine, a sliced-out pair elsewhere
    engine = kernels.vllm_engine_kv("FLASH_ATTN", "0.33.0", [t], num_kv_heads=2, head_size=128)
    assert engine.layout is EngineLayout.VLLM_PACKED
    strided = torch.zeros(4, 2, 16, 256, 2)[..., 0]
    with pytest.raises(LayoutError, match="last dim must be contiguous"):
        kernels.vllm_engine_kv("FLASH_ATTN", "0.33.0", [strided], num_kv_heads=2, head_size=128)


def test_layers_must_share_one_layout() -> None:
    a = torch.zeros(4, 2, 16, 256)
    b = torch.zeros(4, 16, 2, 256).transpose(1, 2)  # same shape, NHD strides
    with pytest.raises(kernels.StrideError, match="layer 1"):
        kernels.vllm_engine_kv("FLASH_ATTN", "0.33.0", [a, b], num_kv_heads=2, head_size=128)


def test_rocm_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.2")
    shape, stride = shaped((9, 2, 16, 256))
    with pytest.raises(LayoutError, match="ROCm"):
        kernels.vllm_layout("FLASH_ATTN", "0.33.0", shape, stride, num_kv_heads=2, head_size=128)


@pytest.mark.parametrize(
    ("version", "name"),
    [("0.22.1", "kv_first"), ("0.23.0", "blocks_first"), ("0.25.1", "blocks_first"),
     ("0.26.0", "packed_kv"), ("0.29.0", "packed_kv"), ("0.33.0+cu130", "packed_kv"),
     ("0.33.1.dev4+g1234", "packed_kv")],
)  # fmt: skip
def test_flash_attn_layout_by_version(version: str, name: str) -> None:
    lay = next(x for x in kernels.VLLM_LAYOUTS if x.name == name)
    want = lay.expected(2, 128)
    shape, stride = shaped(tuple(9 if w is None else w for w in want))
    got = kernels.vllm_layout("FLASH_ATTN", version, shape, stride, num_kv_heads=2, head_size=128)
    assert got.name == name
