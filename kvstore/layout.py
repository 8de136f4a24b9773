"""`KVLayout`: everything that decides the bytes of a KV-cache block.

A block's payload is one contiguous buffer `[num_layers, kv, block_tokens, num_kv_heads,
head_dim]` (kv = 2 for K and V, 1 for an MLA latent). Two layouts that differ in any field
produce different bytes, so the layout's digest is part of every key's namespace and of every
framed payload: a block is never read back under another layout.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvstore.errors import InvalidArgumentError, LayoutMismatchError

if TYPE_CHECKING:
    import torch

# Only dtypes with a stable, engine-independent byte representation, with their sizes. Kept
# free of torch so the daemon never imports it (start-up in well under a second).
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
DTYPES = DTYPE_BYTES  # the supported names

MAX_BLOCK_BYTES = 1 << 30  # 1 GiB: far above any real model's block; guards absurd layouts.
# Longest string field (`model`, `model_revision`, ...), in UTF-8 bytes: Linux's PATH_MAX, so
# any local path a model is loaded from fits, as do Hugging Face ids (at most 96 + 96
# characters) and revisions. A daemon keeps the layouts it is named (Inspect), so an unbounded
# string would let one call make it keep up to `max_message_bytes`.
MAX_STRING_BYTES = 4096


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical name of a supported dtype (`torch.bfloat16` or `"bfloat16"` -> `"bfloat16"`)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise InvalidArgumentError(f"unsupported dtype {dtype!r}; supported: {sorted(DTYPE_BYTES)}")
    return name


@dataclass(frozen=True, eq=False)
class KVLayout:
    """Shape and identity of the KV cache of one model shard.

    `model` and `model_revision` identify the weights: blocks of two revisions never mix.
    `kv_kind` is "kv" (separate K and V) or "mla" (one latent per token, `num_kv_heads == 1`).
    `tp_rank`/`tp_size` and `pp_rank`/`pp_size` identify the shard whose heads/layers these are.
    `dtype` is kept as given (a `torch.dtype` or its name); equality, hashing and the digest use
    its canonical name, and `torch_dtype` gives the torch one.
    """

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype | str = "bfloat16"
    block_tokens: int = 256
    model_revision: str = ""
    kv_kind: str = "kv"
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("model", "model_revision", "dtype", "kv_kind"):  # first: errors quote them
            value = getattr(self, name)
            if isinstance(value, str) and (
                    n := len(value.encode(errors="surrogatepass"))) > MAX_STRING_BYTES:
                raise InvalidArgumentError(f"KVLayout.{name} is {n} bytes; the limit is "
                                           f"{MAX_STRING_BYTES}")
        dtype_name(self.dtype)  # validates
        if not isinstance(self.model, str) or not self.model:
            raise InvalidArgumentError("KVLayout.model must be a non-empty string")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "tp_size",
                     "pp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(f"KVLayout.{name} must be a positive int, got {value!r}")
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
            r, s = getattr(self, rank), getattr(self, size)
            if not isinstance(r, int) or not 0 <= r < s:
                raise InvalidArgumentError(f"KVLayout.{rank} must be in [0, {size}), got {r!r}")
        if self.kv_kind not in ("kv", "mla"):
            raise InvalidArgumentError(
                f"KVLayout.kv_kind must be 'kv' or 'mla', got {self.kv_kind!r}")
        if self.kv_kind == "mla" and self.num_kv_heads != 1:
            raise InvalidArgumentError("an MLA layout has num_kv_heads == 1 (one latent per token)")
        if self.block_bytes > MAX_BLOCK_BYTES:
            raise InvalidArgumentError(
                f"a block of this layout would be {self.block_bytes} bytes, over the "
                f"{MAX_BLOCK_BYTES}-byte limit; lower block_tokens")

    @property
    def kv_count(self) -> int:
        """2 for K and V, 1 for an MLA latent."""
        return 2 if self.kv_kind == "kv" else 1

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype_name]

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype_name)
        return dtype

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KVLayout):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(self.digest())

    @property
    def bytes_per_token(self) -> int:
        per_layer = self.kv_count * self.num_kv_heads * self.head_dim * self.dtype_bytes
        return self.num_layers * per_layer

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_tokens

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """`[num_layers, kv, block_tokens, num_kv_heads, head_dim]`."""
        return (self.num_layers, self.kv_count, self.block_tokens, self.num_kv_heads, self.head_dim)

    def kv_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of a prompt's KV for `num_tokens` tokens, as clients pass it."""
        return (self.num_layers, self.kv_count, num_tokens, self.num_kv_heads, self.head_dim)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["dtype"] = dtype_name(self.dtype)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise InvalidArgumentError(f"unknown KVLayout fields: {sorted(unknown)}")
        return cls(**d)

    def digest(self) -> bytes:
        """32-byte SHA-256 of the canonical JSON of every field: equal iff the bytes agree."""
        return _digest(json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")))

    def check_kv(self, kv: torch.Tensor, num_tokens: int) -> None:
        """Raise `LayoutMismatchError` naming what differs if `kv` is not this layout's KV."""
        import torch

        if not isinstance(kv, torch.Tensor):
            raise LayoutMismatchError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
        if kv.dtype != self.torch_dtype:
            raise LayoutMismatchError(
                f"kv dtype is {kv.dtype}, the layout says {self.torch_dtype}")
        want = self.kv_shape(num_tokens)
        if tuple(kv.shape) != want:
            raise LayoutMismatchError(
                f"kv shape is {tuple(kv.shape)}, expected {want} "
                "([num_layers, kv, num_tokens, num_kv_heads, head_dim])")


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()
