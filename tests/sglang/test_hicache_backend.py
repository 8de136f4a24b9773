"""The kvstore HiCache storage backend against SGLang's own classes and a real daemon.

SGLang's serving path does not run here (no GPU, and its CPU path needs AMX), so these tests
drive the backend the way SGLang's cache controller does: created by SGLang's
`StorageBackendFactory` from a `HiCacheStorageConfig` (the `dynamic` backend with module path
and class name in the extra config), handed SGLang's host memory pool (`MHATokenToKVPoolHost`,
`MLATokenToKVPoolHost`, built from SGLang's device pools on CPU tensors), called with page keys
from SGLang's own page hash. Run in the SGLang venv: `bash scripts/setup_sglang.sh &&
.venv-sglang/bin/python -m pytest tests/sglang -m sglang`.
"""

from __future__ import annotations

import importlib.util
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import same_bytes
from tests.reliability import Worker

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed in this interpreter: run `bash scripts/setup_sglang.sh`, "
                "then `.venv-sglang/bin/python -m pytest tests/sglang -m sglang`",
                allow_module_level=True)

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

from kvstore import InvalidArgumentError, KVLayout
from kvstore.client import KVClient
from kvstore.client.integrations.sglang import KVStoreHiCache

pytestmark = [pytest.mark.sglang, pytest.mark.integration]
PAGE = 16
LAYERS, HEADS, HEAD_DIM = 2, 2, 16  # MHA: 256 B per token in bf16, 4 KiB pages
LORA_RANK, ROPE_DIM = 24, 8  # MLA: a 32-wide latent
DTYPE = torch.bfloat16
MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
DOWN_BOUND_S = 3.0  # a call against a dead or stalled daemon, with deadline_s=0.5


def mha_pool(layout: str, seed: int, dtype: torch.dtype = DTYPE) -> MHATokenToKVPoolHost:
    """SGLang's MHA host pool for a CPU device pool of `dtype` (an fp8 one's host pool holds
    uint8), as its pool assembler builds it, filled with random bytes (`seed`)."""
    device = MHATokenToKVPool(256, PAGE, dtype, HEADS, HEAD_DIM, LAYERS, "cpu", False,
                              start_layer=0, end_layer=LAYERS)
    with host_memory_budget_scope(1 << 30):  # book against this, not the machine's free RAM
        pool = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0,
                                    PAGE, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=device.size,
                                    start_layer=device.start_layer, end_layer=device.end_layer)
    return _fill(pool, seed)


def mla_pool(layout: str, seed: int) -> MLATokenToKVPoolHost:
    device = MLATokenToKVPool(256, PAGE, DTYPE, LORA_RANK, ROPE_DIM, LAYERS, "cpu", False,
                              start_layer=0, end_layer=LAYERS)
    with host_memory_budget_scope(1 << 30):
        pool = MLATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE,
                                    layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=device.size,
                                    start_layer=device.start_layer,
                                    end_layer=device.end_layer, target_layer_num=LAYERS,
                                    override_kv_cache_dim=device.kv_cache_dim)
    return _fill(pool, seed)


def _fill(pool: Any, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    if pool.kv_buffer.dtype == torch.uint8:  # an fp8 cache's bytes: every value
        pool.kv_buffer.copy_(torch.randint(0, 256, pool.kv_buffer.shape, generator=g,
                                           dtype=torch.uint8))
    else:
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(DTYPE))
    return pool


def token_kv(pool: Any, index: int) -> torch.Tensor:
    """The KV of the token at host index `index` as `[kv, layers, heads, dim]`, read from the
    pool's buffer by the dimensions SGLang's `init_kv_buffer` gives each layout (independent
    of the backend's own page views)."""
    b = pool.kv_buffer
    page, t = divmod(index, pool.page_size)
    if isinstance(pool, MLATokenToKVPoolHost):  # [L, size, 1, D] [size, L, 1, D] [n, L, P, 1, D]
        x = {"layer_first": lambda: b[:, index], "page_first": lambda: b[index],
             "page_first_direct": lambda: b[page, :, t]}[pool.layout]()
        return x.unsqueeze(0)
    if pool.layout == "layer_first":  # [2, L, size, H, D]
        return b[:, :, index]
    if pool.layout == "page_first":  # [2, size, L, H, D]
        return b[:, index]
    if pool.layout == "page_first_direct":  # [2, pages, L, P, H, D]
        return b[:, page, :, t]
    return b[:, page, :, t].transpose(1, 2)  # page_head: [2, pages, H, P, L, D]


def same_pages(a: Any, a_starts: list[int], b: Any, b_starts: list[int]) -> list[bool]:
    """Per page: every token's KV in pool `a` equals, byte for byte, that in pool `b`."""
    return [all(same_bytes(token_kv(a, sa + t), token_kv(b, sb + t)) for t in range(PAGE))
            for sa, sb in zip(a_starts, b_starts, strict=True)]


def page_keys(n: int, seed: int = 0) -> list[str]:
    """SGLang's own page keys (its chained page hash) for a prompt of `n` pages."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32000, (n * PAGE,), generator=g).tolist()
    keys = get_hash_str(tokens, page_size=PAGE)
    assert len(keys) == n
    return keys


def starts_of(indices: torch.Tensor) -> list[int]:
    return indices[::PAGE].tolist()


def storage_config(target: str, *, mla: bool = False, tp: tuple[int, int] = (0, 1),
                   pp: tuple[int, int] = (0, 1), **extra: Any) -> HiCacheStorageConfig:
    """What SGLang's cache controller builds (`_generate_storage_config`), with the extra config
    a user passes in `--hicache-storage-backend-extra-config`."""
    return HiCacheStorageConfig(
        tp_rank=tp[0], tp_size=tp[1], pp_rank=pp[0], pp_size=pp[1], attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
        is_page_first_layout=False, model_name="tiny-llama",
        extra_config={"backend_name": "kvstore",
                      "module_path": "kvstore.client.integrations.sglang",
                      "class_name": "KVStoreHiCache", "interface_v1": 1,
                      "kvstore.target": target, **extra})


@pytest.fixture
def make_backend() -> Iterator[Callable[..., KVStoreHiCache]]:
    """SGLang's attach sequence: the factory's dynamic backend, then the host pool."""
    made: list[KVStoreHiCache] = []

    def make(cfg: HiCacheStorageConfig, pool: Any) -> KVStoreHiCache:
        backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
        backend.register_mem_pool_host(pool)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def stored_blocks(target: str) -> int:
    layout = KVLayout(model="stats-probe", num_layers=1, num_kv_heads=1, head_dim=8)
    with KVClient(target, layout) as c:
        stats = c.stats()
        assert stats is not None
        return stats.stored_blocks


# ---- loading and configuration


def test_dynamic_backend_is_loaded_by_sglangs_factory(daemon, make_backend) -> None:
    pool = mha_pool("layer_first", seed=1)
    backend = make_backend(storage_config(daemon.target, tp=(1, 2), pp=(1, 4)), pool)
    assert type(backend) is KVStoreHiCache and isinstance(backend, HiCacheStorage)
    # TP and PP ranks come from SGLang's storage config; the shape from its host pool.
    assert backend.layout is not None
    assert backend.layout.to_dict() == {
        "model": "tiny-llama", "model_revision": "", "num_layers": LAYERS,
        "num_kv_heads": HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16", "block_tokens": PAGE,
        "kv_kind": "kv", "tp_rank": 1, "tp_size": 2, "pp_rank": 1, "pp_size": 4}
    mla = make_backend(storage_config(daemon.target, mla=True, tp=(1, 2)),
                       mla_pool("page_first", seed=1))
    assert mla.layout is not None and mla.layout.kv_kind == "mla"
    assert (mla.layout.num_kv_heads, mla.layout.head_dim) == (1, LORA_RANK + ROPE_DIM)
    assert (mla.layout.tp_rank, mla.layout.tp_size) == (0, 1)  # replicated: one set for all ranks
    assert not mla.is_writer  # SGLang's is_storage_writer: TP rank 0 only


@pytest.mark.parametrize(("extra", "message"), [
    ({"kvstore.targt": "x"}, "unknown kvstore HiCache settings"),
    ({"kvstore.deadline_s": -1}, "deadline_s must be positive"),
    ({"kvstore.deadline_s": "soon"}, "deadline_s must be a number"),
    ({"kvstore.transfer": "rdma"}, "transfer must be auto, shm or stream"),
    ({"kvstore.kv_cache_dtype": "int8"}, "kv_cache_dtype must be auto or one of"),
])
def test_bad_extra_config_is_refused_at_start(extra: dict, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        StorageBackendFactory.create_backend("dynamic", storage_config("unix:///x", **extra),
                                             None)


def test_unsupported_setups_are_refused_with_a_reason(daemon) -> None:
    cfg = storage_config(daemon.target)
    cfg.attn_cp_size = 2
    with pytest.raises(InvalidArgumentError, match="context parallelism"):
        KVStoreHiCache(cfg)
    nameless = storage_config(daemon.target)
    nameless.model_name = None
    with pytest.raises(InvalidArgumentError, match=r"set kvstore\.model"):
        KVStoreHiCache(nameless)
    backend = KVStoreHiCache(storage_config(daemon.target))
    try:
        with pytest.raises(InvalidArgumentError, match="MHA and MLA host pools"):
            backend.register_mem_pool_host(object())
        pool = mha_pool("page_first", seed=1)
        pool.layout = "page_unified"
        with pytest.raises(InvalidArgumentError, match="host layouts for MHA"):
            backend.register_mem_pool_host(pool)
        # Before a pool is registered every call is a miss, not an error.
        assert backend.batch_exists(page_keys(2)) == 0
        assert backend.batch_get_v1(page_keys(2), torch.arange(2 * PAGE)) == [False, False]
    finally:
        backend.close()


# ---- fp8 caches: SGLang's host pool holds their bytes as uint8 and names no format


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_fp8_pages_round_trip_under_their_declared_format_only(daemon, make_backend,
                                                               layout: str) -> None:
    e4m3 = {"kvstore.kv_cache_dtype": "fp8_e4m3"}
    writer_pool = mha_pool(layout, seed=1, dtype=torch.float8_e4m3fn)
    reader_pool = mha_pool(layout, seed=2, dtype=torch.float8_e4m3fn)
    assert writer_pool.dtype == torch.uint8  # what SGLang gives the backend
    writer = make_backend(storage_config(daemon.target, **e4m3), writer_pool)
    reader = make_backend(storage_config(daemon.target, **e4m3), reader_pool)
    assert writer.layout is not None and writer.layout.dtype_name == "float8_e4m3fn"
    keys, src, dst = page_keys(3, seed=5), writer_pool.alloc(3 * PAGE), reader_pool.alloc(3 * PAGE)
    assert writer.batch_set_v1(keys, src) == [True] * 3
    assert reader.batch_get_v1(keys, dst) == [True] * 3
    assert same_pages(writer_pool, starts_of(src), reader_pool, starts_of(dst)) == [True] * 3
    # An e5m2 engine of the same model reads the same bytes as other numbers: never served.
    e5m2 = make_backend(storage_config(daemon.target, **{"kvstore.kv_cache_dtype": "fp8_e5m2"}),
                        mha_pool(layout, seed=3, dtype=torch.float8_e5m2))
    assert e5m2.batch_exists(keys) == 0


def test_an_fp8_pool_needs_its_format_named(daemon) -> None:
    backend = KVStoreHiCache(storage_config(daemon.target))
    try:
        with pytest.raises(InvalidArgumentError, match=r"set kvstore\.kv_cache_dtype"):
            backend.register_mem_pool_host(mha_pool("layer_first", 1, torch.float8_e5m2))
    finally:
        backend.close()
    declared = KVStoreHiCache(storage_config(daemon.target,
                                             **{"kvstore.kv_cache_dtype": "fp8_e4m3"}))
    try:
        with pytest.raises(InvalidArgumentError, match="not an fp8 cache"):
            declared.register_mem_pool_host(mha_pool("layer_first", 1))
    finally:
        declared.close()


# ---- the zero-copy interface: byte-identical round trips


@pytest.mark.parametrize("transfer", ["auto", "stream"])
@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_mha_round_trip_is_byte_identical(daemon, make_backend, layout: str,
                                          transfer: str) -> None:
    writer_pool, reader_pool = mha_pool(layout, seed=1), mha_pool(layout, seed=2)
    writer = make_backend(storage_config(daemon.target, **{"kvstore.transfer": transfer}),
                          writer_pool)
    reader = make_backend(storage_config(daemon.target, **{"kvstore.transfer": transfer}),
                          reader_pool)
    keys = page_keys(5)
    src = writer_pool.alloc(5 * PAGE)
    reader_pool.alloc(3 * PAGE)  # the reader's pages land elsewhere in its pool
    dst = reader_pool.alloc(5 * PAGE)
    assert not any(same_pages(writer_pool, starts_of(src), reader_pool, starts_of(dst)))

    assert writer.batch_set_v1(keys, src) == [True] * 5
    assert reader.batch_exists(keys) == 5
    info = HiCacheStorageExtraInfo(prefix_keys=[])  # what SGLang's controller passes
    assert reader.batch_get_v1(keys, dst, info) == [True] * 5
    assert same_pages(writer_pool, starts_of(src), reader_pool, starts_of(dst)) == [True] * 5
    # ... and to SGLang's own flat page accessor
    for s, d in zip(starts_of(src), starts_of(dst), strict=True):
        assert same_bytes(writer_pool.get_data_page(s), reader_pool.get_data_page(d))


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_mla_round_trip_is_byte_identical(daemon, make_backend, layout: str) -> None:
    writer_pool, reader_pool = mla_pool(layout, seed=1), mla_pool(layout, seed=2)
    writer = make_backend(storage_config(daemon.target, mla=True, tp=(0, 2)), writer_pool)
    reader = make_backend(storage_config(daemon.target, mla=True, tp=(1, 2)), reader_pool)
    keys, src, dst = page_keys(4), writer_pool.alloc(4 * PAGE), reader_pool.alloc(4 * PAGE)
    assert writer.batch_set_v1(keys, src) == [True] * 4
    assert reader.batch_get_v1(keys, dst) == [True] * 4
    assert same_pages(writer_pool, starts_of(src), reader_pool, starts_of(dst)) == [True] * 4


@pytest.mark.parametrize("reader_layout", ["page_first", "page_first_direct", "page_head"])
def test_blocks_are_shared_across_host_layouts(daemon, make_backend, reader_layout: str) -> None:
    """A block is stored in kvstore's layout, not SGLang's: a rank whose host pool has another
    layout reads the same KV."""
    writer_pool, reader_pool = mha_pool("layer_first", seed=1), mha_pool(reader_layout, seed=2)
    writer = make_backend(storage_config(daemon.target), writer_pool)
    reader = make_backend(storage_config(daemon.target), reader_pool)
    keys, src, dst = page_keys(3), writer_pool.alloc(3 * PAGE), reader_pool.alloc(3 * PAGE)
    assert writer.batch_set_v1(keys, src) == [True] * 3
    assert reader.batch_get_v1(keys, dst) == [True] * 3
    assert same_pages(writer_pool, starts_of(src), reader_pool, starts_of(dst)) == [True] * 3


def test_batch_exists_counts_the_leading_hits(daemon, make_backend) -> None:
    pool = mha_pool("page_first", seed=1)
    backend = make_backend(storage_config(daemon.target), pool)
    keys = page_keys(6)
    src = pool.alloc(6 * PAGE)
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys[:4], src[: 4 * PAGE]) == [True] * 4
    assert backend.batch_exists(keys) == 4
    assert backend.batch_exists(keys[:2]) == 2
    assert backend.batch_exists(keys[4:]) == 0
    assert backend.batch_exists([keys[0], keys[5], keys[1]]) == 1  # stops at the first miss
    assert backend.exists(keys[3]) and not backend.exists(keys[4])

    # A load of all six: the stored prefix lands, the rest of the pages are left as they were.
    other = mha_pool("page_first", seed=2)
    reader = make_backend(storage_config(daemon.target), other)
    dst = other.alloc(6 * PAGE)
    before = [other.get_data_page(d).clone() for d in starts_of(dst)]
    assert reader.batch_get_v1(keys, dst) == [True] * 4 + [False] * 2
    assert same_pages(pool, starts_of(src)[:4], other, starts_of(dst)[:4]) == [True] * 4
    assert all(same_bytes(other.get_data_page(d), b)
               for d, b in zip(starts_of(dst)[4:], before[4:], strict=True))


def test_ranks_and_stages_never_mix(daemon, make_backend) -> None:
    """MHA heads are sharded by TP rank and layers by PP stage: each has its own blocks."""
    keys = page_keys(2)
    pools = {rank: mha_pool("layer_first", seed=i) for i, rank in enumerate(("tp0", "tp1", "pp1"))}
    backends = {
        "tp0": make_backend(storage_config(daemon.target, tp=(0, 2)), pools["tp0"]),
        "tp1": make_backend(storage_config(daemon.target, tp=(1, 2)), pools["tp1"]),
        "pp1": make_backend(storage_config(daemon.target, tp=(0, 2), pp=(1, 2)), pools["pp1"]),
    }
    src = pools["tp0"].alloc(2 * PAGE)
    assert backends["tp0"].batch_set_v1(keys, src) == [True, True]
    assert backends["tp0"].batch_exists(keys) == 2
    assert backends["tp1"].batch_exists(keys) == 0
    assert backends["pp1"].batch_exists(keys) == 0


def test_mla_is_written_by_one_rank_and_read_by_all(daemon, make_backend) -> None:
    keys = page_keys(3)
    pools = [mla_pool("page_first", seed=rank + 1) for rank in range(3)]
    ranks = [make_backend(storage_config(daemon.target, mla=True, tp=(rank, 3)), pools[rank])
             for rank in range(3)]
    assert [r.is_writer for r in ranks] == [True, False, False]
    indices = [pool.alloc(3 * PAGE) for pool in pools]
    before = stored_blocks(daemon.target)

    # Ranks 1 and 2 back up the same pages (SGLang's controller skips them too): nothing is
    # written, so their own (here: different) bytes can never reach the store.
    assert ranks[1].batch_set_v1(keys, indices[1]) == [True] * 3
    assert ranks[2].set(keys[0], pools[2].get_data_page(starts_of(indices[2])[0]))
    assert ranks[0].batch_exists(keys) == 0
    assert stored_blocks(daemon.target) == before

    assert ranks[0].batch_set_v1(keys, indices[0]) == [True] * 3
    assert ranks[0].batch_set_v1(keys, indices[0]) == [True] * 3  # stored once, not twice
    assert stored_blocks(daemon.target) == before + 3
    for rank in (1, 2):
        assert ranks[rank].batch_exists(keys) == 3
        assert ranks[rank].batch_get_v1(keys, indices[rank]) == [True] * 3
        assert same_pages(pools[0], starts_of(indices[0]), pools[rank],
                          starts_of(indices[rank])) == [True] * 3


def test_prefetch_and_backup_threads_share_one_backend(daemon, make_backend) -> None:
    """SGLang's controller calls one backend from its prefetch and backup threads at once, both
    on the one host pool it registered."""
    pool = mha_pool("page_first", seed=1)
    backend = make_backend(storage_config(daemon.target), pool)
    prompts = [page_keys(4, seed=i) for i in range(4)]
    src = [pool.alloc(4 * PAGE) for _ in prompts]
    assert backend.batch_set_v1(prompts[0], src[0]) == [True] * 4
    loads: list[list[bool]] = []

    def backup() -> None:
        for keys, idx in zip(prompts[1:], src[1:], strict=True):
            assert backend.batch_set_v1(keys, idx) == [True] * 4

    def prefetch() -> None:
        for _ in range(6):
            dst = pool.alloc(4 * PAGE)
            loads.append(backend.batch_get_v1(prompts[0], dst))
            assert same_pages(pool, starts_of(src[0]), pool, starts_of(dst)) == [True] * 4
            pool.free(dst)

    workers = [Worker(target=backup), Worker(target=prefetch)]
    for w in workers:
        w.start()
    for w in workers:
        w.result(timeout=60)
    assert loads == [[True] * 4] * 6
    assert [backend.batch_exists(keys) for keys in prompts] == [4] * 4


# ---- the older interface (flat pages, SGLang's `_generic_page_get/set`)


@pytest.mark.parametrize("layout", ["layer_first", "page_head"])
def test_flat_page_interface_round_trips(daemon, make_backend, layout: str) -> None:
    pool, other = mha_pool(layout, seed=1), mha_pool(layout, seed=2)
    backend = make_backend(storage_config(daemon.target, interface_v1=0), pool)
    reader = make_backend(storage_config(daemon.target, interface_v1=0), other)
    keys, src, dst = page_keys(3), pool.alloc(3 * PAGE), other.alloc(3 * PAGE)
    # SGLang's _generic_page_set: flat pages from get_data_page
    assert backend.batch_set(keys[:2], [pool.get_data_page(s) for s in starts_of(src)[:2]])
    assert backend.set(keys[2], pool.get_data_page(starts_of(src)[2]))
    assert backend.exists(keys[2])
    # SGLang's _generic_page_get: into dummy flat pages, then set_from_flat_data_page
    pages = reader.batch_get(keys, [other.get_dummy_flat_data_page() for _ in keys])
    assert all(p is not None for p in pages)
    for d, page in zip(starts_of(dst), pages, strict=True):
        other.set_from_flat_data_page(d, page)
    assert same_pages(pool, starts_of(src), other, starts_of(dst)) == [True] * 3
    # One page, target allocated by the backend; and pages written through the v1 interface
    one = reader.get(keys[1])
    assert one is not None and same_bytes(one, pool.get_data_page(starts_of(src)[1]))
    assert reader.get(page_keys(1, seed=9)[0]) is None
    assert reader.batch_get(page_keys(2, seed=9)) == [None, None]


def test_bad_input_raises_a_clear_error(daemon, make_backend) -> None:
    pool = mha_pool("page_first", seed=1)
    backend = make_backend(storage_config(daemon.target), pool)
    keys, idx = page_keys(2), pool.alloc(2 * PAGE)
    with pytest.raises(InvalidArgumentError, match="2 keys need 32 host indices"):
        backend.batch_get_v1(keys, idx[:PAGE])
    with pytest.raises(InvalidArgumentError, match="do not start pages"):
        backend.batch_set_v1(keys, idx + 1)
    with pytest.raises(InvalidArgumentError, match="list of non-empty strings"):
        backend.batch_exists([b"raw-bytes"])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match="must hold"):
        backend.set(keys[0], torch.zeros(7, dtype=DTYPE))


# ---- a daemon that is down or stalled is a miss within the deadline


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    began = time.monotonic()
    result = fn()
    return result, time.monotonic() - began


def test_no_daemon_is_a_miss(tmp_path: Path, make_backend) -> None:
    pool = mha_pool("page_first", seed=1)
    backend = make_backend(storage_config(f"unix://{tmp_path}/absent.sock",
                                          **{"kvstore.deadline_s": 0.5}), pool)
    keys, idx = page_keys(3), pool.alloc(3 * PAGE)
    before = [pool.get_data_page(s).clone() for s in starts_of(idx)]
    calls = {
        "batch_exists": (lambda: backend.batch_exists(keys), 0),
        "batch_get_v1": (lambda: backend.batch_get_v1(keys, idx), [False] * 3),
        "batch_set_v1": (lambda: backend.batch_set_v1(keys, idx), [False] * 3),
        "exists": (lambda: backend.exists(keys[0]), False),
        "get": (lambda: backend.get(keys[0]), None),
        "set": (lambda: backend.set(keys[0], before[0]), False),
    }
    for name, (call, miss) in calls.items():
        result, took = timed(call)
        assert result == miss, name
        assert took < DOWN_BOUND_S, f"{name} took {took:.2f} s"
    assert all(same_bytes(pool.get_data_page(s), b)
               for s, b in zip(starts_of(idx), before, strict=True))


def test_daemon_killed_or_stalled_is_a_miss_then_recovers(daemon, make_backend) -> None:
    pool, other = mha_pool("page_first", seed=1), mha_pool("page_first", seed=2)
    cfg = storage_config(daemon.target, **{"kvstore.deadline_s": 0.5})
    writer, reader = make_backend(cfg, pool), make_backend(cfg, other)
    keys, src, dst = page_keys(3), pool.alloc(3 * PAGE), other.alloc(3 * PAGE)
    assert writer.batch_set_v1(keys, src) == [True] * 3

    daemon.proc.send_signal(signal.SIGSTOP)  # alive but answering nothing
    try:
        for call, miss in ((lambda: reader.batch_exists(keys), 0),
                           (lambda: reader.batch_get_v1(keys, dst), [False] * 3)):
            result, took = timed(call)
            assert result == miss
            assert took < DOWN_BOUND_S, f"took {took:.2f} s"
    finally:
        daemon.proc.send_signal(signal.SIGCONT)

    daemon.kill()
    for call, miss in ((lambda: reader.batch_exists(keys), 0),
                       (lambda: reader.batch_get_v1(keys, dst), [False] * 3),
                       (lambda: writer.batch_set_v1(keys, src), [False] * 3)):
        result, took = timed(call)
        assert result == miss
        assert took < DOWN_BOUND_S, f"took {took:.2f} s"
    assert not any(same_pages(pool, starts_of(src), other, starts_of(dst)))

    daemon.start()  # the same backends reconnect, each after its own backoff
    deadline = time.monotonic() + 15
    while writer.batch_set_v1(keys, src) != [True] * 3:
        assert time.monotonic() < deadline, "the writer did not reconnect within 15 s"
        time.sleep(0.2)
    while reader.batch_get_v1(keys, dst) != [True] * 3:
        assert time.monotonic() < deadline, "the reader did not reconnect within 15 s"
        time.sleep(0.2)
    assert same_pages(pool, starts_of(src), other, starts_of(dst)) == [True] * 3


@pytest.mark.sglang
def test_page_by_page_stops_between_pages_and_says_how_many_it_copied():
    """Every copy callback of the backend (get/set, zero-copy or not): told to stop, it stops
    at the next page and reports the pages copied in full, so a fetch keeps exactly those and
    a publish commits no page it did not write."""
    from kvstore.client.integrations.sglang import _page_by_page

    stop = threading.Event()
    copied: list[int] = []

    def copy_one(block: int, view: torch.Tensor) -> None:
        copied.append(block)
        if len(copied) == 2:
            stop.set()  # a deadline passes during the second page

    views = [torch.zeros(4) for _ in range(5)]
    assert _page_by_page(copy_one)([3, 4, 5, 6, 7], views, stop) == 2
    assert copied == [3, 4]
    stop.clear()
    assert _page_by_page(copy_one)([8, 9], views[:2], stop) == 2  # unstopped: all of them
