"""vLLM's own code lays out the cache and writes it; the kernels read it back exactly.

Needs vLLM (its own venv: `.venv-vllm/bin/python -m pytest tests/kernels/test_kernels_vllm_own.py
-m vllm`). vLLM builds each layer's `[B, H, N, C]` view (`compute_layout_strides`,
`KVCacheTensor`, `create_kv_cache_views`, for every `KVCacheLayout`); vLLM's
`FlashAttentionImpl.do_kv_cache_update` splits it into K and V and hands them to
`reshape_and_cache_flash` (a CUDA op, absent from the CPU build: replaced here by its
documented semantics, `key_cache[slot // block_size, slot % block_size] = key`); vLLM's
`CPUMLAImpl.do_kv_cache_update` writes MLA latents, unchanged. `kernels.vllm_engine_kv` gets
the backend's `get_name()` and `vllm.__version__`, and the gather runs on the CPU path and as
kv_copy.cu under the host shim.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvstore import kernels
from kvstore.kernels.plan import Direction, plan_launch, prepare
from tests.kernels.cases import assert_same_bytes, random_bytes_
from tests.kernels.shim import ShimRunner

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm", reason="needs vLLM: run in .venv-vllm")

from vllm.v1.attention.backend import AttentionType  # noqa: E402
from vllm.v1.attention.backends import flash_attn  # noqa: E402
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

L, PAGES = 2, 6
TABLE = [4, 1, 5, 0]  # the request's vLLM blocks, in token order: two kvstore blocks


def vllm_views(spec, layout: KVCacheLayout) -> list[torch.Tensor]:
    """What vLLM's worker allocates and hands `register_kv_caches` for one group of L layers."""
    layer_stride, block_stride, *_ = compute_layout_strides(spec, PAGES, L, layout)
    size = layer_stride * L if layout.is_layer_compact else block_stride * PAGES
    tensor = KVCacheTensor(
        size=size,
        layers=[f"model.layers.{i}.attn" for i in range(L)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    raw = torch.zeros(size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, PAGES, layout, tensor)


def fake_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, *args):
    block_size = key_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        key_cache[slot // block_size, slot % block_size] = key[token]
        value_cache[slot // block_size, slot % block_size] = value[token]


def slots(block_size: int) -> torch.Tensor:
    return torch.tensor(
        [page * block_size + off for page in TABLE for off in range(block_size)], dtype=torch.int64
    )


def check_gather(
    shim: ShimRunner, engine: kernels.EngineKV, cache: list[torch.Tensor], expected: torch.Tensor
) -> None:
    block_tokens = expected.shape[3]
    page_ids = torch.tensor(TABLE).reshape(2, -1)
    staging = torch.zeros(kernels.staging_shape(engine, 2, block_tokens), dtype=expected.dtype)
    kernels.gather(engine, staging, page_ids)
    want = expected.contiguous().view(torch.uint8).reshape(-1)
    assert torch.equal(staging.view(torch.uint8).reshape(-1), want)
    out = torch.zeros_like(staging)
    req = prepare(Direction.GATHER, engine, out, page_ids)
    result = shim.run(plan_launch(req, sm_count=132), [*cache, out], req.page_ids, req.slot_ids)
    assert_same_bytes(want, result.after[out.untyped_storage().data_ptr()], "gather kernel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_vllm_flash_attn_cache(
    shim: ShimRunner, monkeypatch: pytest.MonkeyPatch, layout: KVCacheLayout, dtype: torch.dtype
) -> None:
    heads, head_size, block_size = 3, 8, 4
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype
    )
    cache = vllm_views(spec, layout)
    monkeypatch.setattr(
        flash_attn, "reshape_and_cache_flash", fake_reshape_and_cache_flash, raising=False
    )
    impl = SimpleNamespace(
        attn_type=AttentionType.DECODER, head_size=head_size, kv_cache_dtype="auto"
    )
    layer = SimpleNamespace(_k_scale=torch.ones(1), _v_scale=torch.ones(1))
    gen = torch.Generator().manual_seed(layout.value[0] * 7 + layout.value[1])
    seq = len(TABLE) * block_size
    kv = random_bytes_(torch.empty(L, 2, seq, heads, head_size, dtype=dtype), gen)
    for i in range(L):
        flash_attn.FlashAttentionImpl.do_kv_cache_update(
            impl, layer, kv[i, 0], kv[i, 1], cache[i], slots(block_size)
        )
    name = flash_attn.FlashAttentionBackend.get_name()
    engine = kernels.vllm_engine_kv(
        name, vllm.__version__, cache, num_kv_heads=heads, head_size=head_size
    )
    expected = kv.reshape(L, 2, 2, 2 * block_size, heads, head_size).permute(2, 0, 1, 3, 4, 5)
    check_gather(shim, engine, cache, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_vllm_cpu_mla_cache(shim: ShimRunner, dtype: torch.dtype) -> None:
    rank, rope = 512, 64  # DeepSeek-V2: the only latent CPU_MLA's decode kernel takes
    block_size = CPUMLABackend.get_supported_kernel_block_sizes()[0]
    assert block_size == 16
    spec = MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=rank + rope, dtype=dtype
    )
    cache = vllm_views(spec, KVCacheLayout.LBNHC)  # vLLM's default order
    assert cache[0].shape == (PAGES, 1, block_size, rank + rope)
    gen = torch.Generator().manual_seed(16)
    seq = len(TABLE) * block_size
    latents = random_bytes_(torch.empty(L, seq, rank + rope, dtype=dtype), gen)
    for i in range(L):
        CPUMLAImpl.do_kv_cache_update(
            None,
            latents[i, :, :rank],
            latents[i, :, rank:].unsqueeze(1),  # k_pe arrives [tokens, 1, rope]
            cache[i],
            slots(block_size),
            "auto",
            torch.ones(1),
        )
    engine = kernels.vllm_engine_kv(
        CPUMLABackend.get_name(), vllm.__version__, cache, num_kv_heads=1, head_size=rank + rope
    )
    assert engine.layout is kernels.EngineLayout.MLA
    expected = latents.reshape(L, 1, 2, 2 * block_size, 1, rank + rope).permute(2, 0, 1, 3, 4, 5)
    check_gather(shim, engine, cache, expected)
