"""Random-weight models of the kinds vLLM serves beyond plain Llama, built here (no model hub),
each with the tokenizer `vllm_runner.make_model` trains.

- `make_mla_model`: DeepSeek-V2-shaped (multi-head latent attention). vLLM's CPU MLA backend
  (CPU_MLA) compiles its decode kernel for one latent size only, kv_lora_rank 512 + rope 64 =
  576, DeepSeek-V2/V3's own, with block size 16; the rest of the model is small (2 layers,
  hidden 256, a small MoE in neither layer: first_k_dense_replace covers both). Its RoPE is
  YaRN, as DeepSeek-V2/V3's: vLLM runs that one in torch (`DeepseekScalingRotaryEmbedding`).
  `rope="default"` gives plain RoPE instead, which vLLM 0.32's CPU build runs through its C++
  `rotary_embedding` op; that op reads MLA's strided q_pe/k_pe views as contiguous rows and
  rotates the wrong elements, so outputs then depend on a token's place in the step's batch
  (docs/ENGINES.md, "MLA"): kept to show it, not to test the connector with.
- `make_hybrid_model`: Gemma-3-shaped (sliding-window layers between full-attention ones).
  With vLLM's hybrid KV-cache manager (on for the CPU build; the kvstore connector implements
  `SupportsHMA`, so a connector no longer turns it off) its layers form two KV-cache groups,
  sliding window and full attention, with one block table each.
- `make_gemma4_model`: Gemma-4-shaped: full-attention layers of twice the sliding ones' head
  dim, so vLLM gives the two groups different block sizes (it doubles the sliding group's to
  make their pages equal), and the last two layers reading earlier layers' K/V.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.vllm.vllm_runner import make_model


def _save_random(path: Path, model_class: Any, config: Callable[[int], Any]) -> Path:
    """A random-weight model of `model_class` with the config `config(vocab_size)`, its
    weights drawn with seed 0, saved in float32 at `path` with the tokenizer
    `vllm_runner.make_model` trains (and its vocabulary size)."""
    import torch
    from transformers import AutoTokenizer

    llama = make_model(path.with_name(path.name + "-tokenizer"), layers=1)
    tok = AutoTokenizer.from_pretrained(llama)
    cfg = config(tok.vocab_size)
    torch.manual_seed(0)
    model_class(cfg).float().save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


MLA_BLOCK = 16  # the only block size vLLM's CPU MLA backend takes
MLA_LATENT = 512 + 64  # kv_lora_rank + qk_rope_head_dim: the latent cache's width
# An MLA test engine's options: CPU_MLA by name. On a CPU with AMX, vLLM prefers its AMX_MLA
# backend, which takes bf16 weights only and fails to start on these float32 models
# ("expect weight to be bfloat16, ..."); its cache is the same plain latent rows.
MLA_ENGINE = {"block_size": MLA_BLOCK, "llm_kwargs": {"attention_backend": "CPU_MLA"}}


def make_mla_model(path: Path, *, layers: int = 2, positions: int = 2048,
                   rope: str = "yarn") -> Path:
    """A random-weight DeepSeek-V2-shaped model in float32 with varied greedy outputs;
    `rope`: "yarn" (DeepSeek-V2's scaling, its mscale included) or "default"."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    if rope == "yarn":
        rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                           "original_max_position_embeddings": positions // 4,
                           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707,
                           "mscale_all_dim": 0.707}
    elif rope == "default":
        rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    else:
        raise ValueError(f"rope must be 'yarn' or 'default', got {rope!r}")
    return _save_random(path, DeepseekV2ForCausalLM, lambda vocab: DeepseekV2Config(
        vocab_size=vocab, hidden_size=256, intermediate_size=512,
        moe_intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=layers, kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=positions, rope_parameters=rope_parameters, bos_token_id=0,
        eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
        initializer_range=0.1))  # wider than 0.02: greedy tokens then depend on the context


HYBRID_WINDOW = 64  # tokens a sliding-window layer attends to (its own included)


def make_hybrid_model(path: Path, *, window: int = HYBRID_WINDOW,
                      positions: int = 2048) -> Path:
    """A random-weight Gemma-3-shaped text model in float32 with varied greedy outputs: 4
    layers, sliding window (0, 2) then full attention (1, 3), 2 KV heads of 64."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return _save_random(path, Gemma3ForCausalLM, lambda vocab: Gemma3TextConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=positions, sliding_window=window,
        layer_types=["sliding_attention", "full_attention"] * 2, bos_token_id=0,
        eos_token_id=1, pad_token_id=2,
        # Untied and wider than 0.02: greedy tokens then depend on the context (tied, or at
        # 0.02, this model repeats one token whatever the prompt).
        tie_word_embeddings=False, initializer_range=0.1))


GEMMA4_SLIDING_HEAD_DIM = 64
GEMMA4_FULL_HEAD_DIM = 128  # twice: vLLM gives the sliding group twice the block size


def make_gemma4_model(path: Path, *, window: int = HYBRID_WINDOW,
                      positions: int = 2048) -> Path:
    """A random-weight Gemma-4-shaped text model in float32 with varied greedy outputs: 6
    layers alternating sliding window and full attention, 2 KV heads of 64 on sliding layers
    and of 128 on full ones (Gemma 4's own: 256 and 512), the last 2 layers sharing the K/V
    of the last earlier layer of their kind (`num_kv_shared_layers`: no cache of their own)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    return _save_random(path, Gemma4ForCausalLM, lambda vocab: Gemma4TextConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=GEMMA4_SLIDING_HEAD_DIM,
        global_head_dim=GEMMA4_FULL_HEAD_DIM, num_kv_shared_layers=2,
        vocab_size_per_layer_input=vocab, hidden_size_per_layer_input=8,
        max_position_embeddings=positions, sliding_window=window,
        layer_types=["sliding_attention", "full_attention"] * 3, bos_token_id=0,
        eos_token_id=1, pad_token_id=2,
        # Untied and wider than 0.02, as make_hybrid_model's: varied greedy tokens.
        tie_word_embeddings=False, initializer_range=0.1))
