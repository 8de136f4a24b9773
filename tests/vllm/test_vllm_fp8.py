"""fp8 KV caches through the vLLM connector (`--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2`).

vLLM quantizes K and V to one byte per element with a per-tensor scale (the checkpoint's, 1.0
where it has none) and allocates the pages as uint8. The connector stores those bytes as they
are, under a layout that names the fp8 format: half the bytes of a bf16 cache per token, and
an fp8 engine's blocks are misses for an engine of another cache dtype. vLLM's CPU attention
lays an fp8 cache out as its "vec" one (K column-major, V row-major per page and head), one
byte per element; it needs AVX-512 or AMX for fp8 and refuses to start without.

    .venv-vllm/bin/python -m pytest tests/vllm/test_vllm_fp8.py -m vllm
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run `bash scripts/setup_vllm.sh`",
                allow_module_level=True)

from kvstore.client import KVClient
from kvstore.client.integrations.paged import PagedCache
from kvstore.client.integrations.vllm import ConnectorConfigError, _fp8_cache_dtype
from kvstore.layout import KVLayout
from kvstore.server.process import DaemonProcess
from tests.vllm.test_vllm_connector import (
    BLOCK,
    Engine,
    assert_prefix_cache_bit_identical,
    assert_same_generation,
    expected_cached,
    hit_blocks,
    prompts,
    small_daemon,
)
from tests.vllm.vllm_runner import make_model

pytestmark = [pytest.mark.vllm, pytest.mark.integration]
FP8_CPU = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
needs_fp8_cpu = pytest.mark.skipif(not FP8_CPU, reason="vLLM's CPU attention runs fp8 KV "
                                   "caches only on x86 with AVX-512 or AMX; this CPU has neither")
FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def cache_config(cache_dtype: str, skip: list[str] | None = None) -> SimpleNamespace:
    return SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=cache_dtype,
                                                        kv_cache_dtype_skip_layers=skip or []))


def test_per_tensor_fp8_is_stored_and_other_quantized_caches_are_refused() -> None:
    assert _fp8_cache_dtype(cache_config("auto")) is None
    assert _fp8_cache_dtype(cache_config("fp8")) == "float8_e4m3fn"
    assert _fp8_cache_dtype(cache_config("fp8_e4m3")) == "float8_e4m3fn"
    assert _fp8_cache_dtype(cache_config("fp8_e5m2")) == "float8_e5m2"
    for kind in ("int8_per_token_head", "fp8_per_token_head", "nvfp4", "fp8_ds_mla"):
        with pytest.raises(ConnectorConfigError, match=f"{kind!r} is not supported"):
            _fp8_cache_dtype(cache_config(kind))
    with pytest.raises(ConnectorConfigError, match="kv_cache_dtype_skip_layers"):
        _fp8_cache_dtype(cache_config("fp8", skip=["0"]))
    # The two fp8 formats and the model's own dtype are three namespaces: never one block.
    digests = {KVLayout(model="m", num_layers=2, num_kv_heads=2, head_dim=64, dtype=dtype,
                        block_tokens=BLOCK).digest()
               for dtype in ("float8_e4m3fn", "float8_e5m2", "float32")}
    assert len(digests) == 3


def test_an_fp8_cache_in_amx_tiles_is_refused_at_start(monkeypatch: pytest.MonkeyPatch,
                                                       ) -> None:
    """A bf16 model on a CPU with AMX: vLLM would pack the fp8 cache in AMX tiles, a layout
    not seen here (no AMX on this machine); the connector refuses it, naming the way out."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvstore.client.integrations.vllm import _check_cpu_isa

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.uint8)
    config = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="fp8"),
                             model_config=SimpleNamespace(dtype=torch.bfloat16))
    with pytest.raises(ConnectorConfigError, match=r"AMX tiles.*float32"):
        _check_cpu_isa(config, spec)
    config.model_config.dtype = torch.float32  # the way out: vLLM picks "vec"
    _check_cpu_isa(config, spec)


@needs_fp8_cpu
@pytest.mark.parametrize("cache_dtype", sorted(FORMATS))
def test_fp8_vec_layout_is_vllms_own(cache_dtype: str) -> None:
    """vLLM's `cpu_attn_reshape_and_cache` quantizes and writes K and V; the connector's view of
    those pages gives back every token's K and V in place, and writes the same bytes back."""
    from vllm import _custom_ops as ops

    fp8 = FORMATS[cache_dtype]
    pages, heads, page, dim = 3, 2, 32, 64
    cache = torch.zeros(pages, heads, page, 2 * dim, dtype=torch.uint8)
    key_cache, value_cache = cache.view(pages, heads, 2 * page, dim).chunk(2, dim=2)
    g = torch.Generator().manual_seed(7)
    kv = torch.randn(1, 2, pages * page, heads, dim, generator=g)
    order = [2, 0, 1]
    slots = torch.tensor([p * page + t for p in order for t in range(page)])
    ops.cpu_attn_reshape_and_cache(kv[0, 0].contiguous(), kv[0, 1].contiguous(), key_cache,
                                   value_cache, slots, "vec", k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype=cache_dtype)
    paged = PagedCache.vllm_cpu([cache.view(fp8)], "vec")
    got = paged.gather(order)
    assert got.dtype == fp8
    # Each element's code within one step of torch's own rounding of the same value (vLLM
    # rounds its own way); a token or dim out of place is off by far more.
    codes = got.view(torch.uint8).int() - kv.to(fp8).view(torch.uint8).int()
    assert codes.abs().max().item() <= 1, codes.abs().max()
    ours = torch.zeros_like(cache)
    PagedCache.vllm_cpu([ours.view(fp8)], "vec").scatter(got, order, 0)
    assert torch.equal(ours, cache)


@needs_fp8_cpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("cache_dtype", sorted(FORMATS))
def test_fp8_engine_loads_its_prefix_bit_for_bit(
        tmp_path_factory: pytest.TempPathFactory, cache_dtype: str) -> None:
    """An engine with an fp8 cache publishes its prompts' blocks (one byte per element); with
    vLLM's prefix cache reset, each prompt loads them from kvstore and gives the cold run's
    tokens, and exactly what vLLM's own prefix cache gives over the same computed tokens. The
    blocks are the fp8 format's only: the model's float32 layout finds none of them."""
    model = make_model(tmp_path_factory.mktemp(f"vllm-{cache_dtype}-model") / "tiny-llama")
    daemon: DaemonProcess = next(small_daemon(tmp_path_factory, f"vllm-{cache_dtype}"))
    try:
        batch = prompts(seed=61)
        engine = Engine(model, daemon.target, block_size=BLOCK,
                        llm_kwargs={"kv_cache_dtype": cache_dtype})
        try:
            assert f"ISA vec, {FORMATS[cache_dtype]}" in engine.tail(200), engine.tail()
            # One prompt per run: reruns of a batch of two differed among themselves in the
            # last bits on a loaded machine (up to ~5e-6 in log-probabilities), vLLM's own
            # prefix-cache runs as well as kvstore's loads (tests/vllm/rerun_determinism.py).
            for prompt in batch:
                cold = engine.generate([prompt])
                assert cold["cached"] == [0]
                engine.reset()
                served = hit_blocks(daemon)
                warm = engine.generate([prompt])
                assert warm["cached"] == [expected_cached(warm["prompt_tokens"][0])], \
                    engine.tail()
                assert hit_blocks(daemon) > served
                assert_same_generation(warm, cold)
                assert_prefix_cache_bit_identical(warm, engine.generate([prompt]))
        finally:
            engine.close()
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(model)(batch[0])["input_ids"]
        stored = {}
        for dtype in (FORMATS[cache_dtype], torch.float32):
            layout = KVLayout(model=str(model), num_layers=2, num_kv_heads=2, head_dim=64,
                              dtype=dtype, block_tokens=BLOCK)
            with KVClient(daemon.target, layout) as client:
                stored[dtype] = client.lookup(ids)
        assert stored == {FORMATS[cache_dtype]: len(ids) // BLOCK * BLOCK, torch.float32: 0}
    finally:
        daemon.kill()  # killed however the test ends (a failed assertion left daemons behind)
