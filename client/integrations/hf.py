"""Reuse cached prefixes in Hugging Face transformers.

`CachedPrefill.prefill(input_ids)` looks the prompt up in kvstore, fetches the longest cached
prefix into a `DynamicCache`, runs the model over the suffix only, and publishes the prompt's new
full blocks. The last-token logits equal those of a full prefill: the cached K/V are the exact
bytes an earlier forward pass produced for the same tokens under the same layout and weights.
At least one token is always computed (the logits come from it).

With `prefill_tokens_per_s` (a number, or `"online"`: fitted from this engine's own full
recomputes), `prefill` first asks the client's load-or-recompute planner how much of the cached
prefix is worth loading, loads only that and computes the rest: a slow tier or a short prompt
never costs more than recomputing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

from client.sync import KVClient
from kvstore.layout import KVLayout
from kvstore.planner import BandwidthModel, Plan, PrefillModel


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
    plan: Plan | None = None  # the planner's decision (planner mode with a known speed)


class CachedPrefill:
    """Prefill a batch-1 prompt through kvstore, then decode as usual."""

    def __init__(self, model: Any, client: KVClient, *,
                 prefill_tokens_per_s: float | Literal["online"] | None = None) -> None:
        """`prefill_tokens_per_s`: None (default) loads the whole cached prefix; a number
        (the engine's prefill speed) or `"online"` (fitted from this engine's own full
        recomputes, `prefill_model`; the whole prefix is loaded until one was seen) loads only
        what the planner says is worth loading."""
        if prefill_tokens_per_s is not None and prefill_tokens_per_s != "online" and not (
                isinstance(prefill_tokens_per_s, int | float)
                and math.isfinite(prefill_tokens_per_s) and prefill_tokens_per_s > 0):
            raise ValueError(f"prefill_tokens_per_s must be a positive number, 'online' or "
                             f"None, got {prefill_tokens_per_s!r}")
        self.model = model
        self.client = client
        self.prefill_tokens_per_s = prefill_tokens_per_s
        # This engine's prefill time by prompt length, from its forward passes over whole
        # prompts of at least one block (always kept; the planner uses it in "online" mode).
        self.prefill_model = PrefillModel()
        # Bytes/s of turning fetched blocks into a DynamicCache (a transposing copy): the
        # engine's leg of a load, after the client's copy.
        self._consume = BandwidthModel(bandwidth={}, latency={})
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
        plan = self.plan(tokens) if n > 1 else None
        limit = None if plan is None else plan.load_blocks
        if n <= 1 or limit == 0:
            cached, kv = 0, None
        elif limit is None:  # no planner: the whole cached prefix, as always
            cached, kv = self.client.fetch(tokens[: n - 1])
        else:
            cached, kv = self.client.fetch(tokens[: n - 1], max_blocks=limit)
        cache = None
        if kv is not None:
            began = time.perf_counter()
            cache = kv_to_cache(kv)
            self._consume.observe("cache", kv.numel() * kv.element_size(),
                                  time.perf_counter() - began)
        if cache is None:
            from transformers import DynamicCache

            cache = DynamicCache(config=self.model.config)
        began = time.perf_counter()
        out = self.model(input_ids=input_ids[:, cached:], past_key_values=cache, use_cache=True)
        logits = out.logits[0, -1].float()
        ttft = time.perf_counter() - start
        if cached == 0 and n >= self.client.layout.block_tokens:
            self.prefill_model.observe(n, time.perf_counter() - began)
        result = PrefillResult(logits, out.past_key_values, cached, n - cached, ttft,
                               plan=plan)
        full = (n // self.client.layout.block_tokens) * self.client.layout.block_tokens
        if publish and full > cached:
            result.published_tokens = self.client.publish(
                tokens[:full], cache_to_kv(out.past_key_values, full))
        return result

    def plan(self, tokens: torch.Tensor) -> Plan | None:
        """The planner's decision for a prompt (`[n]` token ids), or None when the planner is
        off or the engine's speed is not known yet (then the whole cached prefix is loaded)."""
        speed = self.speed(int(tokens.shape[0]))
        if speed is None:
            return None
        return self.client.plan(tokens, speed,
                                consume_bytes_per_s=self._consume.bandwidth.get("cache"))

    def speed(self, n: int) -> float | None:
        """Prefill tokens/s the planner assumes for an `n`-token prompt (None: no planner, or
        "online" before this engine has recomputed a prompt)."""
        if self.prefill_tokens_per_s == "online":
            return self.prefill_model.tokens_per_s(n)
        return self.prefill_tokens_per_s

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
