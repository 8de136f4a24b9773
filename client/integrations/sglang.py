"""`KVStoreHiCache`: an L3 storage backend for SGLang's hierarchical cache (HiCache).

SGLang loads it with its dynamic backend mechanism:

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
            "module_path": "kvstore.client.integrations.sglang", "class_name": "KVStoreHiCache",
            "interface_v1": 1, "kvstore.target": "unix:///run/kv.sock"}'

`interface_v1` makes SGLang call the zero-copy interface (`batch_get_v1` / `batch_set_v1`):
pages move in one copy between the daemon's shared memory and SGLang's host memory pool, with no
staging tensor. Without it SGLang uses the older `batch_get` / `batch_set` on flat page tensors,
which work too (one more copy, SGLang's own).

Extra config keys of this backend (all optional): `kvstore.target`, `kvstore.token`,
`kvstore.deadline_s`, `kvstore.transfer`, `kvstore.tenant`, `kvstore.salt`, `kvstore.model`
(default: SGLang's served model name) and `kvstore.model_revision`.

Each SGLang page is one kvstore block, stored as `[layers, kv, page_size, heads, head_dim]`
whatever SGLang's host layout (`layer_first`, `page_first`, `page_first_direct`, `page_head`),
so ranks with different host layouts share blocks. The block's key is derived from SGLang's page
key (already a hash chained over the prefix and SGLang's namespace) and the namespace of a
`KVLayout` built from the host pool and SGLang's storage config: TP and PP ranks are part of it,
so shards never mix. MLA's latent cache is the same on every TP rank: its layout names no TP
rank, every rank reads the same blocks and only the storage writer (`is_storage_writer`, TP rank
0) writes them.

Hybrid models' other host pools (Mamba states, sliding-window KV, indexer keys) go through
SGLang's v2 interface (`batch_exists_v2` / `batch_get_v2` / `batch_set_v2`), each page as a
block of bytes in a namespace of its pool's own (`kvstore.client.integrations.sglang_pools`).

A daemon that is down, slow or full is a miss within the client's deadline (`False` per page, 0
hits), never an exception into SGLang. Bad input (keys that are not strings, host indices that
do not match the keys, an unsupported host pool or parallel setup) raises `InvalidArgumentError`
naming what is wrong.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvstore.client.aio import AsyncKVClient, BlockCopy, Tokens
from kvstore.client.cli import DEFAULT_TARGET
from kvstore.client.integrations.settings import read_extra
from kvstore.client.integrations.sglang_pools import SidecarFormat, restorable, sidecar_layout
from kvstore.errors import InvalidArgumentError
from kvstore.layout import KVLayout

log = logging.getLogger("kvstore.sglang")
T = TypeVar("T")
KEY_VERSION = b"kvstore-sglang-page-v1\x00"

# Each host pool layout's page as `get_data_page(index, flat=False)` returns it (and as its flat
# page is ordered), axis by axis: k = K/V, L = layers, P = the page's tokens, H = heads,
# D = head_dim (MLA: the latent width), 1 = a unit page axis. MLA pools have no K/V axis.
_PAGE_AXES: dict[tuple[str, str], str] = {
    ("mha", "layer_first"): "kLPHD",
    ("mha", "page_first"): "kPLHD",
    ("mha", "page_first_direct"): "k1LPHD",
    ("mha", "page_head"): "k1HPLD",
    ("mla", "layer_first"): "LPHD",
    ("mla", "page_first"): "PLHD",
    ("mla", "page_first_direct"): "1LPHD",
}
_BLOCK_AXES = "LkPHD"  # kvstore's block: [layers, kv, block_tokens, heads, head_dim]


FP8_FORMATS = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
"""SGLang's fp8 KV cache dtypes and the kvstore dtype a block of each is stored as."""


def stored_dtype(pool_dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    """The dtype a host pool's pages are stored as: the pool's own, or for a pool of bytes
    (SGLang keeps an fp8 cache as uint8) the fp8 format `kv_cache_dtype` names. Bytes of an
    unnamed format are refused: an e4m3 engine's blocks must never load into an e5m2 one."""
    if pool_dtype.itemsize == 1 and not pool_dtype.is_floating_point:
        if kv_cache_dtype == "auto":
            raise InvalidArgumentError(
                f"the host pool holds {pool_dtype} bytes: an fp8 KV cache, whose format SGLang "
                f"does not give the backend; set kvstore.kv_cache_dtype to SGLang's "
                f"--kv-cache-dtype ({', '.join(FP8_FORMATS)})")
        return cast(torch.dtype, getattr(torch, FP8_FORMATS[kv_cache_dtype]))
    if kv_cache_dtype != "auto":
        raise InvalidArgumentError(f"kvstore.kv_cache_dtype is {kv_cache_dtype!r}, but the host "
                                   f"pool holds {pool_dtype}, not an fp8 cache's bytes")
    return pool_dtype


@dataclass(frozen=True)
class KVStoreHiCacheConfig:
    """This backend's settings: the `kvstore.*` keys of SGLang's storage extra config."""

    target: str = DEFAULT_TARGET
    token: str | None = None
    deadline_s: float = 1.0
    transfer: str = "auto"
    tenant: str = ""
    salt: str = ""
    model: str | None = None
    model_revision: str = ""
    kv_cache_dtype: str = "auto"
    """SGLang's `--kv-cache-dtype` where it is fp8 (`fp8_e4m3`, `fp8_e5m2`): the host pool
    holds such a cache as bytes (uint8) and says nothing of the format, so the backend is
    told it, and blocks of the two formats never mix. Required for a 1-byte host pool."""

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> KVStoreHiCacheConfig:
        cfg = cls(**read_extra(cls, extra, "HiCache", InvalidArgumentError))
        if cfg.kv_cache_dtype not in ("auto", *FP8_FORMATS):
            raise InvalidArgumentError(f"kvstore.kv_cache_dtype must be auto or one of "
                                       f"{', '.join(FP8_FORMATS)}, got {cfg.kv_cache_dtype!r}")
        if not cfg.deadline_s > 0:
            raise InvalidArgumentError(f"kvstore.deadline_s must be positive, got "
                                       f"{cfg.deadline_s}")
        if cfg.transfer not in ("auto", "shm", "stream"):
            raise InvalidArgumentError(f"kvstore.transfer must be auto, shm or stream, got "
                                       f"{cfg.transfer!r}")
        return cfg


class PageKeys(tuple[str, ...]):
    """SGLang page keys in place of a prompt's tokens: one kvstore block per key."""


class _PageKeyClient(AsyncKVClient):
    """An `AsyncKVClient` whose blocks are named by SGLang's page keys instead of by tokens.

    SGLang's key of a page is already a hash chained over the prefix, so each block's kvstore
    key is that key in this client's namespace: `SHA256(KEY_VERSION || namespace || key)`.
    """

    def keys(self, tokens: Tokens) -> list[bytes]:
        if not isinstance(tokens, PageKeys):
            raise InvalidArgumentError("this client takes SGLang page keys (PageKeys), "
                                       "not tokens")
        prefix = KEY_VERSION + self.namespace.digest()
        return [hashlib.sha256(prefix + key.encode()).digest() for key in tokens]


class PageFormat:
    """Where a page of an SGLang host pool is, as a view in kvstore's block order."""

    def __init__(self, pool: Any) -> None:
        names = {cls.__name__ for cls in type(pool).__mro__}
        if "MLATokenToKVPoolHost" in names:
            kind, heads, dim = "mla", 1, int(pool.kv_cache_dim)
        elif "MHATokenToKVPoolHost" in names and "AsymmetricMHATokenToKVPoolHost" not in names:
            kind, heads, dim = "mha", int(pool.head_num), int(pool.head_dim)
            if int(pool.v_head_dim) != dim:
                raise InvalidArgumentError(f"the kvstore HiCache backend needs K and V of one "
                                           f"width, got {dim} and {pool.v_head_dim}")
        else:
            raise InvalidArgumentError(f"the kvstore HiCache backend supports SGLang's MHA and "
                                       f"MLA host pools, got {type(pool).__name__}")
        axes = _PAGE_AXES.get((kind, pool.layout))
        if axes is None:
            supported = sorted(layout for k, layout in _PAGE_AXES if k == kind)
            raise InvalidArgumentError(f"the kvstore HiCache backend supports the {supported} "
                                       f"host layouts for {kind.upper()}, got {pool.layout!r}")
        if getattr(pool, "kv_buffer", None) is None:
            raise InvalidArgumentError("the host pool has no KV buffer (an allocator-only pool)")
        if getattr(pool, "storage_format_tag", None) or int(getattr(pool, "dcp_size", 1)) != 1:
            raise InvalidArgumentError("the kvstore HiCache backend does not support host pools "
                                       "with their own storage format or decode context "
                                       "parallelism")
        self.pool = pool
        self.kind = kind
        self.page_size = int(pool.page_size)
        self.size = int(pool.size)
        sizes = {"k": 2, "L": int(pool.layer_num), "P": self.page_size, "H": heads, "D": dim,
                 "1": 1}
        self.axes = axes
        self.shape = tuple(sizes[a] for a in axes)
        self.dtype: torch.dtype = pool.dtype
        self.block_shape = (sizes["L"], 2 if kind == "mha" else 1, self.page_size, heads, dim)
        self.numel = math.prod(self.block_shape)
        got = tuple(self.page(0).shape)
        if got != self.block_shape:  # SGLang changed its layout under this table
            raise InvalidArgumentError(f"unexpected {pool.layout} page shape {got}, expected "
                                       f"{self.block_shape}")

    def _as_block(self, t: torch.Tensor) -> torch.Tensor:
        axes = self.axes
        if "1" in axes:
            t, axes = t.squeeze(axes.index("1")), axes.replace("1", "")
        if "k" not in axes:
            t, axes = t.unsqueeze(0), "k" + axes
        return t.permute(*(axes.index(a) for a in _BLOCK_AXES))

    def raw(self, block: torch.Tensor) -> torch.Tensor:
        """A block view of the daemon's memory as the pool's dtype: an fp8 block (stored as its
        format) read as the pool's bytes, bit for bit; other blocks as they are."""
        return block if block.dtype == self.dtype else block.view(self.dtype)

    def page(self, index: int) -> torch.Tensor:
        """The page starting at host index `index`: a view into the pool, in block order."""
        return self._as_block(self.pool.get_data_page(index, flat=False))

    def flat(self, data: torch.Tensor, *, writable: bool) -> torch.Tensor:
        """A flat page tensor (`get_data_page(i)`, `get_dummy_flat_data_page()`) in block
        order; `writable`: a view of `data` itself (it must then be contiguous)."""
        if not isinstance(data, torch.Tensor):
            raise InvalidArgumentError(f"a page must be a torch.Tensor, got {type(data).__name__}")
        if data.dtype != self.dtype or data.numel() != self.numel:
            raise InvalidArgumentError(f"a page must hold {self.numel} {self.dtype} values, got "
                                       f"{data.numel()} {data.dtype}")
        if writable and not data.is_contiguous():
            raise InvalidArgumentError("a page to read into must be contiguous")
        return self._as_block(data.reshape(self.shape))

    def starts(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[int]:
        """The host index of each key's page; checks that they match."""
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1:
            raise InvalidArgumentError("host_indices must be a 1-D tensor")
        if host_indices.numel() != len(keys) * self.page_size:
            raise InvalidArgumentError(f"{len(keys)} keys need {len(keys) * self.page_size} "
                                       f"host indices (page size {self.page_size}), got "
                                       f"{host_indices.numel()}")
        starts = [int(i) for i in host_indices[:: self.page_size].tolist()]
        bad = [s for s in starts if s % self.page_size or not 0 <= s <= self.size - self.page_size]
        if bad:
            raise InvalidArgumentError(f"host indices {bad[:4]} do not start pages of the host "
                                       f"pool (page size {self.page_size}, size {self.size})")
        return starts


def _page_by_page(copy_one: Callable[[int, torch.Tensor], object]) -> BlockCopy:
    """A fetch or publish callback that copies block by block with `copy_one(block, view)`
    (`view`: the block in the daemon's arena), stopping between blocks when told to; returns
    how many it copied in full."""

    def copy(blocks: list[int], views: list[torch.Tensor], stop: threading.Event) -> int:
        for done, (block, view) in enumerate(zip(blocks, views, strict=True)):
            if stop.is_set():
                return done
            copy_one(block, view)
        return len(blocks)

    return copy


def _sidecar_copy(fmt: SidecarFormat, starts: list[int],
                  into_pool: bool) -> Callable[[int, torch.Tensor], object]:
    """`copy_one` for `_page_by_page`: a sidecar page between the host pool (at `starts`) and
    the block's view in the daemon's memory, one way or the other."""
    def copy_one(block: int, view: torch.Tensor) -> object:
        if into_pool:
            fmt.write(starts[block], view)
            return None
        return view.reshape(-1).copy_(fmt.read(starts[block]))
    return copy_one


def _check_keys(keys: Sequence[str]) -> PageKeys:
    if isinstance(keys, str) or not all(isinstance(k, str) and k for k in keys):
        raise InvalidArgumentError("keys must be a list of non-empty strings")
    return PageKeys(keys)


def _tokens(pages: PageKeys) -> Tokens:
    """Page keys where the client's API takes tokens: `_PageKeyClient.keys` turns them into
    block keys (the client has no call that takes block keys; see docs/ENGINES.md)."""
    return cast(Tokens, pages)


class KVStoreHiCache(HiCacheStorage):
    """SGLang HiCache storage backed by a kvstore daemon (see the module docstring).

    SGLang's dynamic loader constructs it as `KVStoreHiCache(storage_config, kwargs)` and then
    hands it the host pool (`register_mem_pool_host`); until then every call is a miss.
    """

    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: dict[str, Any] | None = None) -> None:
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise InvalidArgumentError(f"storage_config must be SGLang's HiCacheStorageConfig, "
                                       f"got {type(storage_config).__name__}")
        sc = storage_config
        if sc.attn_cp_size != 1 or getattr(sc, "dcp_size", 1) != 1 or sc.should_split_heads:
            raise InvalidArgumentError("the kvstore HiCache backend does not support attention "
                                       "context parallelism or heterogeneous TP head splits")
        self.config = KVStoreHiCacheConfig.from_extra(sc.extra_config)
        self.model = self.config.model or sc.model_name
        if not self.model:
            raise InvalidArgumentError("no model name: SGLang passed none, set kvstore.model")
        self.storage_config = sc
        self.is_mla = bool(sc.is_mla_model)
        self.is_writer = bool(getattr(sc, "is_storage_writer", not self.is_mla or sc.tp_rank == 0))
        self.layout: KVLayout | None = None
        self._format: PageFormat | None = None
        self._client: _PageKeyClient | None = None
        # The sidecar pools of a hybrid model (`register_mem_host_pool_v2`), by pool name.
        self._sidecars: dict[str, tuple[_PageKeyClient, SidecarFormat]] = {}
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="kvstore-hicache")
        self._thread.start()

    # ---- setup
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        fmt = PageFormat(mem_pool_host)
        sc = self.storage_config
        # MLA's latent cache is replicated across TP ranks: one set of blocks for all of them.
        tp_rank, tp_size = (0, 1) if self.is_mla else (sc.tp_rank, sc.tp_size)
        layout = KVLayout(model=self.model, model_revision=self.config.model_revision,
                          num_layers=fmt.block_shape[0], num_kv_heads=fmt.block_shape[3],
                          head_dim=fmt.block_shape[4],
                          dtype=stored_dtype(fmt.dtype, self.config.kv_cache_dtype),
                          block_tokens=fmt.page_size, kv_kind="mla" if self.is_mla else "kv",
                          tp_rank=tp_rank, tp_size=tp_size, pp_rank=sc.pp_rank,
                          pp_size=sc.pp_size)
        client = self._page_client(layout)
        old, self._client = self._client, client
        super().register_mem_pool_host(mem_pool_host)
        self.layout, self._format = layout, fmt
        if old is not None:
            self._run(old.close(), None)
        log.info("kvstore HiCache backend: %s, layout %s", self.config.target, layout.to_dict())

    def _page_client(self, layout: KVLayout) -> _PageKeyClient:
        return _PageKeyClient(self.config.target, layout, salt=self.config.salt,
                              tenant=self.config.tenant, token=self.config.token,
                              deadline_s=self.config.deadline_s,
                              transfer=cast(Literal["auto", "shm", "stream"],
                                            self.config.transfer))

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A hybrid model's other host pools (Mamba states, a sliding window's KV, indexer
        keys): each page stored as a block of its bytes, in a namespace of the pool's own
        (`sglang_pools`). The KV pool itself comes through `register_mem_pool_host`."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == PoolName.KV.value:
            return
        if self.layout is None:
            raise InvalidArgumentError("register the KV host pool (register_mem_pool_host) "
                                       "before its sidecar pools")
        fmt = SidecarFormat(host_pool, name)
        sc = self.storage_config
        layout = sidecar_layout(self.layout, fmt, sc.tp_rank, sc.tp_size)
        old = self._sidecars.get(name)
        self._sidecars[name] = (self._page_client(layout), fmt)
        if old is not None:
            self._run(old[0].close(), None)
        log.info("kvstore HiCache backend: pool %s, %d-byte pages", name, fmt.page_bytes)

    def _run(self, coro: Coroutine[Any, Any, T], miss: T) -> T:
        if self._closed:
            coro.close()
            return miss
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:  # the client keeps its deadline itself; this only guards a wedged loop
            return future.result(timeout=self.config.deadline_s * 4 + 5)
        except TimeoutError:
            future.cancel()
            return miss

    def _ready(self) -> tuple[_PageKeyClient, PageFormat] | None:
        if self._client is None or self._format is None:
            return None
        return self._client, self._format

    # ---- the zero-copy interface
    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of `keys`, from the first, are stored."""
        pages = _check_keys(keys)
        ready = self._ready()
        if ready is None or not pages:
            return 0
        client, fmt = ready
        return self._run(client.lookup(_tokens(pages)), 0) // fmt.page_size

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Copy the stored pages of `keys` straight into the host pool at `host_indices`;
        True for each page loaded (a prefix of `keys`)."""
        pages = _check_keys(keys)
        ready = self._ready()
        if ready is None:
            return [False] * len(pages)
        client, fmt = ready
        starts = fmt.starts(pages, host_indices)

        consume = _page_by_page(lambda block, view: fmt.page(starts[block]).copy_(fmt.raw(view)))
        loaded = self._run(client.fetch_with(_tokens(pages), consume), 0) // fmt.page_size
        return [i < loaded for i in range(len(pages))]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Copy the host pool's pages at `host_indices` straight into the daemon; True for each
        page now stored. An MLA rank that is not the storage writer stores nothing (the writer
        stores the same bytes) and reports success."""
        pages = _check_keys(keys)
        ready = self._ready()
        if ready is None:
            return [False] * len(pages)
        client, fmt = ready
        starts = fmt.starts(pages, host_indices)
        if not self.is_writer:
            return [True] * len(pages)

        produce = _page_by_page(lambda block, view: fmt.raw(view).copy_(fmt.page(starts[block])))
        stored = self._run(client.publish_with(_tokens(pages), produce), 0) // fmt.page_size
        return [i < stored for i in range(len(pages))]

    # ---- v2: the KV pool and a hybrid model's sidecar pools
    def _sidecar(self, name: str) -> tuple[_PageKeyClient, SidecarFormat]:
        entry = self._sidecars.get(name)
        if entry is None:
            raise InvalidArgumentError(f"no host pool {name!r} was registered "
                                       "(register_mem_host_pool_v2)")
        return entry

    def _writes(self, fmt: SidecarFormat) -> bool:
        """Whether this rank stores the pool's pages: an MLA model's KV-derived pools are the
        same on every rank, written by the storage writer (as its KV pages); a pool split
        over ranks (Mamba) by each."""
        return self.is_writer or fmt.tp_sharded

    def _starts(self, fmt: SidecarFormat, pages: PageKeys, host_indices: Any) -> list[int] | None:
        """The pages' host indices, or None (logged) when they do not match the keys: SGLang's
        controller expects such a transfer to move nothing, as its own backends do."""
        try:
            return fmt.starts(pages, host_indices)
        except InvalidArgumentError as e:
            log.warning("kvstore HiCache backend: transfer skipped: %s", e)
            return None

    def _kv_v2(self, v1: Callable[..., list[bool]], pages: PageKeys, t: PoolTransfer,
               extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        """A `kv` transfer of a v2 call through the v1 path; host indices that do not match
        its keys move nothing (logged), as for the sidecar pools."""
        try:
            return v1(list(pages), t.host_indices, extra_info)
        except InvalidArgumentError as e:
            log.warning("kvstore HiCache backend: kv transfer skipped: %s", e)
            return [False] * len(pages)

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None,
                        ) -> PoolTransferResult:
        """The longest prefix of `keys` the KV pool and every sidecar pool can restore
        together, under each pool's hit policy (`sglang_pools.restorable`)."""
        pages = _check_keys(keys)
        kv_pages = self.batch_exists(list(pages), extra_info)
        hits: dict[str, int] = {PoolName.KV.value: kv_pages} if kv_pages else {}
        ok = set(range(1, kv_pages + 1))
        for t in pool_transfers or ():
            if not ok:
                break
            name, policy = str(t.name), str(getattr(t.hit_policy, "value", t.hit_policy))
            if policy == PoolHitPolicy.BLOCK_GROUPS.value:
                continue  # never gates the KV hit (SGLang's PoolHitPolicy): no verdict
            client, _ = self._sidecar(name)
            prefix = PageKeys(pages[:kv_pages])
            if policy == PoolHitPolicy.ALL_PAGES.value:
                stored = self._run(client.lookup(_tokens(prefix)), 0)
                can = restorable(kv_pages, policy, 0, stored, [])
            else:
                held = self._run(client.held(_tokens(prefix)), [False] * kv_pages)
                can = restorable(kv_pages, policy, len(t.keys or ()), 0, held)
            if can:
                hits[name] = max(can)
            ok &= can
        done = sorted(ok)
        return PoolTransferResult(done[-1] if done else 0, hits, done)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Each transfer's stored pages copied into its host pool; per pool, True for each
        page loaded (a prefix of its keys)."""
        return self._move_v2(transfers, extra_info, store=False)

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Each transfer's host pages stored; per pool, True for each page now stored."""
        return self._move_v2(transfers, extra_info, store=True)

    def _move_v2(self, transfers: list[PoolTransfer],
                 extra_info: HiCacheStorageExtraInfo | None, store: bool) -> dict[str, list[bool]]:
        """`batch_set_v2` (`store`) or `batch_get_v2`: a `kv` transfer through the v1 path,
        a sidecar pool's page by page between its host pool and the daemon."""
        results: dict[str, list[bool]] = {}
        for t in transfers:
            name, pages = str(t.name), _check_keys(t.keys or [])
            if name == PoolName.KV.value:
                v1 = self.batch_set_v1 if store else self.batch_get_v1
                results[name] = self._kv_v2(v1, pages, t, extra_info)
                continue
            client, fmt = self._sidecar(name)
            starts = self._starts(fmt, pages, t.host_indices)
            if starts is None:
                results[name] = [False] * len(pages)
                continue
            if store and not self._writes(fmt):
                results[name] = [True] * len(pages)
                continue
            copy = _page_by_page(_sidecar_copy(fmt, starts, into_pool=not store))
            moved = self._run(client.publish_with(_tokens(pages), copy) if store
                              else client.fetch_with(_tokens(pages), copy), 0)
            results[name] = [i < moved for i in range(len(pages))]
        return results

    # ---- the older interface: flat page tensors in the host pool's page order
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any | None = None,
            target_sizes: Any | None = None) -> torch.Tensor | None:
        targets = None if target_location is None else [target_location]
        return self.batch_get([key], targets)[0]

    def batch_get(self, keys: list[str], target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> list[torch.Tensor | None]:
        """Each stored page of `keys` copied into its target (a flat page tensor, as SGLang's
        `get_dummy_flat_data_page()` makes; allocated here when None); None past the first
        miss."""
        pages = _check_keys(keys)
        ready = self._ready()
        if ready is None:
            return [None] * len(pages)
        client, fmt = ready
        if target_locations is None:
            targets = [fmt.pool.get_dummy_flat_data_page() for _ in pages]
        else:
            targets = list(target_locations)
        if len(targets) != len(pages):
            raise InvalidArgumentError(f"{len(pages)} keys but {len(targets)} target pages")
        views = [fmt.flat(t, writable=True) for t in targets]

        consume = _page_by_page(lambda block, view: views[block].copy_(fmt.raw(view)))
        loaded = self._run(client.fetch_with(_tokens(pages), consume), 0) // fmt.page_size
        return [t if i < loaded else None for i, t in enumerate(targets)]

    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any | None = None,
                  target_locations: Any | None = None, target_sizes: Any | None = None) -> bool:
        """Store flat pages (`get_data_page(i)` of the host pool); True when all are stored."""
        pages = _check_keys(keys)
        if values is None or len(values) != len(pages):
            raise InvalidArgumentError(f"{len(pages)} keys need as many page tensors in `values`")
        ready = self._ready()
        if ready is None:
            return False
        client, fmt = ready
        views = [fmt.flat(v, writable=False) for v in values]
        if not self.is_writer:
            return True

        produce = _page_by_page(lambda block, view: fmt.raw(view).copy_(views[block]))
        stored = self._run(client.publish_with(_tokens(pages), produce), 0) // fmt.page_size
        return stored == len(pages)

    # ---- management
    def clear(self) -> None:
        """Remove this backend's blocks (its namespaces: model, layout, rank, tenant, salt;
        the sidecar pools' too)."""
        ready = self._ready()
        if ready is not None:
            self._run(ready[0].clear(), 0)
        for client, _ in self._sidecars.values():
            self._run(client.clear(), 0)

    def close(self) -> None:
        if self._closed:
            return
        for client in [self._client, *(c for c, _ in self._sidecars.values())]:
            if client is not None:
                self._run(client.close(), None)
        self._closed = True  # from here on every call is a miss
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()
