"""transformers architectures beyond Llama through `CachedPrefill`: sliding-window, hybrid and
chunked attention give the logits and tokens of the model's own computation; models whose
cache kvstore cannot hold are refused when the engine is made, with the reason."""

from __future__ import annotations

import logging
import re
import types
from collections.abc import Callable

import pytest
import torch

from kvstore import InvalidArgumentError
from kvstore.client import KVClient
from kvstore.client.integrations.hf import (
    CachedPrefill,
    LayerShape,
    layer_shapes,
    layout_for_model,
    own_windows,
    run_model,
    text_config,
    unsupported_reason,
    with_own_windows,
)
from kvstore.client.integrations.hf_layers import cached_layers, layer_map

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytestmark = pytest.mark.integration

T = transformers
WINDOW = 48  # tokens a sliding-window or chunked layer attends to: well under the prompt
PROMPT = 200  # 6 blocks of 32 tokens cached, 8 tokens computed
COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              initializer_range=0.3)  # varied greedy outputs (a random model's default repeats)

# MLA: a latent of 32 dims and a rotary key of 8 per token (DeepSeek's are 512 and 64).
MLA = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
           qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=1024,
           initializer_range=0.3)
MOE = dict(moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
           num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1)

# name -> (model factory, the config field that sets its window: None for none)
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], str | None]] = {
    "mistral-sliding": (lambda: T.MistralForCausalLM(T.MistralConfig(
        sliding_window=WINDOW, **COMMON)), "sliding_window"),
    "gemma2-sliding-and-full": (lambda: T.Gemma2ForCausalLM(T.Gemma2Config(
        head_dim=16, sliding_window=WINDOW, tie_word_embeddings=False, **COMMON)),
        "sliding_window"),
    "gemma3-sliding-and-full": (lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(
        # Untied: Gemma scales its embeddings up, and with the head tied to them a random
        # model predicts its last input token, over and over.
        head_dim=16, sliding_window=WINDOW, sliding_window_pattern=2,
        tie_word_embeddings=False, **COMMON)),
        "sliding_window"),
    "gemma3-multimodal-text-only": (lambda: T.Gemma3ForConditionalGeneration(T.Gemma3Config(
        text_config=T.Gemma3TextConfig(head_dim=16, sliding_window=WINDOW,
                                       tie_word_embeddings=False, **COMMON),
        vision_config=T.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=1, num_attention_heads=2,
                                           image_size=28, patch_size=14),
        tie_word_embeddings=False, mm_tokens_per_image=4, image_token_index=509,
        boi_token_index=510, eoi_token_index=511)), "sliding_window"),
    "gemma4-one-head-dim": (lambda: T.Gemma4ForCausalLM(T.Gemma4TextConfig(
        head_dim=16, global_head_dim=16, sliding_window=WINDOW, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention"] * 2, **COMMON)), "sliding_window"),
    # Gemma 4: full layers of head dim 512 beside sliding ones of 256 by default (here 32 and
    # 16); full layers may have their own number of KV heads and take their keys from the
    # value projection (attention_k_eq_v), and the last layers may read earlier layers' K/V
    # (num_kv_shared_layers).
    "gemma4-head-dims-per-layer": (lambda: T.Gemma4ForCausalLM(T.Gemma4TextConfig(
        head_dim=16, global_head_dim=32, sliding_window=WINDOW, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention"] * 2, **COMMON)), "sliding_window"),
    "gemma4-k-eq-v-fewer-full-heads": (lambda: T.Gemma4ForCausalLM(T.Gemma4TextConfig(
        head_dim=16, global_head_dim=32, attention_k_eq_v=True, num_global_key_value_heads=1,
        sliding_window=WINDOW, tie_word_embeddings=False,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        **{**COMMON, "num_hidden_layers": 6})), "sliding_window"),
    "gemma4-kv-sharing": (lambda: T.Gemma4ForCausalLM(T.Gemma4TextConfig(
        head_dim=16, global_head_dim=32, sliding_window=WINDOW, tie_word_embeddings=False,
        num_kv_shared_layers=2, vocab_size_per_layer_input=512, hidden_size_per_layer_input=8,
        layer_types=["sliding_attention", "full_attention"] * 3,
        **{**COMMON, "num_hidden_layers": 6})), "sliding_window"),
    "gemma3n-kv-sharing": (lambda: T.Gemma3nForCausalLM(T.Gemma3nTextConfig(
        vocab_size=512, vocab_size_per_layer_input=512, hidden_size=64,
        hidden_size_per_layer_input=8, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
        num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 3,
        laurel_rank=4, altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 6,
        max_position_embeddings=1024, initializer_range=0.3)), "sliding_window"),
    "llama4-chunked": (lambda: T.Llama4ForCausalLM(T.Llama4TextConfig(
        head_dim=16, attention_chunk_size=WINDOW, num_local_experts=2,
        intermediate_size_mlp=128, **COMMON)), "attention_chunk_size"),
    "gpt-oss-sliding-sinks-moe": (lambda: T.GptOssForCausalLM(T.GptOssConfig(
        head_dim=16, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
        **COMMON)), "sliding_window"),
    "qwen3": (lambda: T.Qwen3ForCausalLM(T.Qwen3Config(head_dim=32, **COMMON)), None),
    "deepseek-v2-mla": (lambda: T.DeepseekV2ForCausalLM(T.DeepseekV2Config(**MLA, **MOE)),
                        None),
    "deepseek-v3-mla": (lambda: T.DeepseekV3ForCausalLM(T.DeepseekV3Config(  # Kimi K2's too
        **{**MLA, "q_lora_rank": 16}, **MOE)), None),
    "minicpm3-mla": (lambda: T.MiniCPM3ForCausalLM(T.MiniCPM3Config(**MLA)), None),
    "phi3": (lambda: T.Phi3ForCausalLM(T.Phi3Config(pad_token_id=0, **COMMON)), None),
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(
        vocab_size=512, n_embd=64, n_layer=4, n_head=4, n_positions=1024,
        initializer_range=0.3)), None),
}


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]().eval()


def kinds(cache) -> list[tuple[str, int]]:
    """Each layer of a cache: its class and the tokens it holds. (A loaded full-attention
    layer is a `DynamicLayer` that appends in place, `_RoomyLayer`.)"""
    return [("DynamicLayer" if type(layer).__name__ == "_RoomyLayer" else type(layer).__name__,
             layer.keys.shape[-2] if layer.keys is not None else 0) for layer in cache.layers]


@torch.inference_mode()
def own_generate(model: torch.nn.Module, ids: torch.Tensor, steps: int,
                 ) -> tuple[torch.Tensor, list[int], list[tuple[str, int]]]:
    """Without kvstore, the model's own way (its default cache: sliding-window layers keep
    only their window): the first logits, `steps` greedy tokens, and its cache's layers
    after them."""
    out, cache = run_model(model, ids, last_logits_only=True)
    logits = out.logits[0, -1].float()
    first, tokens = logits, []
    for _ in range(steps):
        tokens.append(int(torch.argmax(logits)))
        out, cache = run_model(model, torch.tensor([[tokens[-1]]]), cache)
        logits = out.logits[0, -1].float()
    assert len(set(tokens)) > 1, f"degenerate test model: {tokens}"
    return first, tokens, kinds(cache)


@torch.inference_mode()
def split_logits(model: torch.nn.Module, ids: torch.Tensor, cached: int) -> torch.Tensor:
    """Without kvstore: the K/V of a pass over the whole prompt (the pass that published
    them; a cache of plain layers keeps every token), cut to its first `cached` tokens, its
    sliding-window layers then holding their window only, as the model's own do, then the
    rest of the prompt over them: what a cached prefill computes."""
    cache = run_model(model, ids, T.DynamicCache())[1]
    cache.crop(cached - ids.shape[1])  # a negative count: drop that many tokens at the end
    cache = with_own_windows(cache, own_windows(model))
    return run_model(model, ids[:, cached:], cache, last_logits_only=True)[0].logits[0, -1].float()


@pytest.mark.parametrize("name", list(MODELS))
def test_architecture_matches_its_own_computation(daemon, name):
    model = build(name)
    ids = torch.randint(0, 500, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    want_logits, want_tokens, want_layers = own_generate(model, ids, 16)
    layout = layout_for_model(model, block_tokens=32, model_id=name)
    with KVClient(daemon.target, layout) as c:
        engine = CachedPrefill(model, c)
        cold_tokens, cold = engine.generate(ids, 16)
        warm_tokens, warm = engine.generate(ids, 16)
    assert (cold.cached_tokens, cold.published_tokens) == (0, 192)
    assert (warm.cached_tokens, warm.computed_tokens) == (192, 8)
    assert (cold.logits - want_logits).abs().max().item() == 0.0
    # Bit for bit what the model computes over the same split; within float noise of the
    # whole prompt at once (8 query rows against 200 take other kernel paths).
    assert (warm.logits - split_logits(model, ids, 192)).abs().max().item() == 0.0
    assert (warm.logits - want_logits).abs().max().item() < 1e-4
    assert cold_tokens == want_tokens
    assert warm_tokens == want_tokens
    # Once published, a sliding-window layer keeps its window only, as the model's own cache
    # does: decoding attends to and holds what the model's own would.
    assert kinds(cold.cache) == want_layers
    assert kinds(warm.cache) == want_layers


@pytest.mark.parametrize("name", [n for n, (_, field) in MODELS.items() if field])
def test_the_window_matters_to_these_prompts(name):
    """The check above could not fail on a window the prompt never reaches: with it widened
    past the prompt, the same weights give other logits."""
    model = build(name)
    ids = torch.randint(0, 500, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        windowed = model(ids).logits[0, -1].float()
        setattr(text_config(model.config), MODELS[name][1] or "", 10 * PROMPT)
        wide = model(ids).logits[0, -1].float()
    assert (windowed - wide).abs().max().item() > 1e-2


REFUSED: dict[str, tuple[Callable[[], torch.nn.Module], str]] = {
    "mamba": (lambda: T.MambaForCausalLM(T.MambaConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2)), "no attention layers"),
    "jamba-linear-attention": (lambda: T.JambaForCausalLM(T.JambaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
        attn_layer_offset=1, expert_layer_period=4, num_experts=2, use_mamba_kernels=False)),
        "layers of kind linear_attention"),
    "deepseek-v32-sparse-indexer": (lambda: T.DeepseekV32ForCausalLM(T.DeepseekV32Config(
        **{**MLA, "q_lora_rank": 16}, **MOE, index_n_heads=2, index_head_dim=16,
        index_topk=8)), "indexer"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_models_whose_cache_kvstore_cannot_hold_are_refused(daemon, name):
    factory, reason = REFUSED[name]
    torch.manual_seed(0)
    model = factory().eval()
    with pytest.raises(InvalidArgumentError, match=reason):
        layout_for_model(model)
    some_layout = layout_for_model(build("qwen3"), block_tokens=32)
    with KVClient(daemon.target, some_layout) as c, \
            pytest.raises(InvalidArgumentError, match=reason):
        CachedPrefill(model, c)


@pytest.mark.parametrize(("name", "misdescribe", "reason"), [
    ("qwen3", lambda m: setattr(m.config, "num_key_value_heads", 4),
     "layer 0's keys are (1, 2, 200, 32) torch.float32, the layout wants (1, 4, >= 192, 32)"),
    # A Gemma 4 whose config says its full layers have heads of 16 dims, not 32: the layout
    # follows the config (every layer one slot of 2 x 16), the cache's layer 1 does not.
    ("gemma4-head-dims-per-layer", lambda m: setattr(m, "config", MODELS["gemma4-one-head-dim"]
                                                     [0]().config),
     "layer 1's keys are (1, 2, 200, 32) torch.float32, the layout wants (1, 2, >= 192, 16)"),
])
def test_a_config_that_misdescribes_its_cache_publishes_nothing(daemon, caplog, name,
                                                                 misdescribe, reason):
    """A config claiming 4 KV heads on a model built with 2 (or heads of 16 dims on layers
    built with 32) passes the layout check; its caches do not match that layout, so nothing
    is published (logged once), and the prefill still returns the model's own logits."""
    model = build(name)
    misdescribe(model)
    layout = layout_for_model(model, block_tokens=32, model_id=name)
    ids = torch.randint(0, 512, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = run_model(model, ids, last_logits_only=True)[0].logits[0, -1].float()
    with KVClient(daemon.target, layout) as c, caplog.at_level(logging.ERROR, "kvstore.hf"):
        engine = CachedPrefill(model, c)
        results = [engine.prefill(ids), engine.prefill(ids)]
        assert c.lookup(ids[0]) == 0
    assert [r.published_tokens for r in results] == [0, 0]
    assert all((r.logits - want).abs().max().item() == 0.0 for r in results)
    logged = [r.getMessage() for r in caplog.records if "not publishing" in r.getMessage()]
    assert len(logged) == 1 and reason in logged[0], logged


@pytest.mark.parametrize("name", ["mistral-sliding", "gemma3-sliding-and-full"])
def test_window_layers_load_their_window_and_publish_what_follows(daemon, monkeypatch, name):
    """A warm prefill copies, for a sliding-window layer, only the blocks its window reaches
    (the suffix attends to nothing older), every block for a full-attention layer; a later
    prompt that goes on past the window publishes its new blocks with their real K/V in
    every layer, the window layers' included."""
    from kvstore.client.integrations import hf

    model = build(name)
    windows = own_windows(model)
    assert windows is not None and any(w is None for w in windows) == ("gemma3" in name)
    a = torch.randint(0, 500, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    b = torch.cat([a[:, :192], torch.randint(0, 500, (1, 150),
                                             generator=torch.Generator().manual_seed(4))], 1)
    copied: dict[int, set[int]] = {}
    real_copy = hf._copy_in

    def counting(keys, values, layer, span, *args, **kw):
        copied.setdefault(layer, set()).add(span.start // 32)
        real_copy(keys, values, layer, span, *args, **kw)

    monkeypatch.setattr(hf, "_copy_in", counting)
    layout = layout_for_model(model, block_tokens=32, model_id=name)
    with KVClient(daemon.target, layout) as c:
        engine = CachedPrefill(model, c)
        engine.prefill(a)
        copied.clear()
        warm = engine.prefill(b)  # 192 cached, 150 computed: 320 now in whole blocks
        assert (warm.cached_tokens, warm.published_tokens) == (192, 320)
        # The window's 47 tokens before token 192 lie in blocks 4 and 5.
        assert copied == {layer: {4, 5} if w else set(range(6))
                          for layer, w in enumerate(windows)}
        n, kv = c.fetch(b[0, :320])
    assert n == 320
    own = run_model(model, b, T.DynamicCache())[1]  # every layer's K/V of the whole prompt
    for layer, cached in enumerate(own.layers):
        for i, t in enumerate((cached.keys, cached.values)):
            want = t[0, :, :320].transpose(0, 1)  # [tokens, heads, dim], as stored
            # The first 192 tokens: the bytes the first prompt's pass published; the next
            # 128: the suffix forward's (another batch shape: float noise only).
            assert (kv[layer, i] - want).abs().max().item() < 1e-4, (layer, i)


@torch.inference_mode()
def test_mla_blocks_hold_the_latent_then_the_rotary_key(daemon):
    """An MLA model's block holds each token's compressed latent (transformers' keys) and then
    its rotary key (its values) in one vector of kv_lora_rank + qk_rope_head_dim dims: the
    layout vLLM's MLA cache and kvstore's vLLM connector use."""
    model = build("deepseek-v3-mla")
    layout = layout_for_model(model, block_tokens=32, model_id="mla")
    assert (layout.kv_kind, layout.num_kv_heads, layout.head_dim) == ("mla", 1, 40)
    ids = torch.randint(0, 500, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    with KVClient(daemon.target, layout) as c:
        assert CachedPrefill(model, c).prefill(ids).published_tokens == 192
        n, kv = c.fetch(ids[0, :192])
    assert n == 192 and tuple(kv.shape) == (3, 1, 192, 1, 40)
    own = run_model(model, ids, T.DynamicCache())[1]
    for layer, cached in enumerate(own.layers):
        assert tuple(cached.keys.shape[-1:]) + tuple(cached.values.shape[-1:]) == (32, 8)
        assert torch.equal(kv[layer, 0, :, 0, :32], cached.keys[0, 0, :192]), layer
        assert torch.equal(kv[layer, 0, :, 0, 32:], cached.values[0, 0, :192]), layer


@torch.inference_mode()
def test_mla_loads_into_reserved_buffers_and_by_the_whole_block_path(daemon):
    """The other ways an MLA prefix is loaded give the same logits: into memory reserved up
    front (`reserve_tokens`), and by `fetch_cache` (the path taken after a partial load)."""
    from kvstore.client.integrations.hf import fetch_cache

    model = build("minicpm3-mla")
    layout = layout_for_model(model, block_tokens=32, model_id="mla-reserved")
    ids = torch.randint(0, 500, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    want = split_logits(model, ids, 192)
    with KVClient(daemon.target, layout) as c:
        engine = CachedPrefill(model, c, reserve_tokens=256)
        engine.prefill(ids)
        warm = engine.prefill(ids)
        assert warm.cached_tokens == 192
        keys = warm.cache.layers[0].keys
        assert keys.untyped_storage().data_ptr() \
            == engine.buffers._memory.untyped_storage().data_ptr()  # the reserved memory
        assert (warm.logits - want).abs().max().item() == 0.0
        del warm, keys
        cached, cache = fetch_cache(c, ids[0, :199], shapes=layer_shapes(model.config))
        assert cached == 192
        out, _ = run_model(model, ids[:, 192:], cache, last_logits_only=True)
        assert (out.logits[0, -1].float() - want).abs().max().item() == 0.0
        with pytest.raises(InvalidArgumentError, match="needs the model's layer shapes"):
            fetch_cache(c, ids[0, :199])


def test_layer_shapes_that_do_not_fit_the_layout_are_refused():
    from kvstore.layout import KVLayout

    mla = KVLayout("m", 2, 1, 40, kv_kind="mla")
    latent = LayerShape(1, 32, 8, latent=True)
    assert layer_map(mla, (latent,) * 2).shapes == (latent,) * 2
    assert layer_map(KVLayout("m", 2, 4, 16)).shapes == (LayerShape(4, 16, 16),) * 2
    slot = KVLayout("m", 3, 4, 16)  # 64 values per token for K, and as many for V
    assert layer_map(slot, (LayerShape(2, 64, 64), LayerShape(1, 64, 64))).pieces[0][1].slot \
        == 1  # the first layer spans slots 0 and 1
    for layout, bad, match in [
            (mla, (latent,), "1 layers of these shapes fill 1 of the layout's layers, not its 2"),
            (mla, (LayerShape(1, 30, 8, latent=True),) * 2, "does not fit"),
            (mla, (LayerShape(1, 32, 8),) * 2, "separate K and V in a layout of kv_kind 'mla'"),
            (slot, (LayerShape(1, 8, 8, latent=True),) * 3, "an MLA latent in a layout"),
            (slot, (LayerShape(1, 48, 48),) * 3, "made of whole slots"),  # 48 of 64
            (slot, (LayerShape(4, 16, 8),) * 3, "must be equal"),
            (slot, (LayerShape(3, 64, 64),) * 3, "fill 9 of the layout's layers, not its 3")]:
        with pytest.raises(InvalidArgumentError, match=re.escape(match)):
            layer_map(layout, bad)
    with pytest.raises(InvalidArgumentError, match="needs the model's layer shapes"):
        layer_map(mla, None)


def test_gemma4_defaults_span_two_slots_on_full_layers():
    """`Gemma4TextConfig()` as transformers ships it (30 layers, 4 KV heads of 256 on the
    sliding ones, of 512 on every sixth): a full layer spans two slots of 4 x 256, so the
    layout has 35 layers and no padding, where padding each layer to the largest would
    leave 5/12 of a block zero (hf_layers' docstring)."""
    model = types.SimpleNamespace(dtype=torch.bfloat16, config=T.Gemma4TextConfig())
    layout = layout_for_model(model, model_id="gemma4")
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (35, 4, 256)
    shapes = layer_shapes(model.config)
    padded = len(shapes) * max(s.heads * s.key_dim for s in shapes)
    assert 1 - sum(s.heads * s.key_dim for s in shapes) / padded == pytest.approx(5 / 12)


@pytest.mark.parametrize(("shapes", "slot"), [
    ((LayerShape(4, 16, 16), LayerShape(2, 64, 64)), (4, 16)),  # 2 slots of 1 head, 1 of 4
    ((LayerShape(1, 64, 64), LayerShape(2, 16, 16)), (2, 16)),  # a head cut in 2; 1 of 2
    # rows of 48 and 32: 16 divides both but would straddle two heads of 24; 8 cuts inside
    ((LayerShape(2, 24, 24), LayerShape(1, 32, 32)), (1, 8)),
])
def test_layers_of_other_shapes_fill_whole_slots_and_come_back_exactly(shapes, slot):
    """Layers of different shapes in one layout: each K (and V) row of a token is cut into
    slots of the largest size that divides every layer's row between heads or inside a head,
    so no value of a block is padding, and every value comes back where it was."""
    from kvstore.client.integrations.hf_layers import copy_from_block, copy_to_block

    model = types.SimpleNamespace(dtype=torch.float32, config=types.SimpleNamespace(
        model_type="mixed", num_attention_heads=8, num_hidden_layers=len(shapes),
        per_layer_config=[types.SimpleNamespace(num_attention_heads=8,
                                                num_key_value_heads=s.heads,
                                                head_dim=s.key_dim) for s in shapes]))
    layout = layout_for_model(model, block_tokens=4)
    assert (layout.num_kv_heads, layout.head_dim) == slot
    size = slot[0] * slot[1]
    assert layout.num_layers == sum(s.heads * s.key_dim for s in shapes) // size
    lmap = layer_map(layout, layer_shapes(model.config))
    gen = torch.Generator().manual_seed(0)
    cache = [(torch.randn(1, s.heads, 6, s.key_dim, generator=gen),
              torch.randn(1, s.heads, 6, s.value_dim, generator=gen)) for s in shapes]
    block = torch.full(layout.block_shape, float("nan"))
    for layer, (k, v) in enumerate(cache):
        copy_to_block(block, lmap, layer, k, v, slice(1, 5))
    assert not block.isnan().any()  # every value of the block is some layer's
    for layer, (k, v) in enumerate(cache):  # a K row of a token: its slots' rows in order
        held = block[lmap.slots(layer)].reshape(-1, 2, 4, size)
        assert torch.equal(torch.cat(list(held[:, 0]), dim=-1),
                           k[0, :, 1:5].transpose(0, 1).reshape(4, -1))
        assert torch.equal(torch.cat(list(held[:, 1]), dim=-1),
                           v[0, :, 1:5].transpose(0, 1).reshape(4, -1))
        got_k, got_v = torch.zeros_like(k), torch.zeros_like(v)
        copy_from_block(block, lmap, layer, got_k, got_v, slice(1, 5))
        assert torch.equal(got_k[:, :, 1:5], k[:, :, 1:5])
        assert torch.equal(got_v[:, :, 1:5], v[:, :, 1:5])
        assert not got_k[:, :, [0, 5]].any()


def test_sharing_anywhere_but_the_last_layers_is_refused():
    """Layers that read K/V come after every layer that caches its own (transformers' own
    models); a config saying otherwise is refused rather than stored misaligned."""
    config = types.SimpleNamespace(model_type="odd", num_attention_heads=4,
                                   num_hidden_layers=3, kv_sharing_modes=[None, "reuse", None])
    assert "other than its last ones" in unsupported_reason(config)
    config.kv_sharing_modes = [None, "store", "reuse"]
    assert unsupported_reason(config) is None and cached_layers(config) == 2


@torch.inference_mode()
def test_a_model_of_two_head_dims_is_stored_without_padding(daemon):
    """Gemma 4 with K/V shared: sliding layers of 2 heads of 16, full ones of 2 of 32, the last two
    layers reading earlier layers' K/V. The layout's slot is the small layers' row; a full
    layer spans two slots (a head each); only the layers that cache K/V of their own are
    stored, and the daemon holds their bytes exactly."""
    model = build("gemma4-kv-sharing")
    layout = layout_for_model(model, block_tokens=32, model_id="slots")
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (6, 2, 16)
    ids = torch.randint(0, 500, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    with KVClient(daemon.target, layout) as c:
        assert CachedPrefill(model, c).prefill(ids).published_tokens == 192
        n, kv = c.fetch(ids[0, :192])  # [6 slots, 2, 192, 2, 16]
    assert n == 192
    own = run_model(model, ids, T.DynamicCache())[1]
    assert len(own.layers) == 4  # the last two layers read the K/V of layers 2 and 3
    slot = 0
    for layer, cached in enumerate(own.layers):
        heads, dim = cached.keys.shape[1], cached.keys.shape[-1]
        assert (heads, dim) == (2, 16 if layer % 2 == 0 else 32)
        span = 1 if dim == 16 else 2
        for i, t in enumerate((cached.keys, cached.values)):
            rows = torch.cat([kv[s, i].reshape(192, -1) for s in range(slot, slot + span)], -1)
            assert torch.equal(rows, t[0, :, :192].transpose(0, 1).reshape(192, -1)), (layer, i)
        slot += span
    assert slot == 6


@torch.inference_mode()
def test_publishing_a_cache_unlike_the_layout_is_refused_by_name(daemon):
    """`publish_cache` called directly with another model's cache (or the wrong shapes) is an
    `InvalidArgumentError` naming the layer that differs; nothing is stored."""
    from kvstore.client.integrations.hf import publish_cache

    model = build("gemma4-head-dims-per-layer")
    ids = torch.randint(0, 500, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    cache = run_model(model, ids, T.DynamicCache())[1]
    layout = layout_for_model(model, block_tokens=32, model_id="refused-publish")
    with KVClient(daemon.target, layout) as c:
        # No shapes: every layer taken as the 2 x 16 slot, 6 of them.
        with pytest.raises(InvalidArgumentError, match=r"the cache has 4 layers, the layout "
                           r"6; .* needs shapes=layer_shapes\(config\)"):
            publish_cache(c, ids[0], cache)
        with pytest.raises(InvalidArgumentError, match=r"layer 0's keys are \(1, 2, 200, 16\)"):
            publish_cache(c, ids[0], cache, layer_shapes(model.config)[::-1])  # misordered
        assert c.lookup(ids[0]) == 0
        assert publish_cache(c, ids[0], cache, layer_shapes(model.config)) == 192
        assert c.lookup(ids[0]) == 192
