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
"""

from __future__ import annotations

from pathlib import Path

from tests.vllm.vllm_runner import make_model

MLA_BLOCK = 16  # the only block size vLLM's CPU MLA backend takes
MLA_LATENT = 512 + 64  # kv_lora_rank + qk_rope_head_dim: the latent cache's width


def make_mla_model(path: Path, *, layers: int = 2, positions: int = 2048,
                   rope: str = "yarn") -> Path:
    """A random-weight DeepSeek-V2-shaped model in float32 with varied greedy outputs;
    `rope`: "yarn" (DeepSeek-V2's scaling, its mscale included) or "default"."""
    import torch
    from transformers import AutoTokenizer, DeepseekV2Config, DeepseekV2ForCausalLM

    if rope == "yarn":
        rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                           "original_max_position_embeddings": positions // 4,
                           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707,
                           "mscale_all_dim": 0.707}
    elif rope == "default":
        rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    else:
        raise ValueError(f"rope must be 'yarn' or 'default', got {rope!r}")
    llama = make_model(path.with_name(path.name + "-tokenizer"), layers=1)
    tok = AutoTokenizer.from_pretrained(llama)
    cfg = DeepseekV2Config(
        vocab_size=tok.vocab_size, hidden_size=256, intermediate_size=512,
        moe_intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=layers, kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=positions, rope_parameters=rope_parameters, bos_token_id=0,
        eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
        initializer_range=0.1)  # wider than 0.02: greedy tokens then depend on the context
    torch.manual_seed(0)
    DeepseekV2ForCausalLM(cfg).float().save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


HYBRID_WINDOW = 64  # tokens a sliding-window layer attends to (its own included)


def make_hybrid_model(path: Path, *, window: int = HYBRID_WINDOW,
                      positions: int = 2048) -> Path:
    """A random-weight Gemma-3-shaped text model in float32 with varied greedy outputs: 4
    layers, sliding window (0, 2) then full attention (1, 3), 2 KV heads of 64."""
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    llama = make_model(path.with_name(path.name + "-tokenizer"), layers=1)
    tok = AutoTokenizer.from_pretrained(llama)
    cfg = Gemma3TextConfig(
        vocab_size=tok.vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=positions, sliding_window=window,
        layer_types=["sliding_attention", "full_attention"] * 2, bos_token_id=0,
        eos_token_id=1, pad_token_id=2,
        # Untied and wider than 0.02: greedy tokens then depend on the context (tied, or at
        # 0.02, this model repeats one token whatever the prompt).
        tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(0)
    Gemma3ForCausalLM(cfg).float().save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
