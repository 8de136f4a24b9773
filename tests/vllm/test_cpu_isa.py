"""vLLM's CPU attention ISAs: the connector decodes "vec"/"vec16" and "amx" caches, and the
latent cache of AMX_MLA.

vLLM picks "amx" (bf16 packed in AMX tiles) for bf16 at block sizes that are multiples of 32 on
a CPU with AMX, and "vec"/"vec16" otherwise; its "auto" dtype runs float32 models in bf16 there
too. The layout is checked against vLLM's own `cpu_attn_reshape_and_cache`, and a bf16 engine
loads a prefix from kvstore bit for bit as its own prefix cache serves it. Both need a CPU with
AMX (skipped elsewhere; tests/unit/test_paged.py checks the same layout without vLLM). MLA
models get AMX_MLA there (bf16 weights, blocks of a multiple of 32, vLLM's prefix cache on):
its latent rows are checked against `amx_mla_concat_and_cache`, and a bf16 DeepSeek-V2-shaped
engine loads bit for bit too.

    .venv-vllm/bin/python -m pytest tests/vllm/test_cpu_isa.py -m vllm
"""

from __future__ import annotations

import contextlib
import importlib.util
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run `bash scripts/setup_vllm.sh`",
                allow_module_level=True)

from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvstore.client.integrations.paged import PagedCache
from kvstore.client.integrations.vllm import ConnectorConfigError, _check_cpu_isa
from kvstore.server.process import DaemonProcess
from tests.vllm.models import MLA_LATENT, make_mla_model
from tests.vllm.test_vllm_connector import (
    BLOCK,
    Engine,
    assert_prefix_cache_bit_identical,
    expected_cached,
    hit_blocks,
    prompts,
    small_daemon,
)
from tests.vllm.vllm_runner import corpus_ids, make_model

pytestmark = [pytest.mark.vllm, pytest.mark.integration]


def config(dtype: torch.dtype, cache_dtype: str = "auto") -> SimpleNamespace:
    """What `_check_cpu_isa` reads of a VllmConfig: the model's dtype and the cache's."""
    return SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=cache_dtype),
                           model_config=SimpleNamespace(dtype=dtype))


AMX = torch.cpu._is_amx_tile_supported()
needs_amx = pytest.mark.skipif(not AMX, reason="this CPU has no AMX: vLLM never picks 'amx'")


def spec(dtype: torch.dtype, block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=dtype)


def test_every_isa_vllm_picks_here_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    if not AMX:  # what vLLM would pick on a CPU with AMX (the one thing not caused here)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    for dtype, block in ((torch.bfloat16, 128), (torch.float32, 128), (torch.bfloat16, 16)):
        _check_cpu_isa(config(dtype), spec(dtype, block))  # amx, vec, vec16


def test_an_isa_it_does_not_decode_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.v1.attention.backends.cpu_attn as cpu_attn

    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *a: "neon")
    with pytest.raises(ConnectorConfigError, match="'neon'"):
        _check_cpu_isa(config(torch.bfloat16), spec(torch.bfloat16, 128))


@needs_amx
@pytest.mark.parametrize(("page", "dim"), [(32, 64), (128, 128), (64, 96)])
def test_amx_layout_is_vllms_own(page: int, dim: int) -> None:
    from vllm import _custom_ops as ops

    pages, heads = 3, 2
    cache = torch.zeros(pages, heads, page, 2 * dim, dtype=torch.bfloat16)
    key_cache, value_cache = cache.view(pages, heads, 2 * page, dim).chunk(2, dim=2)
    g = torch.Generator().manual_seed(page + dim)
    kv = torch.randn(1, 2, pages * page, heads, dim, generator=g).to(torch.bfloat16)
    order = [2, 0, 1]  # the request's pages
    slots = torch.tensor([p * page + t for p in order for t in range(page)])
    ops.cpu_attn_reshape_and_cache(kv[0, 0], kv[0, 1], key_cache, value_cache, slots, "amx",
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    paged = PagedCache.vllm_cpu([cache], "amx")
    assert torch.equal(paged.gather(order), kv)
    ours = torch.zeros_like(cache)
    PagedCache.vllm_cpu([ours], "amx").scatter(kv, order, 0)
    assert torch.equal(ours.view(torch.int16), cache.view(torch.int16))


@needs_amx
@pytest.mark.timeout(600)
def test_bf16_engine_loads_its_prefix_bit_for_bit(tmp_path_factory: pytest.TempPathFactory,
                                                   ) -> None:
    """A bf16 engine at 32-token blocks (vLLM's "amx" ISA): its second run of a prompt loads
    the prompt's blocks from kvstore and gives exactly what vLLM's own prefix cache gives."""
    model = make_model(tmp_path_factory.mktemp("vllm-amx-model") / "tiny-llama")
    daemon: DaemonProcess = next(small_daemon(tmp_path_factory, "vllm-amx"))
    with contextlib.ExitStack() as stack:  # the daemon killed whatever fails, close included
        stack.callback(daemon.kill)
        engine = Engine(model, daemon.target, dtype="bfloat16", block_size=BLOCK)
        stack.callback(engine.close)
        assert "ISA amx, torch.bfloat16" in engine.tail(200), engine.tail()
        for prompt in prompts(seed=31):
            cold = engine.generate([prompt])
            assert cold["cached"] == [0]
            engine.reset()
            served = hit_blocks(daemon)
            warm = engine.generate([prompt])
            assert warm["cached"] == [expected_cached(warm["prompt_tokens"][0])], engine.tail()
            assert hit_blocks(daemon) > served
            assert warm["tokens"] == cold["tokens"]
            assert_prefix_cache_bit_identical(warm, engine.generate([prompt]))


@needs_amx
def test_amx_mla_latent_rows_are_vllms_own() -> None:
    """AMX_MLA's writer (`amx_mla_concat_and_cache`) puts token t of page p in the plain
    latent row `p * block_size + t` ([kv_c_normed | k_pe]): a save reads what it wrote, and a
    load writes the bytes it would have written into the pages it names, no other. (A load
    ending inside its last page writes that page whole from its stored block, as every kernels
    copy does: vLLM then computes the last token into its slot.)"""
    import vllm
    from vllm import _custom_ops as ops

    from kvstore.kernels import vllm_engine_kv

    rank, page, pages, layers = 512, 32, 5, 2

    def cache_of(caches: list[torch.Tensor]) -> PagedCache:
        return PagedCache.kernels(vllm_engine_kv("AMX_MLA", vllm.__version__, caches,
                                                 num_kv_heads=1, head_size=MLA_LATENT))

    caches = [torch.full((pages, 1, page, MLA_LATENT), -7.0, dtype=torch.bfloat16)
              for _ in range(layers)]
    order = [3, 0, 4]
    n = len(order) * page
    slots = torch.tensor([order[t // page] * page + t % page for t in range(n)])
    g = torch.Generator().manual_seed(5)
    latent = torch.randn(layers, n, MLA_LATENT, generator=g).to(torch.bfloat16)
    for layer in range(layers):
        ops.amx_mla_concat_and_cache(latent[layer, :, :rank].contiguous(),  # a 3-D cache
                                     latent[layer, :, rank:].contiguous(),
                                     caches[layer].squeeze(1), slots)
    assert torch.equal(cache_of(caches).gather(order)[:, 0, :, 0], latent)
    ours = [torch.full_like(c, -7.0) for c in caches]
    cache_of(ours).scatter_views([(latent[:, None, :, None], 0, order, n - 5)])
    for mine, theirs in zip(ours, caches, strict=True):
        assert torch.equal(mine[order].view(torch.int16), theirs[order].view(torch.int16))
        assert bool((mine[[1, 2]] == -7.0).all())


@needs_amx
@pytest.mark.timeout(900)
def test_bf16_mla_engine_on_amx_mla_loads_its_prefix_bit_for_bit(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A bf16 DeepSeek-V2-shaped engine with vLLM's default MLA backend here (AMX_MLA, blocks
    of 32): a prompt's second run loads its blocks from kvstore and gives exactly what vLLM's
    own prefix cache gives. (Not what the cold run gave: in bf16 a prefill over a cached prefix
    rounds otherwise than one over the whole prompt, and 16 greedy tokens of a random model
    then part after a few steps, for vLLM's own prefix cache as for kvstore.)"""
    model = make_mla_model(tmp_path_factory.mktemp("vllm-amx-mla") / "tiny-deepseek-v2")
    daemon: DaemonProcess = next(small_daemon(tmp_path_factory, "vllm-amx-mla"))
    with contextlib.ExitStack() as stack:  # the daemon killed whatever fails, close included
        stack.callback(daemon.kill)
        engine = Engine(model, daemon.target, dtype="bfloat16", block_size=BLOCK)
        stack.callback(engine.close)
        assert "Using AMX_MLA backend" in engine.tail(400), engine.tail()
        for seed, n in ((51, 6 * BLOCK + 9), (52, 5 * BLOCK)):
            prompt = corpus_ids(model, seed, n, sentences=30)
            cold = engine.generate([prompt])
            assert cold["cached"] == [0]
            engine.reset()
            served = hit_blocks(daemon)
            warm = engine.generate([prompt])
            assert warm["cached"] == [expected_cached(n)], engine.tail()
            assert hit_blocks(daemon) > served
            best = sorted(cold["top"][0][0].values(), reverse=True)
            if best[0] - best[1] > 0.05:  # a nearer tie may round either way in bf16
                assert warm["tokens"][0][0] == cold["tokens"][0][0]
            assert_prefix_cache_bit_identical(warm, engine.generate([prompt]))
