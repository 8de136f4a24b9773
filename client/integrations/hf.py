"""Reuse cached prefixes in Hugging Face transformers.

`CachedPrefill.prefill(input_ids)` looks the prompt up in kvstore, fetches the longest cached
prefix into a `DynamicCache`, runs the model over the suffix only, and publishes the prompt's new
full blocks. The last-token logits equal those of a full prefill: the cached K/V are the exact
bytes an earlier forward pass produced for the same tokens under the same layout and weights.
At least one token is always computed (the logits come from it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from client.sync import KVClient
from kvstore.layout import KVLayout


def layout_for_model(model: Any, block_tokens: int = 256, model_id: str | None = None,
                     revision: str = "") -> KVLayout:
    """The `KVLayout` of a transformers causal LM's KV cache."""
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return KVLayout(
        model=model_id or getattr(cfg, "name_or_path", "") or cfg.model_type,
        model_revision=revision, num_layers=cfg.num_hidden_layers,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=head_dim,
        dtype=model.dtype, block_tokens=block_tokens)


def kv_to_cache(kv: torch.Tensor) -> Any:
    """`[layers, 2, n, heads, head_dim]` -> a `DynamicCache` (batch 1, `[1, heads, n, dim]`)."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=[
        (kv[i, 0].transpose(0, 1).unsqueeze(0).contiguous(),
         kv[i, 1].transpose(0, 1).unsqueeze(0).contiguous()) for i in range(kv.shape[0])])


def cache_to_kv(cache: Any, num_tokens: int) -> torch.Tensor:
    """A batch-1 `DynamicCache` -> `[layers, 2, num_tokens, heads, head_dim]` (a copy)."""
    layers = [torch.stack((layer.keys[0, :, :num_tokens], layer.values[0, :, :num_tokens]))
              for layer in cache.layers]
    return torch.stack(layers).transpose(2, 3)


@dataclass
class PrefillResult:
    logits: torch.Tensor  # last-token logits, [vocab]
    cache: Any  # DynamicCache holding the whole prompt, ready for decoding
    cached_tokens: int  # tokens loaded from kvstore
    computed_tokens: int  # tokens that went through the model
    ttft_s: float  # lookup + fetch + forward, up to the first token's logits
    published_tokens: int = 0


class CachedPrefill:
    """Prefill a batch-1 prompt through kvstore, then decode as usual."""

    def __init__(self, model: Any, client: KVClient) -> None:
        self.model = model
        self.client = client
        expected = layout_for_model(model, client.layout.block_tokens, client.layout.model,
                                    client.layout.model_revision)
        if expected != client.layout:
            raise ValueError(f"client layout {client.layout} does not match the model's "
                             f"KV cache {expected}")

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, publish: bool = True) -> PrefillResult:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be [1, n], got {tuple(input_ids.shape)}")
        tokens = input_ids[0]
        n = tokens.shape[0]
        start = time.perf_counter()
        cached, kv = self.client.fetch(tokens[: n - 1]) if n > 1 else (0, None)
        cache = kv_to_cache(kv) if kv is not None else None
        if cache is None:
            from transformers import DynamicCache

            cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=input_ids[:, cached:], past_key_values=cache, use_cache=True)
        logits = out.logits[0, -1].float()
        ttft = time.perf_counter() - start
        result = PrefillResult(logits, out.past_key_values, cached, n - cached, ttft)
        full = (n // self.client.layout.block_tokens) * self.client.layout.block_tokens
        if publish and full > cached:
            result.published_tokens = self.client.publish(
                tokens[:full], cache_to_kv(out.past_key_values, full))
        return result

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int],
                                                                              PrefillResult]:
        """Greedy decoding after a cached prefill; returns the new tokens."""
        first = self.prefill(input_ids)
        cache, logits = first.cache, first.logits
        out: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            step = self.model(input_ids=torch.tensor([[nxt]]), past_key_values=cache,
                              use_cache=True)
            cache, logits = step.past_key_values, step.logits[0, -1].float()
        return out, first
