"""What a kvstore block is to the engine, for the daemon's KV events (`kv_events`).

A router built for vLLM indexes blocks by vLLM's own block hashes: a chain over the engine's
blocks (e.g. 16 tokens), not kvstore's (e.g. 256 tokens, SHA-256 over other bytes). So a client
that wants its blocks in the events tells the daemon, per kvstore block, the engine blocks it
covers (`AsyncKVClient.describe_blocks`). The vLLM connector takes the hashes from vLLM's request
(`request.block_hashes`); an engine without vLLM (transformers) computes them here with
`vllm_block_hashes`, a re-implementation of vLLM's `hash_block_tokens` chain (vLLM is not
imported: it would bring torch builds and CUDA checks into any client).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.errors import InvalidArgumentError

# vLLM's seed of the chain's first parent (`kv_cache_utils.DEFAULT_NONE_HASH_SEED`) when
# PYTHONHASHSEED is not set; with it set, vLLM seeds from PYTHONHASHSEED.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


@dataclass(frozen=True)
class EngineBlockSpan:
    """The engine blocks one kvstore block covers, as vLLM's `BlockStored` names them."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None  # the engine block before the first; None: none
    token_ids: tuple[int, ...]
    block_size: int  # engine tokens per engine block
    lora_name: str | None = None
    # A hybrid model's KV-cache group, as vLLM's own events name it: its index, kind
    # (`KVCacheSpecKind` values: "full_attention", "sliding_window") and window. None: one
    # group (vLLM's event for it says nothing more either).
    group_idx: int | None = None
    spec_kind: str | None = None
    sliding_window: int | None = None


def _sha256_pickle(obj: Any) -> bytes:
    # vLLM's "sha256" (its default `prefix_caching_hash_algo`): SHA-256 of the pickle.
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2  # type: ignore[import-not-found]  # vLLM's dependency, only for this algorithm

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


HASH_FUNCTIONS = {"sha256": _sha256_pickle, "sha256_cbor": _sha256_cbor}


def none_hash(algo: str = "sha256", seed: str | None = None) -> bytes:
    """vLLM's `NONE_HASH`: the parent of a prompt's first block. `seed` defaults as vLLM's
    does for cryptographic algorithms: PYTHONHASHSEED when set, else the fixed default."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)
    return _hash_fn(algo)(seed)


def _hash_fn(algo: str) -> Callable[[Any], bytes]:
    fn = HASH_FUNCTIONS.get(algo)
    if fn is None:  # xxhash variants use a random per-process seed: not reproducible
        raise InvalidArgumentError(f"prefix-caching hash {algo!r} is not supported; "
                                   f"use one of {sorted(HASH_FUNCTIONS)}")
    return fn


def vllm_block_hashes(tokens: Sequence[int], block_size: int, algo: str = "sha256",
                      seed: str | None = None) -> list[bytes]:
    """vLLM's block hashes of the full `block_size`-token blocks of `tokens` (no LoRA, no
    multimodal inputs, no cache salt: their extra keys are not reproduced here)."""
    if block_size < 1:
        raise InvalidArgumentError(f"block_size must be positive, got {block_size}")
    fn = _hash_fn(algo)
    parent = none_hash(algo, seed)
    out: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = fn((parent, tuple(int(t) for t in tokens[start : start + block_size]), None))
        out.append(parent)
    return out


def spans_for(tokens: Sequence[int], engine_hashes: Sequence[bytes], engine_block_size: int,
              kv_block_tokens: int, lora_name: str | None = None, *,
              group_idx: int | None = None, spec_kind: str | None = None,
              sliding_window: int | None = None) -> list[EngineBlockSpan]:
    """The engine blocks each full kvstore block of `tokens` covers, given the engine's block
    hashes of those tokens. Stops at the first kvstore block whose engine hashes are missing.
    `group_idx`, `spec_kind`, `sliding_window`: the KV-cache group they belong to (hybrid
    models), carried into every span."""
    if engine_block_size < 1 or kv_block_tokens % engine_block_size:
        raise InvalidArgumentError(f"kvstore blocks ({kv_block_tokens} tokens) must hold whole "
                                   f"engine blocks ({engine_block_size} tokens)")
    per = kv_block_tokens // engine_block_size
    spans: list[EngineBlockSpan] = []
    for i in range(len(tokens) // kv_block_tokens):
        first = i * per
        hashes = tuple(bytes(h) for h in engine_hashes[first : first + per])
        if len(hashes) < per:
            break
        spans.append(EngineBlockSpan(
            block_hashes=hashes,
            parent_block_hash=bytes(engine_hashes[first - 1]) if first else None,
            token_ids=tuple(int(t) for t in
                            tokens[i * kv_block_tokens : (i + 1) * kv_block_tokens]),
            block_size=engine_block_size, lora_name=lora_name, group_idx=group_idx,
            spec_kind=spec_kind, sliding_window=sliding_window))
    return spans
