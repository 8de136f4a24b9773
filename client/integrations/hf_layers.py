"""How a transformers model's KV cache maps onto kvstore's blocks.

A `KVLayout` stores every layer of a block alike, `[kv, block_tokens, num_kv_heads, head_dim]`:
a layer's slot. transformers caches each layer as keys and values `[batch, heads, tokens,
dims]`, of the slot's shape in most models. A layer's `LayerShape` says what its keys and
values are, and a `LayerMap` where they lie in a block, for the three kinds of model that
differ:

- **MLA** (DeepSeek V2/V3, Kimi K2, MiniCPM3): transformers caches the compressed latent as
  keys and the rotary key as values, one "head" each. The slot holds them side by side in one
  vector per token (kv = 1, latent first): vLLM's MLA layout.
- **Layers of different shapes** (Gemma 4: sliding-window layers of 256-dim heads, full ones of
  512-dim heads, their own number of them): the layout's slot is the largest size that divides
  every layer's K row of a token (`heads * dims` values) and cuts it between heads or inside
  one, and a layer of k times that size spans k consecutive slots, each holding the next part
  of its K row and of its V row (`Piece`). Nothing is padded. (Padding every layer to the
  largest one would leave 5/12 of a block zero with `Gemma4TextConfig()`'s defaults: 4 heads
  of 256 on five layers in six, half of the 4 x 512 of the sixth. One layout per shape would
  cost a lookup, a lease and a fetch per shape for every prompt, and a prefix could stay
  cached in one and be evicted from the other.)
- **K/V shared between layers** (Gemma 3n, Gemma 4 with `num_kv_shared_layers`): the last
  `num_kv_shared_layers` layers attend to earlier layers' K/V and cache nothing
  (transformers' `DummyLayer`); the layout holds the layers before them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.errors import InvalidArgumentError
from kvstore.layout import KVLayout

# Layer kinds (`config.layer_types`) whose cache is one key and one value per token: kvstore
# stores every token's K/V for all of them. A sliding-window or chunked layer attends to its
# window only, by its mask; a warm prefill loads only that (`hf.own_windows`).
ATTENTION_LAYER_KINDS = frozenset({"full_attention", "sliding_attention", "chunked_attention",
                                   "attention"})  # transformers' older name for full
MLP_LAYER_KINDS = frozenset({"dense", "sparse"})  # say nothing about the cache


@dataclass(frozen=True)
class LayerShape:
    """One layer of a batch-1 transformers cache: its keys `[1, heads, tokens, key_dim]` and
    values `[1, heads, tokens, value_dim]`; `latent`: an MLA layer's compressed latent (keys)
    and rotary key (values), stored as one vector per token."""

    heads: int
    key_dim: int
    value_dim: int
    latent: bool = False


def text_config(config: Any) -> Any:
    """The config of the model's text decoder: its own, or a multimodal model's part."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def kv_shapes(config: Any) -> list[tuple[int, int]]:
    """Each layer's (KV heads, head dim), from its own config where transformers gives one
    per layer (`per_layer_config`: a model whose layers differ refuses the global value)."""
    layers = getattr(config, "per_layer_config", None) or [config] * config.num_hidden_layers
    shapes = []
    for layer in layers:
        heads = layer.num_attention_heads
        shapes.append((getattr(layer, "num_key_value_heads", None) or heads,
                       getattr(layer, "head_dim", None) or layer.hidden_size // heads))
    return shapes


def cached_layers(config: Any) -> int:
    """The layers that cache K/V of their own: all but the last `num_kv_shared_layers`, which
    read earlier layers' (transformers gives them a `DummyLayer`)."""
    modes = getattr(config, "kv_sharing_modes", None)
    if modes:
        return sum(mode != "reuse" for mode in modes)
    return int(config.num_hidden_layers) - int(getattr(config, "num_kv_shared_layers", 0) or 0)


def unsupported_reason(config: Any) -> str | None:
    """Why kvstore cannot hold the KV cache of a transformers model with this config, or None
    where it can: every layer is attention caching one key and one value per token and head
    (MLA: one latent), or reads an earlier layer's, and the layers that cache come first."""
    kind = getattr(config, "model_type", "") or type(config).__name__
    if getattr(config, "num_attention_heads", None) is None:
        return f"{kind} has no attention layers: a state-space model's recurrent state is not " \
               "per-token K/V"
    if getattr(config, "index_topk", None) is not None:
        return f"{kind} uses sparse attention with an indexer (DeepSeek Sparse Attention): " \
               "its cache holds the indexer's keys as well as MLA's latent, and kvstore " \
               "stores the latent only"
    other = set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYER_KINDS \
        - MLP_LAYER_KINDS
    if other:
        return f"{kind} has layers of kind {', '.join(sorted(other))}: kvstore holds per-token " \
               "K/V of full, sliding-window and chunked attention layers only (a recurrent " \
               "state would need one saved state per block boundary)"
    modes = list(getattr(config, "kv_sharing_modes", None) or ())
    if "reuse" in modes and "reuse" in modes[: cached_layers(config)]:
        return f"{kind} shares K/V between layers other than its last ones (sharing modes " \
               f"{modes}): kvstore holds the layers that cache K/V first, then the readers"
    if cached_layers(config) < 1:
        return f"{kind} has no layer that caches K/V of its own"
    return None


def layer_shapes(config: Any) -> tuple[LayerShape, ...]:
    """Each cached layer's `LayerShape` for a model's (text) config (`cached_layers`)."""
    layers = cached_layers(config)
    rank = getattr(config, "kv_lora_rank", None)
    if rank is not None:  # MLA: the compressed latent, then the rotary key
        return (LayerShape(1, int(rank), int(config.qk_rope_head_dim), latent=True),) * layers
    return tuple(LayerShape(h, d, d) for h, d in kv_shapes(config)[:layers])


def slot_values(shapes: tuple[LayerShape, ...]) -> int:
    """Values per token in one K (or V) row of a layout's layer (its slot): an MLA latent's
    whole vector; else the largest size that divides every layer's row and cuts it between
    heads or inside a head (`Piece`), so that no value of a slot is padding."""
    if shapes[0].latent:
        return shapes[0].key_dim + shapes[0].value_dim
    common = math.gcd(*(s.heads * s.key_dim for s in shapes))
    return next(size for size in range(common, 0, -1)
                if common % size == 0 and all(_cuts(size, s.key_dim) for s in shapes))


def _cuts(size: int, head_dim: int) -> bool:
    """Whether parts of `size` values cut a row of heads of `head_dim` between heads or
    inside one head (a part is then one view of the cache's `[heads, tokens, dims]`)."""
    return size % head_dim == 0 or head_dim % size == 0


def layout_for_model(model: Any, block_tokens: int = 256, model_id: str | None = None,
                     revision: str = "") -> KVLayout:
    """The `KVLayout` of a transformers causal LM's KV cache; `InvalidArgumentError` for a
    model whose cache kvstore cannot hold (`unsupported_reason`). A multimodal model's is its
    text decoder's (prompts of tokens only: `CachedPrefill` takes no images)."""
    top = model.config
    cfg = text_config(top)
    reason = unsupported_reason(cfg)
    if reason:
        raise InvalidArgumentError(f"kvstore cannot cache this model: {reason}")
    shapes = layer_shapes(cfg)
    size = slot_values(shapes)
    # The slot as heads of the smallest head dim where they fill it, else one head of it.
    dim = min(s.key_dim for s in shapes)
    heads, head_dim = (size // dim, dim) if not shapes[0].latent and size % dim == 0 \
        else (1, size)
    return KVLayout(
        model=model_id or getattr(top, "name_or_path", "") or top.model_type,
        model_revision=revision,
        num_layers=sum(s.heads * s.key_dim // size for s in shapes) if not shapes[0].latent
        else len(shapes),
        num_kv_heads=heads, head_dim=head_dim, dtype=model.dtype, block_tokens=block_tokens,
        kv_kind="mla" if shapes[0].latent else "kv")


def uniform_shapes(layout: KVLayout) -> tuple[LayerShape, ...]:
    """Every layer of `layout` cached as its slot: K and V `[1, heads, tokens, head_dim]`. An
    MLA layout has none: its split into latent and rotary key is the model's."""
    if layout.kv_kind == "mla":
        raise InvalidArgumentError(
            "an MLA layout's transformers cache needs the model's layer shapes (the latent's "
            "dims, kv_lora_rank, and the rotary key's): pass shapes=layer_shapes(config)")
    return (LayerShape(layout.num_kv_heads, layout.head_dim, layout.head_dim),) \
        * layout.num_layers


@dataclass(frozen=True)
class Piece:
    """A part of a cache layer's per-token K row (and of its V row), held in the layout's
    layer `slot`: the cache's `[heads, tokens, dims]` at `heads`, `dims`."""

    slot: int
    heads: slice
    dims: slice


@dataclass(frozen=True)
class LayerMap:
    """Where each cached layer's keys and values lie in a block of a layout: its `shapes`,
    and per layer the `pieces` of consecutive slots that hold it (one where the layer is the
    slot's shape). `whole[l]`: layer l is its slot's `[kv, bt, heads, dim]` as it is (copied
    without cutting it); `uniform`: every layer is (what the copy kernels move)."""

    shapes: tuple[LayerShape, ...]
    pieces: tuple[tuple[Piece, ...], ...]
    whole: tuple[bool, ...]

    @property
    def uniform(self) -> bool:
        return all(self.whole)

    def slots(self, layer: int) -> slice:
        """The layout's layers holding cache layer `layer`."""
        pieces = self.pieces[layer]
        return slice(pieces[0].slot, pieces[-1].slot + 1)


def layer_map(layout: KVLayout, shapes: tuple[LayerShape, ...] | None = None) -> LayerMap:
    """The `LayerMap` of caches of `shapes` (None: `uniform_shapes`) in blocks of `layout`;
    `InvalidArgumentError` naming the first layer that does not fit."""
    shapes = uniform_shapes(layout) if shapes is None else tuple(shapes)
    size = layout.num_kv_heads * layout.head_dim  # a slot's K or V row, per token
    pieces: list[tuple[Piece, ...]] = []
    at = 0
    for i, s in enumerate(shapes):
        if s.latent != (layout.kv_kind == "mla"):
            raise InvalidArgumentError(
                f"layer {i}: {'an MLA latent' if s.latent else 'separate K and V'} in a "
                f"layout of kv_kind {layout.kv_kind!r}")
        if s.latent:
            if s.heads != 1 or min(s.key_dim, s.value_dim) < 1 \
                    or s.key_dim + s.value_dim != layout.head_dim:
                raise InvalidArgumentError(
                    f"layer {i}'s shape {s} does not fit the layout's MLA latent of "
                    f"{layout.head_dim} dims (latent + rotary key)")
            pieces.append((Piece(at, slice(0, 1), slice(0, s.key_dim + s.value_dim)),))
            at += 1
            continue
        row = s.heads * s.key_dim
        if min(s.heads, s.key_dim) < 1 or s.value_dim != s.key_dim or row % size \
                or not _cuts(size, s.key_dim):
            raise InvalidArgumentError(
                f"layer {i}'s shape {s} does not fit the layout's slot of "
                f"{layout.num_kv_heads} x {layout.head_dim}: its K and V rows must be equal "
                f"and made of whole slots, each cut between heads or inside one")
        per = max(size // s.key_dim, 1)  # heads in a slot (1: a part of one head)
        layer = []
        for k in range(row // size):
            start = k * size
            head = start // s.key_dim
            layer.append(Piece(at, slice(head, head + per), slice(0, s.key_dim))
                         if size >= s.key_dim else
                         Piece(at, slice(head, head + 1),
                               slice(start % s.key_dim, start % s.key_dim + size)))
            at += 1
        pieces.append(tuple(layer))
    if at != layout.num_layers:
        raise InvalidArgumentError(f"{len(shapes)} layers of these shapes fill {at} of the "
                                   f"layout's layers, not its {layout.num_layers}")
    slot = LayerShape(layout.num_kv_heads, layout.head_dim, layout.head_dim)
    return LayerMap(shapes, tuple(pieces), tuple(s == slot for s in shapes))


def _piece_views(block: torch.Tensor, lmap: LayerMap, layer: int, first_slot: int,
                 ) -> list[tuple[torch.Tensor, torch.Tensor, slice, slice, slice]]:
    """Cache layer `layer`'s pieces in `block` (`[slots, kv, bt, heads, dim]`, its slots
    numbered from `first_slot`): each as its K and V `[heads, bt, dims]` views and the
    heads, key dims and value dims of the cache layer it holds."""
    shape = lmap.shapes[layer]
    out = []
    for p in lmap.pieces[layer]:
        held = block[p.slot - first_slot]  # [kv, bt, heads, dim]
        if shape.latent:
            latent = held[0].transpose(0, 1)  # [1, bt, dim]
            out.append((latent[..., : shape.key_dim], latent[..., shape.key_dim :], p.heads,
                        slice(0, shape.key_dim), slice(0, shape.value_dim)))
            continue
        rows = held.view(*held.shape[:2], -1)  # [kv, bt, slot values]: no copy
        part = (-1, p.heads.stop - p.heads.start, p.dims.stop - p.dims.start)
        out.append((rows[0].view(part).transpose(0, 1), rows[1].view(part).transpose(0, 1),
                    p.heads, p.dims, p.dims))
    return out


def copy_from_block(block: torch.Tensor, lmap: LayerMap, layer: int, keys: torch.Tensor,
                    values: torch.Tensor, span: slice, first_slot: int = 0) -> None:
    """Cache layer `layer`'s K/V in one stored block (`[slots, kv, bt, heads, dim]`, from
    slot `first_slot` on) into its keys and values `[1, heads, tokens, dims]` at `span`."""
    if lmap.whole[layer]:  # most models' every layer: two transposing copies, no cutting
        held = block[lmap.pieces[layer][0].slot - first_slot]
        keys[0, :, span].copy_(held[0].transpose(0, 1))
        values[0, :, span].copy_(held[1].transpose(0, 1))
        return
    for k, v, heads, key_dims, value_dims in _piece_views(block, lmap, layer, first_slot):
        keys[0, heads, span, key_dims].copy_(k)
        values[0, heads, span, value_dims].copy_(v)


def copy_to_block(block: torch.Tensor, lmap: LayerMap, layer: int, keys: torch.Tensor,
                  values: torch.Tensor, span: slice) -> None:
    """Cache layer `layer`'s keys and values `[1, heads, tokens, dims]` at `span` into its
    place in a block `[slots, kv, bt, heads, dim]`."""
    if lmap.whole[layer]:
        held = block[lmap.pieces[layer][0].slot]
        held[0].copy_(keys[0, :, span].transpose(0, 1))
        held[1].copy_(values[0, :, span].transpose(0, 1))
        return
    for k, v, heads, key_dims, value_dims in _piece_views(block, lmap, layer, 0):
        k.copy_(keys[0, heads, span, key_dims])
        v.copy_(values[0, heads, span, value_dims])


def cache_elements(shapes: tuple[LayerShape, ...], tokens: int) -> int:
    """Values in the keys and values of `tokens` tokens of every layer."""
    return tokens * sum(s.heads * (s.key_dim + s.value_dim) for s in shapes)


def carve(memory: torch.Tensor, shapes: tuple[LayerShape, ...], tokens: int,
          ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each layer's keys and values `[1, heads, tokens, dims]` as views of the 1-D `memory`
    (`cache_elements` long), layer after layer; an MLA layer's as two views of one
    `[1, 1, tokens, latent + rotary]` tensor, laid out token by token as a block is."""
    keys, values, at = [], [], 0
    for s in shapes:
        if s.latent:
            dims = s.key_dim + s.value_dim
            latent = memory[at : at + tokens * dims].view(1, 1, tokens, dims)
            keys.append(latent[..., : s.key_dim])
            values.append(latent[..., s.key_dim :])
            at += tokens * dims
            continue
        for out, dim in ((keys, s.key_dim), (values, s.value_dim)):
            size = s.heads * tokens * dim
            out.append(memory[at : at + size].view(1, s.heads, tokens, dim))
            at += size
    return keys, values
