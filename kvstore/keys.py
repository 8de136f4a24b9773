"""Chained prefix keys.

`key_0 = SHA256(VERSION || namespace || tokens_0)`, `key_i = SHA256(key_{i-1} || tokens_i ||
extra_i)`, tokens as little-endian int32. A block's key therefore commits to every token before
it, so probing keys in order finds the longest cached prefix, and a crafted prompt cannot alias
another prompt's block. SHA-256 is deterministic in every process (unlike Python's built-in
hashing, which is salted per process).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvstore.errors import InvalidArgumentError
from kvstore.layout import KVLayout

if TYPE_CHECKING:
    import torch

KEY_VERSION = b"kvstore-key-v1\x00"
KEY_BYTES = 32
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Namespace:
    """Identity that must never mix: layout, LoRA adapter, tenant and cache salt.

    A salt a tenant cannot know keeps other tenants from probing, by timing, which prefixes
    are cached.
    """

    layout: KVLayout
    lora: str = ""
    tenant: str = ""
    salt: str = ""

    def digest(self) -> bytes:
        ident = {"lora": self.lora, "tenant": self.tenant, "salt": self.salt}
        text = json.dumps(ident, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(self.layout.digest() + text.encode()).digest()


def tokens_to_array(tokens: Sequence[int] | torch.Tensor | np.ndarray) -> np.ndarray:
    """Validate tokens and return them as a little-endian int32 array.

    Raises `InvalidArgumentError` for floats, bools, negative or out-of-range ids, and for
    anything that is not one-dimensional.
    """
    torch_mod = sys.modules.get("torch")  # a tensor implies torch is loaded: never import it
    if torch_mod is not None and isinstance(tokens, torch_mod.Tensor):
        dt = tokens.dtype
        if dt.is_floating_point or dt.is_complex or dt == torch_mod.bool:
            raise InvalidArgumentError(f"tokens must be integers, got a {dt} tensor")
        arr = tokens.detach().cpu().numpy()
    elif isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        try:
            seq = list(tokens)
        except TypeError:
            raise InvalidArgumentError(
                "tokens must be a list of ints or a 1-D integer tensor, "
                f"got {type(tokens).__name__}") from None
        for i, t in enumerate(seq):
            if isinstance(t, bool) or not isinstance(t, int | np.integer):
                raise InvalidArgumentError(f"tokens[{i}] is {t!r} ({type(t).__name__}), not an int")
        arr = np.asarray(seq, dtype=np.int64) if seq else np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"tokens must be one-dimensional, got shape {tuple(arr.shape)}")
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _INT32_MAX):
        raise InvalidArgumentError("token ids must be in [0, 2**31 - 1]")
    return arr.astype("<i4", copy=False)


def chain_keys(
    namespace: Namespace | bytes,
    tokens: Sequence[int] | torch.Tensor | np.ndarray,
    block_tokens: int | None = None,
    extras: Sequence[bytes] | None = None,
) -> list[bytes]:
    """Keys of the full blocks of `tokens`; a trailing partial block has no key.

    `extras[i]`, when given, binds per-block identity (an image hash, say) into key `i`.
    """
    if isinstance(namespace, Namespace):
        ns = namespace.digest()
        block_tokens = block_tokens or namespace.layout.block_tokens
    else:
        ns = namespace
        if block_tokens is None:
            raise InvalidArgumentError("block_tokens is required with a raw namespace digest")
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise InvalidArgumentError(f"block_tokens must be a positive int, got {block_tokens!r}")
    if len(ns) != KEY_BYTES:
        raise InvalidArgumentError(f"a namespace digest is {KEY_BYTES} bytes, got {len(ns)}")
    arr = tokens_to_array(tokens)
    n_blocks = len(arr) // block_tokens
    if extras is not None and len(extras) < n_blocks:
        raise InvalidArgumentError(f"{len(extras)} extras for {n_blocks} blocks")
    raw = arr[: n_blocks * block_tokens].tobytes()
    step = block_tokens * 4
    keys: list[bytes] = []
    prev = KEY_VERSION + ns
    for i in range(n_blocks):
        h = hashlib.sha256(prev)
        h.update(raw[i * step : (i + 1) * step])
        if extras is not None:
            h.update(extras[i])
        prev = h.digest()
        keys.append(prev)
    return keys
