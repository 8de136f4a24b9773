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
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
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
    arr: np.ndarray
    if torch_mod is not None and isinstance(tokens, torch_mod.Tensor):
        dt = tokens.dtype
        if dt.is_floating_point or dt.is_complex or dt == torch_mod.bool:
            raise InvalidArgumentError(f"tokens must be integers, got a {dt} tensor")
        arr = tokens.detach().cpu().numpy()
    elif isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        arr = _sequence_to_array(tokens)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"tokens must be one-dimensional, got shape {tuple(arr.shape)}")
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size:  # a pass over the tokens only for a bound their dtype does not keep
        bounds = np.iinfo(arr.dtype)
        if ((bounds.min < 0 and int(arr.min()) < 0)
                or (bounds.max > _INT32_MAX and int(arr.max()) > _INT32_MAX)):
            raise InvalidArgumentError("token ids must be in [0, 2**31 - 1]")
    return arr.astype("<i4", copy=False)


def _sequence_to_array(tokens: object) -> np.ndarray:
    """A list (or other iterable) of ints as an int64 array.

    The element types are checked as a set, in C (`map(type, ...)`), and the list is converted
    by numpy in one call: a 128k-token list takes milliseconds, not the tens of milliseconds of
    a per-element Python check. Only a list holding something else than plain ints is walked
    in Python, to name the first bad element.
    """
    try:
        seq = tokens if isinstance(tokens, list) else list(tokens)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidArgumentError(
            "tokens must be a list of ints or a 1-D integer tensor, "
            f"got {type(tokens).__name__}") from None
    if not seq:
        return np.zeros(0, dtype=np.int64)
    if set(map(type, seq)) != {int}:
        for i, t in enumerate(seq):  # bool is an int subclass: rejected by name
            if isinstance(t, bool) or not isinstance(t, int | np.integer):
                raise InvalidArgumentError(f"tokens[{i}] is {t!r} ({type(t).__name__}), not an int")
        seq = [int(t) for t in seq]  # numpy scalars of mixed kinds, int subclasses
    try:
        return np.array(seq, dtype=np.int64)
    except OverflowError:  # beyond int64 either way
        raise InvalidArgumentError("token ids must be in [0, 2**31 - 1]") from None


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
    return _chain(KEY_VERSION + ns, raw, block_tokens * 4, n_blocks, extras)


def _chain(prev: bytes, raw: bytes, step: int, n_blocks: int,
           extras: Sequence[bytes] | None = None, first: int = 0) -> list[bytes]:
    """Keys of blocks `first .. n_blocks - 1` of `raw` (`step` bytes each), chained from `prev`
    (the key of block `first - 1`, or `KEY_VERSION + namespace` for block 0).

    The loop is what costs (512 blocks: ~1.2 ms, of which ~0.45 ms is SHA-256 itself and the
    rest hashlib's per-object overhead), so it slices a memoryview (no copies) and binds names
    locally.
    """
    sha256 = hashlib.sha256
    view = memoryview(raw)
    keys: list[bytes] = []
    append = keys.append
    for i in range(first, n_blocks):
        h = sha256(prev)
        h.update(view[i * step : (i + 1) * step])
        if extras is not None:
            h.update(extras[i])
        prev = h.digest()
        append(prev)
    return keys


class KeyCache:
    """The keys of a few recent prompts of one namespace, so a prompt is hashed once.

    An engine looks a prompt up, then fetches it, then publishes it, and the next turn of a
    chat extends it: each call needs the same chained keys (512 SHA-256 blocks for 128k
    tokens). A prompt whose tokens start with a cached prompt's (or are a prefix of one) reuses
    those keys and hashes only the blocks past them. Reuse is exact: the token bytes are
    compared in full with the cached ones (never by a digest of them), and a key depends only
    on the namespace, fixed per cache, and those bytes, so a cached key is the key
    `chain_keys` would compute. Bounded by `max_entries` prompts and `max_bytes` of tokens;
    least recently used first out. Safe to share between threads.
    """

    def __init__(self, namespace: bytes, block_tokens: int, max_entries: int = 16,
                 max_bytes: int = 32 << 20) -> None:
        if len(namespace) != KEY_BYTES:
            raise InvalidArgumentError(f"a namespace digest is {KEY_BYTES} bytes, "
                                       f"got {len(namespace)}")
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise InvalidArgumentError(f"block_tokens must be a positive int, got {block_tokens!r}")
        self._start = KEY_VERSION + namespace
        self.block_tokens = block_tokens
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: list[tuple[bytes, list[bytes]]] = []  # (token bytes, keys); newest last
        self._lock = threading.Lock()
        self.hits = self.misses = 0  # whole prompts found / prompts hashed (in part or whole)

    def keys(self, tokens: Sequence[int] | torch.Tensor | np.ndarray) -> list[bytes]:
        """`chain_keys(namespace, tokens, block_tokens)`, from the cache where it can."""
        arr = tokens_to_array(tokens)
        n_blocks = len(arr) // self.block_tokens
        if n_blocks == 0:
            return []
        # The tokens' bytes in place: a hit compares them without copying them out.
        view = np.ascontiguousarray(arr[: n_blocks * self.block_tokens]).data.cast("B")
        with self._lock:
            for i in range(len(self._entries) - 1, -1, -1):
                if self._entries[i][0].startswith(view):  # this prompt, or a prefix of one
                    cached_keys = self._entries[i][1]
                    self._entries.append(self._entries.pop(i))
                    self.hits += 1
                    return cached_keys[:n_blocks]
            self.misses += 1
            entries = list(self._entries)
        raw = view.tobytes()
        known: list[bytes] = []  # the keys of the longest cached prompt this one extends
        for cached_raw, cached_keys in entries:
            if len(cached_keys) > len(known) and raw.startswith(cached_raw):
                known = cached_keys
        step = self.block_tokens * 4
        keys = known + _chain(known[-1] if known else self._start, raw, step, n_blocks,
                              first=len(known))
        if len(raw) <= self.max_bytes:
            self._add(raw, keys)
        return keys[:]

    def _add(self, raw: bytes, keys: list[bytes]) -> None:
        with self._lock:
            # Cached prompts this one extends say nothing it does not: drop them.
            kept = [e for e in self._entries if not raw.startswith(e[0])]
            kept.append((raw, keys))
            while len(kept) > self.max_entries or sum(len(e[0]) for e in kept) > self.max_bytes:
                kept.pop(0)
            self._entries = kept

    def clear(self) -> None:
        with self._lock:
            self._entries = []


@dataclass(frozen=True)
class PrefixKeys:
    """A prompt's block keys computed ahead (by a `KeyChain`), given to a client call in place
    of the tokens: the client uses them as they are, without hashing, and refuses keys chained
    in another namespace or over other blocks. They name `num_tokens` tokens, whole blocks."""

    namespace: bytes
    """`Namespace.digest()` of the chain."""
    block_tokens: int
    keys: tuple[bytes, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.keys) * self.block_tokens

    def prefix(self, blocks: int) -> PrefixKeys:
        """The keys of the first `blocks` blocks."""
        return replace(self, keys=self.keys[:blocks])


class KeyChain:
    """The keys of one prompt that is looked up again and again or extended (an engine's
    request waiting to be scheduled, a session's next turn): each block is hashed once.

    Unlike `KeyCache`, it never converts the tokens it has seen: `keys(tokens)` compares them
    with the previous call's as lists (the same int objects compare by identity: ~0.15 ms for
    128k tokens, against ~10 ms to convert them for hashing) and, where those are a prefix of
    `tokens`, converts and hashes only the blocks past them. Any other tokens start the chain
    over, so a key never outlives the tokens it was computed from: they are keyed by
    `keys_of(tokens)`, which must give `chain_keys(namespace, tokens, block_tokens)` (default:
    that), e.g. a client's `keys`, whose `KeyCache` knows prompts other requests shared. One per
    prompt; not thread-safe.
    """

    def __init__(self, namespace: bytes, block_tokens: int,
                 keys_of: Callable[[Sequence[int]], list[bytes]] | None = None) -> None:
        if len(namespace) != KEY_BYTES:
            raise InvalidArgumentError(f"a namespace digest is {KEY_BYTES} bytes, "
                                       f"got {len(namespace)}")
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise InvalidArgumentError(f"block_tokens must be a positive int, got {block_tokens!r}")
        self.namespace = namespace
        self.block_tokens = block_tokens
        self._keys_of = keys_of
        self._tokens: list[int] = []  # the previous call's tokens (a copy: the caller's may change)
        self._keys: tuple[bytes, ...] = ()  # of their full blocks

    def keys(self, tokens: Sequence[int]) -> PrefixKeys:
        """The keys of the full blocks of `tokens`, as `chain_keys` computes them."""
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        seen, bt = self._tokens, self.block_tokens
        if len(tokens) == len(seen) and tokens == seen:
            return PrefixKeys(self.namespace, bt, self._keys)
        if not (seen and len(tokens) > len(seen) and tokens[: len(seen)] == seen):
            # Not an extension (or the first call): start over.
            self._keys = tuple(self._keys_of(tokens)) if self._keys_of is not None else ()
        known, n_blocks = len(self._keys), len(tokens) // bt
        if n_blocks > known:
            raw = tokens_to_array(tokens[known * bt : n_blocks * bt]).tobytes()
            prev = self._keys[-1] if self._keys else KEY_VERSION + self.namespace
            self._keys += tuple(_chain(prev, raw, bt * 4, n_blocks - known))
        self._tokens = list(tokens)
        return PrefixKeys(self.namespace, bt, self._keys[:n_blocks])
