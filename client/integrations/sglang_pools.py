"""The sidecar pools of SGLang's hybrid models, for `KVStoreHiCache`'s v2 interface.

A hybrid model keeps, beside its KV pool, pools of other state that a cached prefix needs too:
Mamba's SSM and conv states (one per page boundary a request can resume from), a sliding-window
attention pool, DeepSeek's indexer keys. SGLang hands each to the storage backend by name
(`register_mem_host_pool_v2`) and moves them with `PoolTransfer`s (`batch_exists_v2`,
`batch_get_v2`, `batch_set_v2`).

Each page of a sidecar pool is one kvstore block holding the page's bytes exactly as the host
pool's flat page gives them (`get_data_page(i, flat=True)`, read back with
`set_from_flat_data_page`), in a namespace of its own (`sidecar_layout`): the KV layout's
identity (its fp8 format too), the pool's name, host layout and a signature of what its bytes
mean (class, dtypes, state shapes) are part of it, so pools never mix with each other or with
the KV pool, and an engine whose pool orders or encodes its pages otherwise misses rather
than reading its bytes as something else. (Unlike KV pages, which are stored in one order
whatever the layout and shared across layouts, a sidecar's page is opaque here.)

Hit policies (`PoolHitPolicy`), as SGLang's own file backend applies them: `all_pages` needs
every page of the KV prefix in the pool; `trailing_pages` needs only the last N pages before
the prefix's end (a Mamba state is saved where a cached node ends, not at every page); the
answer is the set of prefix lengths every pool can restore (`restorable`), its largest the hit.
`block_groups` (DeepSeek V4's compressed pools) reports no verdict: SGLang says such a pool
never gates the KV hit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from kvstore.errors import InvalidArgumentError
from kvstore.layout import KVLayout

# Pools whose state is split over tensor-parallel ranks even in an MLA model, whose latent KV
# (and what derives from it) every rank holds whole. MHA host pools (a draft model's KV, a
# sliding window's) are split by heads too, whatever their name.
TP_SHARDED_POOLS = frozenset({"mamba"})
# What a pool's page bytes mean, beyond their count: two pools that differ in any of these
# never share a page (an fp16 Mamba state is not a bf16 one of the same size).
_SIGNATURE_ATTRS = ("dtype", "conv_dtype", "temporal_dtype", "conv_state_shapes",
                    "temporal_state_shape", "num_mamba_layers", "layer_num", "head_num",
                    "head_dim", "v_head_dim", "kv_cache_dim", "page_size")


def _signature(pool: Any) -> str:
    parts = [type(pool).__name__]
    for name in _SIGNATURE_ATTRS:
        value = getattr(pool, name, None)
        if value is not None and not callable(value):
            parts.append(f"{name}={value}")
    return hashlib.sha256(";".join(parts).encode()).hexdigest()[:16]


class SidecarFormat:
    """A sidecar host pool's pages as bytes."""

    def __init__(self, pool: Any, name: str) -> None:
        for method in ("get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page"):
            if not callable(getattr(pool, method, None)):
                raise InvalidArgumentError(f"the {name!r} host pool ({type(pool).__name__}) has "
                                           f"no {method}: the kvstore HiCache backend cannot "
                                           "store its pages")
        dummy = pool.get_dummy_flat_data_page()
        if not isinstance(dummy, torch.Tensor) or dummy.numel() == 0:
            raise InvalidArgumentError(f"the {name!r} host pool's flat page is not a tensor")
        self.pool = pool
        self.name = name
        self.dtype = dummy.dtype
        self.page_bytes = dummy.numel() * dummy.element_size()
        self.page_size = int(getattr(pool, "page_size", 1) or 1)
        self.size = int(getattr(pool, "size", 0) or 0)
        # The flat page's order is the host layout's: pools of other layouts never share.
        self.layout = str(getattr(pool, "layout", ""))
        self.signature = _signature(pool)
        mro = {cls.__name__ for cls in type(pool).__mro__}
        self.tp_sharded = name in TP_SHARDED_POOLS or bool(
            mro & {"MHATokenToKVPoolHost", "MHATokenToKOnlyPoolHost"})

    def read(self, index: int) -> torch.Tensor:
        """The page at host index `index` as bytes."""
        page: torch.Tensor = self.pool.get_data_page(index, flat=True).contiguous().view(
            torch.uint8)
        if page.numel() != self.page_bytes:
            raise InvalidArgumentError(f"the {self.name!r} pool's page at {index} has "
                                       f"{page.numel()} bytes, expected {self.page_bytes}")
        return page.reshape(-1)

    def write(self, index: int, data: torch.Tensor) -> None:
        """Put a page's bytes (`read`'s) back at host index `index`."""
        self.pool.set_from_flat_data_page(index, data.reshape(-1).view(self.dtype))

    def starts(self, keys: Sequence[str], host_indices: Any) -> list[int]:
        """The host index of each key's page; checks that they match."""
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1:
            raise InvalidArgumentError(f"{self.name}: host_indices must be a 1-D tensor")
        if host_indices.numel() != len(keys) * self.page_size:
            raise InvalidArgumentError(f"{self.name}: {len(keys)} keys need "
                                       f"{len(keys) * self.page_size} host indices (page size "
                                       f"{self.page_size}), got {host_indices.numel()}")
        starts = [int(i) for i in host_indices[:: self.page_size].tolist()]
        bad = [s for s in starts if s < 0 or s % self.page_size
               or (self.size and s > self.size - self.page_size)]
        if bad:
            raise InvalidArgumentError(f"{self.name}: host indices {bad[:4]} do not start pages "
                                       f"of the host pool (page size {self.page_size}, size "
                                       f"{self.size})")
        return starts


def sidecar_layout(kv: KVLayout, fmt: SidecarFormat, tp_rank: int, tp_size: int) -> KVLayout:
    """The namespace of a sidecar pool's blocks: the KV layout's identity (model, revision,
    stored dtype: an fp8 format too, stage), the pool's name, host layout and what its bytes
    mean (`_signature`), and the TP rank for a pool split over ranks (`tp_rank`, `tp_size`;
    others as the KV layout has it). A page's bytes are in its host layout's order, so
    engines whose pools differ in any of these never share a page.

    An MLA model's KV names no TP rank and SGLang backs its pools up from TP rank 0 only, so a
    pool split over ranks beside it (an MHA draft model's) could be written by rank 0 alone and
    read by no other: refused (`InvalidArgumentError`), except Mamba, which every rank backs up."""
    if (fmt.tp_sharded and kv.kv_kind == "mla" and tp_size > 1
            and fmt.name not in TP_SHARDED_POOLS):
        raise InvalidArgumentError(f"the {fmt.name!r} pool is split over TP ranks beside an MLA "
                                   "model, whose pools SGLang backs up from TP rank 0 only: the "
                                   "kvstore HiCache backend cannot serve the other ranks' "
                                   "shards (run without it, or at TP 1)")
    model = (f"{kv.model}#kv={kv.dtype_name}#hicache-pool={fmt.name}#layout={fmt.layout}"
             f"#pool={fmt.signature}")
    sharded = fmt.tp_sharded
    return KVLayout(model=model, model_revision=kv.model_revision,
                    num_layers=1, num_kv_heads=1, head_dim=fmt.page_bytes, dtype="uint8",
                    block_tokens=1, kv_kind="mla",
                    tp_rank=tp_rank if sharded else kv.tp_rank,
                    tp_size=tp_size if sharded else kv.tp_size,
                    pp_rank=kv.pp_rank, pp_size=kv.pp_size)


def restorable(kv_pages: int, policy: str, trailing: int, prefix_pages: int,
               present: Sequence[bool]) -> set[int]:
    """The prefix lengths (1..`kv_pages`) a pool can restore under its hit `policy`:
    `all_pages` from the pool's stored prefix (`prefix_pages`), `trailing_pages` from which
    pages it holds (`present`, one per KV page) and its window (`trailing`)."""
    if policy == "all_pages":
        return set(range(1, min(prefix_pages, kv_pages) + 1))
    if policy == "trailing_pages":
        window = max(1, trailing)
        return {p for p in range(1, kv_pages + 1)
                if all(present[max(0, p - window):p])}
    raise InvalidArgumentError(f"unsupported pool hit policy {policy!r}")
