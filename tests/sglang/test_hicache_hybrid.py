"""The kvstore HiCache backend's v2 interface: a hybrid model's sidecar pools beside its KV.

SGLang's own classes on CPU: the KV host pool (`MHATokenToKVPoolHost`), a Mamba state pool
(`MambaPoolHost`, one state per page boundary a request resumes from: `trailing_pages`) and a
second MHA pool standing for a pool needed at every page (`all_pages`, as DeepSeek's indexer),
driven as SGLang's hybrid cache controller drives a backend (`PoolTransfer`s). The hit answers
are checked against SGLang's own file backend (`HiCacheFile`) given the same pages: the
contract is SGLang's, and its reference implementation says what it means.
Run in the SGLang venv: `make test-sglang`.
"""

from __future__ import annotations

import importlib.util
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import same_bytes

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed in this interpreter: run `bash scripts/setup_sglang.sh`, "
                "then `.venv-sglang/bin/python -m pytest tests/sglang -m sglang`",
                allow_module_level=True)

from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

from kvstore import InvalidArgumentError
from tests.sglang.test_hicache_backend import (
    PAGE,
    mha_pool,
    page_keys,
    same_pages,
    starts_of,
    storage_config,
)

pytestmark = [pytest.mark.sglang, pytest.mark.integration]
SLOTS = 8
N = 6  # pages in the prompt
# The Mamba states saved: at the ends of two cached nodes, after pages 2 and 5.
STATE_AT = (2, 5)
INDEXER = PoolName.INDEXER


def mamba_pool(seed: int, conv: torch.dtype = torch.bfloat16) -> MambaPoolHost:
    """SGLang's Mamba host pool over CPU state buffers (2 layers: an fp32 SSM state, a bf16
    conv state: 328 bytes a slot), filled with random values."""
    info = MambaStateBufferInfo(temporal=torch.zeros(2, SLOTS, 4, 8, dtype=torch.float32),
                                conv=(torch.zeros(2, SLOTS, 6, 3, dtype=conv),))
    with host_memory_budget_scope(1 << 30):
        pool = MambaPoolHost(info, 2.0, 0, device_capacity=SLOTS, pin_memory=False,
                             device="cpu", layout="page_first")
    g = torch.Generator().manual_seed(seed)
    for i in range(pool.size):
        pool.set_from_flat_data_page(i, torch.randint(0, 256, (pool.size_per_token,),
                                                      generator=g, dtype=torch.uint8))
    return pool


def mamba_transfer(keys: list[str], slots: list[int]) -> PoolTransfer:
    return PoolTransfer(name=PoolName.MAMBA, keys=keys, host_indices=torch.tensor(slots),
                        hit_policy=PoolHitPolicy.TRAILING_PAGES)


def stores(keys: list[str], src: torch.Tensor, idx_src: torch.Tensor,
           indexer_pages: int) -> list[list[PoolTransfer]]:
    """The writes of one prompt, as the controller issues them: KV pages, the Mamba state of
    each cached node's last page (host slot = the page count), the indexer's pages (only the
    first `indexer_pages`)."""
    return [
        [PoolTransfer(name=PoolName.KV, keys=keys, host_indices=src)],
        *([mamba_transfer([keys[p - 1]], [p])] for p in STATE_AT),
        [PoolTransfer(name=INDEXER, keys=keys[:indexer_pages],
                      host_indices=idx_src[: indexer_pages * PAGE])],
    ]


@pytest.fixture
def pools() -> tuple[Any, MambaPoolHost, Any]:
    return mha_pool("page_first", seed=1), mamba_pool(seed=2), mha_pool("layer_first", seed=3)


def attach(backend: Any, kv: Any, mamba: MambaPoolHost, indexer: Any) -> Any:
    """SGLang's attach: the KV pool, then each sidecar by name."""
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    backend.register_mem_host_pool_v2(indexer, INDEXER)
    return backend


def kvstore_backend(target: str, pools: tuple[Any, MambaPoolHost, Any]) -> Any:
    from kvstore.client.integrations.sglang import KVStoreHiCache

    return attach(KVStoreHiCache(storage_config(target)), *pools)


def file_backend(tmp_path: Path, pools: tuple[Any, MambaPoolHost, Any]) -> HiCacheFile:
    return attach(HiCacheFile(storage_config("unused"), file_path=str(tmp_path / "file")),
                  *pools)


def queries(keys: list[str], mamba_keys: int) -> list[list[PoolTransfer]]:
    """Existence queries: KV alone; with the Mamba state's trailing window; with the indexer
    (every page); with both; with a pool that never gates (`block_groups`)."""
    trailing = mamba_transfer(keys[:mamba_keys], list(range(mamba_keys)))
    every = PoolTransfer(name=INDEXER, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
    return [[], [trailing], [every], [trailing, every]]


@pytest.mark.parametrize("indexer_pages", [N, 3])
def test_hit_answers_are_sglangs_own(daemon, tmp_path, pools, indexer_pages: int) -> None:
    """For the same pages stored, `batch_exists_v2` answers exactly as SGLang's file backend:
    the usable prefix, each pool's own boundary and every restorable prefix length."""
    kv, _, indexer = pools
    keys = page_keys(N)
    src, idx_src = kv.alloc(N * PAGE), indexer.alloc(N * PAGE)
    ours, theirs = kvstore_backend(daemon.target, pools), file_backend(tmp_path, pools)
    try:
        for batch in stores(keys, src, idx_src, indexer_pages):
            for b in (ours, theirs):
                got = b.batch_set_v2(batch)
                assert all(all(v) for v in got.values()), (type(b).__name__, got)
        for prompt in (keys, keys[:4], keys + page_keys(2, seed=7)):
            for q in queries(prompt, 1):
                mine, ref = ours.batch_exists_v2(prompt, q), theirs.batch_exists_v2(prompt, q)
                assert (mine.kv_hit_pages, dict(mine.extra_pool_hit_pages),
                        mine.restorable_prefix_pages) == (
                    ref.kv_hit_pages, {str(k): v for k, v in ref.extra_pool_hit_pages.items()},
                    ref.restorable_prefix_pages), [str(t.name) for t in q]
        # What the answers are here, so the comparison above is not of two empty answers:
        both = ours.batch_exists_v2(keys, queries(keys, 1)[3])
        assert both.restorable_prefix_pages == [p for p in STATE_AT if p <= indexer_pages]
        assert both.kv_hit_pages == max(p for p in STATE_AT if p <= indexer_pages)
        block_groups = PoolTransfer(name=INDEXER, keys=keys,
                                    hit_policy=PoolHitPolicy.BLOCK_GROUPS)
        assert ours.batch_exists_v2(keys, [block_groups]).kv_hit_pages == N  # never gates
    finally:
        ours.close()


def test_sidecar_pages_round_trip_byte_for_byte(daemon, pools) -> None:
    """Mamba states and indexer pages written from one engine's pools are read into another's
    (other slots), byte for byte; an engine whose indexer pool has another host layout (its
    flat pages in another order) misses them instead of reading them scrambled."""
    kv, mamba, indexer = pools
    keys = page_keys(N)
    src, idx_src = kv.alloc(N * PAGE), indexer.alloc(N * PAGE)
    writer = kvstore_backend(daemon.target, pools)
    other = (mha_pool("page_first", seed=11), mamba_pool(seed=12),
             mha_pool("layer_first", seed=13))
    reader = kvstore_backend(daemon.target, other)
    elsewhere = kvstore_backend(daemon.target, (mha_pool("page_first", seed=21),
                                                mamba_pool(seed=22),
                                                mha_pool("page_head", seed=23)))
    try:
        for batch in stores(keys, src, idx_src, N):
            writer.batch_set_v2(batch)
        slots = [6, 7]
        dst = other[2].alloc(N * PAGE)
        got = reader.batch_get_v2([
            mamba_transfer([keys[p - 1] for p in STATE_AT], slots),
            PoolTransfer(name=INDEXER, keys=keys, host_indices=dst),
        ])
        assert got == {"mamba": [True, True], "indexer": [True] * N}
        for slot, p in zip(slots, STATE_AT, strict=True):
            assert same_bytes(other[1].get_data_page(slot), mamba.get_data_page(p))
        assert same_pages(indexer, starts_of(idx_src), other[2], starts_of(dst)) == [True] * N
        assert not same_bytes(mamba.get_data_page(1), other[1].get_data_page(1))  # (control)
        # A state never saved is a miss, not another page's bytes.
        assert reader.batch_get_v2([mamba_transfer([keys[0]], [5])]) == {"mamba": [False]}
        # Another host layout: the indexer's pages are not shared; the Mamba states are.
        every = PoolTransfer(name=INDEXER, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
        assert elsewhere.batch_exists_v2(keys, [every]).kv_hit_pages == 0
        assert elsewhere.batch_exists_v2(keys, queries(keys, 1)[1]).kv_hit_pages == STATE_AT[1]
    finally:
        writer.close()
        reader.close()
        elsewhere.close()


def test_pools_never_mix_and_bad_input_raises(daemon, pools) -> None:
    keys = page_keys(N)
    backend = kvstore_backend(daemon.target, pools)
    try:
        backend.batch_set_v2([mamba_transfer([keys[0]], [1])])
        # The Mamba page is not an indexer page of the same key, nor a KV page.
        assert backend.batch_exists_v2(keys[:1], [
            PoolTransfer(name=INDEXER, keys=keys[:1], hit_policy=PoolHitPolicy.ALL_PAGES),
        ]).kv_hit_pages == 0
        assert backend.batch_exists(keys[:1]) == 0
        with pytest.raises(InvalidArgumentError, match="no host pool 'swa'"):
            backend.batch_get_v2([PoolTransfer(name=PoolName.SWA, keys=keys[:1],
                                               host_indices=torch.arange(PAGE))])
        # Host indices that do not match the keys: nothing moves, as SGLang's controller
        # expects of a backend (it shrinks such a transfer before the call when it can).
        assert backend.batch_set_v2([mamba_transfer(keys[:1], [1, 2])]) == {"mamba": [False]}
        assert backend.batch_get_v2([mamba_transfer(keys[:1], [1, 2])]) == {"mamba": [False]}
        short = PoolTransfer(name=PoolName.KV, keys=keys[:2], host_indices=torch.arange(PAGE))
        assert backend.batch_set_v2([short]) == {"kv": [False, False]}  # the KV pool alike
    finally:
        backend.close()


def test_daemon_stopped_is_a_miss_not_an_error(daemon, pools) -> None:
    keys = page_keys(N)
    backend = kvstore_backend(daemon.target, pools)
    try:
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            assert backend.batch_set_v2([mamba_transfer(keys[:1], [1])]) == {"mamba": [False]}
            result = backend.batch_exists_v2(keys, queries(keys, 1)[1])
            assert (result.kv_hit_pages, result.restorable_prefix_pages) == (0, [])
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
    finally:
        backend.close()


def test_pools_whose_bytes_mean_other_things_never_share(daemon, pools) -> None:
    """Pages of one size whose bytes mean other numbers are not shared: an fp16 Mamba conv
    state is not a bf16 one (the same 328 bytes a slot), nor is a pool beside an fp8 e5m2 KV
    one beside e4m3 (the KV format names the sidecars' namespace too)."""
    kv, mamba, indexer = pools
    keys = page_keys(N)
    writer = kvstore_backend(daemon.target, pools)
    fp16 = kvstore_backend(daemon.target, (kv, mamba_pool(seed=5, conv=torch.float16),
                                           indexer))
    try:
        assert fp16._sidecars["mamba"][1].page_bytes == mamba.size_per_token
        writer.batch_set_v2([mamba_transfer([keys[1]], [2])])
        assert writer.batch_get_v2([mamba_transfer([keys[1]], [3])]) == {"mamba": [True]}
        assert fp16.batch_get_v2([mamba_transfer([keys[1]], [3])]) == {"mamba": [False]}
    finally:
        writer.close()
        fp16.close()
    from kvstore.client.integrations.sglang import KVStoreHiCache

    fp8 = {}
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        fp8[fmt] = attach(KVStoreHiCache(storage_config(daemon.target, **{
            "kvstore.kv_cache_dtype": fmt})), mha_pool("page_first", 1, torch.float8_e4m3fn),
            mamba_pool(seed=6), indexer)
    try:
        fp8["fp8_e4m3"].batch_set_v2([mamba_transfer([keys[1]], [2])])
        assert fp8["fp8_e5m2"].batch_get_v2([mamba_transfer([keys[1]], [2])]) == {
            "mamba": [False]}
    finally:
        for b in fp8.values():
            b.close()


def test_a_pool_split_over_ranks_beside_an_mla_model_is_refused(daemon) -> None:
    """SGLang backs an MLA model's pools up from TP rank 0 only; an MHA draft pool beside it
    holds each rank's own heads, which the other ranks could then never find: refused at
    attach, saying why. At TP 1 there is no other rank: taken."""
    from kvstore.client.integrations.sglang import KVStoreHiCache
    from tests.sglang.test_hicache_backend import mla_pool

    for tp, refused in (((1, 2), True), ((0, 1), False)):
        backend = KVStoreHiCache(storage_config(daemon.target, mla=True, tp=tp))
        try:
            backend.register_mem_pool_host(mla_pool("page_first", seed=1))
            draft = mha_pool("page_first", seed=2)
            if refused:
                with pytest.raises(InvalidArgumentError, match="split over TP ranks beside an "
                                                               "MLA model"):
                    backend.register_mem_host_pool_v2(draft, PoolName.DRAFT)
            else:
                backend.register_mem_host_pool_v2(draft, PoolName.DRAFT)
            backend.register_mem_host_pool_v2(mamba_pool(seed=3), PoolName.MAMBA)  # every rank
        finally:
            backend.close()
