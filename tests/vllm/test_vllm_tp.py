"""Tensor parallel through the vLLM connector: the tiny random Llama (2 KV heads) at
tensor_parallel_size=2 on vLLM's CPU build, one core per worker (`VLLM_CPU_OMP_THREADS_BIND=
"0|1"`: vLLM's automatic binding wants one NUMA node per rank).

Each rank stores its own shard (1 KV head) under a layout naming the parallel degree and the
rank (`MODEL#tp=2:rank=R`); the scheduler counts a block cached only when both ranks' shards
are. One engine computes the prompts cold and publishes them, then exits; a fresh engine loads
them from kvstore.

    .venv-vllm/bin/python -m pytest tests/vllm/test_vllm_tp.py -m vllm
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.server.process import DaemonProcess

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run `bash scripts/setup_vllm.sh`, "
                "then `.venv-vllm/bin/python -m pytest tests/vllm -m vllm`",
                allow_module_level=True)

from tests.vllm.test_vllm_connector import (
    BLOCK,
    MAX_TOKENS,
    Engine,
    assert_prefix_cache_bit_identical,
    assert_same_generation,
    expected_cached,
    fetched_blocks,
    hit_blocks,
    one_core_per_worker,
    small_daemon,
)
from tests.vllm.vllm_runner import corpus_ids, make_model

pytestmark = [pytest.mark.vllm, pytest.mark.integration]
TP = 2
PARTIAL = 9 * BLOCK + 12  # past its last full block: loads 9 blocks, computes 12 tokens
WHOLE = 8 * BLOCK  # whole blocks: loads all but the last token (a partial page)
PROMPTS = {"partial": (61, PARTIAL), "whole": (62, WHOLE)}  # name: (corpus seed, tokens)
MISSING = {"rank1-missing": (1, 63), "rank0-missing": (0, 64)}  # salt: (rank deleted, seed)
FLAKY = (65, PARTIAL)  # loaded by an engine whose rank 1 fetches come back short


def tp_opts() -> dict[str, Any]:
    return {"llm_kwargs": {"tensor_parallel_size": TP, "distributed_executor_backend": "mp"}}


@pytest.fixture(scope="module", autouse=True)
def one_core_per_rank() -> Iterator[None]:
    with one_core_per_worker(TP):
        yield


def rank_layout(model: Path, rank: int | None) -> Any:
    """The layout the connector derives for `rank`'s shard (`groups_for_vllm`), by hand; None:
    the TP=1 layout of the same model (all heads)."""
    import torch

    from kvstore.layout import KVLayout

    name = str(model) if rank is None else f"{model}#tp={TP}:rank={rank}"
    return KVLayout(model=name, num_layers=2, num_kv_heads=2 if rank is None else 2 // TP,
                    head_dim=64, dtype=torch.float32, block_tokens=BLOCK)


def fake_config(tp: int, pp: int = 1, kv_heads: int = 2) -> Any:
    """The parts of a `VllmConfig` `groups_for_vllm` reads: model "m" (float32) with
    `kv_heads` KV heads."""
    from types import SimpleNamespace

    import torch

    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
        model_config=SimpleNamespace(model="m", revision=None, dtype=torch.float32,
                                     hf_text_config=SimpleNamespace(
                                         rope_parameters={"rope_type": "yarn"}),
                                     get_total_num_kv_heads=lambda: kv_heads),
        compilation_config=SimpleNamespace(custom_ops=[]))


def fake_groups(spec: Any, layer_names: list[str] | None = None) -> Any:
    """A one-group `KVCacheConfig` of `spec` (layers 0 and 1 unless `layer_names`)."""
    from types import SimpleNamespace

    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(
        kv_cache_spec=spec,
        layer_names=layer_names or ["model.layers.0.attn", "model.layers.1.attn"])])


def full_spec(heads: int) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return fake_groups(FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=64,
                                         dtype=torch.float32))


def test_layouts_per_rank_and_refusals() -> None:
    """No engine: `groups_for_vllm` names the degree and rank at TP > 1 (a rank's share of the
    heads, as vLLM's spec counts them), leaves TP=1 layouts as they were, stores an MLA latent
    once at TP > 1 (one shard, every rank holds it, rank 0 saves it). Pipeline parallel:
    tests/vllm/test_vllm_pp.py."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from kvstore.client.integrations.vllm import (
        ConnectorConfig,
        groups_for_vllm,
    )

    cfg = ConnectorConfig()
    (one,) = groups_for_vllm(fake_config(1), full_spec(2), cfg)
    assert (one.layout.model, one.rank) == ("m", 0)
    assert [(s.layout, s.ranks) for s in one.all_shards] == [(one.layout, (0,))]
    for rank in range(TP):
        (g,) = groups_for_vllm(fake_config(TP), full_spec(1), cfg, rank)
        assert (g.layout.model, g.layout.num_kv_heads, g.rank) == (f"m#tp={TP}:rank={rank}", 1,
                                                                   rank)
        assert g.layout.digest() != one.layout.digest()
        assert [(s.layout.model, s.ranks) for s in g.all_shards] == [
            (f"m#tp={TP}:rank={r}", (r,)) for r in range(TP)]
        assert g.shards_of(rank) == [g.all_shards[rank]]
    mla = fake_groups(MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576,
                                       dtype=torch.float32))
    assert groups_for_vllm(fake_config(1), mla, cfg)[0].layout.kv_kind == "mla"
    for rank in range(TP):
        (g,) = groups_for_vllm(fake_config(TP), mla, cfg, rank)
        (shard,) = g.all_shards
        assert (shard.layout.model, shard.ranks, g.shards_of(rank)) == (f"m#tp={TP}",
                                                                        (0, 1), [shard])


def test_shared_model_stores_one_head_per_shard_at_any_degree() -> None:
    """`kvstore.shared_model`: the same shard layouts (one KV head each, named by the shared
    id, not the degree) at TP 1, 2 and 4 (4 > the 2 heads: each head replicated on two
    ranks, saved by the first); each rank holds the heads vLLM's QKVParallelLinear gives it.
    An MLA latent is one shard, held by every rank. Sharing is never the default."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from kvstore.client.integrations.vllm import (
        ConnectorConfig,
        ConnectorConfigError,
        groups_for_vllm,
    )

    cfg = ConnectorConfig.from_extra({"kvstore.shared_model": "llama"})
    want = [f"llama#kv-head={h}:of=2" for h in range(2)]
    layouts = set()
    for tp, local, holders in ((1, 2, [(0,), (0,)]), (2, 1, [(0,), (1,)]),
                               (4, 1, [(0, 1), (2, 3)])):
        for rank in range(tp):
            (g,) = groups_for_vllm(fake_config(tp), full_spec(local), cfg, rank)
            assert [s.layout.model for s in g.all_shards] == want
            assert [s.ranks for s in g.all_shards] == holders
            assert all(s.layout.num_kv_heads == 1 for s in g.all_shards)
            mine = g.shards_of(rank)
            assert [s.first_head for s in mine] == [g.first_head + i for i in range(local)]
            assert g.layout.num_kv_heads == local  # the rank's cache, as vLLM allocates it
            layouts |= {s.layout.digest() for s in g.all_shards}
    assert len(layouts) == 2  # the same two shard layouts at every degree
    (plain,) = groups_for_vllm(fake_config(1), full_spec(2), ConnectorConfig())
    assert not {s.layout.digest() for s in plain.all_shards} & layouts
    with pytest.raises(ConnectorConfigError, match="do not split the model's 2"):
        groups_for_vllm(fake_config(2), full_spec(2), cfg)  # 2 heads per rank of 2: wrong
    mla = fake_groups(MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576,
                                       dtype=torch.float32))
    for tp in (1, TP):
        (g,) = groups_for_vllm(fake_config(tp, kv_heads=1), mla, cfg)
        (shard,) = g.all_shards
        assert (shard.layout.model, shard.ranks) == ("llama", tuple(range(tp)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("vllm-tp") / "tiny-llama")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from small_daemon(tmp_path_factory, "vllm-tp")


@pytest.fixture(scope="module")
def cold(model_dir: Path, daemon: DaemonProcess,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One TP=2 engine computes every prompt cold (each rank publishing its shard), exits."""
    log = tmp_path_factory.mktemp("vllm-tp-log") / "cold.log"
    engine = Engine(model_dir, daemon.target, log=log, **tp_opts())
    try:
        runs = {name: engine.generate([corpus_ids(model_dir, seed, n)])
                for name, (seed, n) in PROMPTS.items()}
        for salt, (_, seed) in MISSING.items():
            runs[salt] = engine.generate([{"prompt_token_ids": corpus_ids(model_dir, seed,
                                                                          PARTIAL),
                                           "cache_salt": salt}])
        runs["flaky"] = engine.generate([corpus_ids(model_dir, *FLAKY)])
    finally:
        engine.close()
    text = log.read_text()
    for rank in range(TP):  # both workers ran the connector, each with its own shard
        assert f"TP rank {rank} of {TP}" in text and f"#tp={TP}:rank={rank}" in text, \
            text[-3000:]
    for run in runs.values():
        assert run["cached"] == [0]
    return runs


@pytest.fixture(scope="module")
def warm_engine(model_dir: Path, daemon: DaemonProcess, cold: dict[str, dict[str, Any]],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """A fresh TP=2 engine: nothing of the cold engine's is in it but what kvstore holds."""
    e = Engine(model_dir, daemon.target,
               log=tmp_path_factory.mktemp("vllm-tp-log") / "warm.log", **tp_opts())
    yield e
    e.close()


def test_each_rank_stores_its_shard(cold: dict[str, dict[str, Any]], daemon: DaemonProcess,
                                    model_dir: Path) -> None:
    """Both ranks' shards of a cold prompt are in the daemon, each under its rank's layout
    (1 KV head of the model's 2), every full block; nothing under the TP=1 layout (the
    default keeps parallel degrees apart)."""
    from kvstore.client import KVClient

    ids = corpus_ids(model_dir, *PROMPTS["partial"])
    for rank in range(TP):
        with KVClient(daemon.target, rank_layout(model_dir, rank)) as client:
            assert client.lookup(ids) == PARTIAL // BLOCK * BLOCK, rank
    with KVClient(daemon.target, rank_layout(model_dir, None)) as client:
        assert client.lookup(ids) == 0


@pytest.mark.timeout(900)  # two TP=2 engine starts (a minute or more each on 2 cores)
@pytest.mark.parametrize("name", ["partial", "whole"])
def test_fresh_engine_loads_both_shards_with_cold_logprobs(
        name: str, cold: dict[str, dict[str, Any]], warm_engine: Engine,
        daemon: DaemonProcess, model_dir: Path) -> None:
    """A fresh TP=2 engine loads the prompt from kvstore: vLLM reports the cached tokens, the
    daemon counts each block fetched twice (once per rank's shard), and the 16 greedy tokens
    and top-5 log-probabilities match the cold run's within LOGPROB_TOL. A second run is
    vLLM's own prefix cache: the same again."""
    seed, n = PROMPTS[name]
    ids = corpus_ids(model_dir, seed, n)
    cached = expected_cached(n)
    served = hit_blocks(daemon)
    warm = warm_engine.generate([ids])
    assert warm["cached"] == [cached], warm_engine.tail()
    assert hit_blocks(daemon) - served == TP * fetched_blocks(cached)
    assert len(warm["logprobs"][0]) == MAX_TOKENS
    assert_same_generation(warm, cold[name])
    again = warm_engine.generate([ids])  # vLLM's prefix cache (the blocks loaded before)
    assert again["cached"][0] >= n // BLOCK * BLOCK - BLOCK, warm_engine.tail()
    assert_same_generation(again, cold[name])
    if name == "partial":  # whole blocks: vLLM's own cache recomputes the last one
        assert_prefix_cache_bit_identical(warm, again)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("salt", sorted(MISSING))
def test_shard_missing_on_one_rank_is_a_miss(salt: str, cold: dict[str, dict[str, Any]],
                                             warm_engine: Engine, daemon: DaemonProcess,
                                             model_dir: Path) -> None:
    """The cold engine published both shards of a salted prompt; one rank's are deleted (its
    namespace cleared). The prompt is then a miss for the whole engine, however complete the
    other rank's shard is: nothing fetched, vLLM computes it, the cold run's output."""
    from kvstore.client import KVClient

    rank, seed = MISSING[salt]
    ids = corpus_ids(model_dir, seed, PARTIAL)
    with KVClient(daemon.target, rank_layout(model_dir, rank), salt=salt) as client:
        assert client.lookup(ids) == PARTIAL // BLOCK * BLOCK
        assert client.clear() > 0
        assert client.lookup(ids) == 0
    with KVClient(daemon.target, rank_layout(model_dir, 1 - rank), salt=salt) as client:
        assert client.lookup(ids) == PARTIAL // BLOCK * BLOCK  # the other shard is whole
    served = hit_blocks(daemon)
    out = warm_engine.generate([{"prompt_token_ids": ids, "cache_salt": salt}])
    assert out["cached"] == [0], warm_engine.tail()
    assert hit_blocks(daemon) == served
    assert_same_generation(out, cold[salt])


@pytest.mark.timeout(900)
def test_failed_load_on_one_rank_is_recomputed_on_all(cold: dict[str, dict[str, Any]],
                                                      model_dir: Path, daemon: DaemonProcess,
                                                      warm_engine: Engine) -> None:
    """Rank 1's fetches come back a block short, that block poisoned (NaN), rank 0's whole
    (tests/vllm/flaky_connector.py): the ranks agree on the shorter load, both report the
    same blocks failed, vLLM recomputes them on both ranks, and the output is the cold run's;
    no rank publishes what that step computed."""
    warm_engine.close()  # two TP=2 engines at once do not fit 2 cores
    engine = Engine(model_dir, daemon.target, connector="RankFlakyKVStoreConnector",
                    module="tests.vllm.flaky_connector", **tp_opts())
    try:
        served = hit_blocks(daemon)
        out = engine.generate([corpus_ids(model_dir, *FLAKY)])
        tail = engine.tail(400)
        assert hit_blocks(daemon) - served >= TP * (PARTIAL // BLOCK - 1)
        assert "on TP rank 0 of 2, another rank only" in tail, tail
        assert "vLLM recomputes the rest" in tail, tail
        assert_same_generation(out, cold["flaky"])
    finally:
        engine.close()


# ---- a hybrid model at TP=2: KV-cache groups x ranks
HYBRID_PROMPTS = {"partial": (71, PARTIAL), "rank1-sliding-missing": (72, PARTIAL)}


def hybrid_layout(model: Path, group: str, rank: int) -> Any:
    """The layout of one group's shard on `rank` (`groups_for_vllm`): the group's tag, then
    the parallel degree and rank."""
    import torch

    from kvstore.layout import KVLayout

    return KVLayout(model=f"{model}#kv-group:{group}#tp={TP}:rank={rank}", num_layers=2,
                    num_kv_heads=1, head_dim=64, dtype=torch.float32, block_tokens=BLOCK)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.vllm.models import make_hybrid_model

    return make_hybrid_model(tmp_path_factory.mktemp("vllm-tp-hybrid") / "tiny-gemma3")


@pytest.fixture(scope="module")
def hybrid_cold(hybrid_dir: Path, daemon: DaemonProcess,
                tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """A TP=2 engine of the Gemma-3-shaped model computes the prompts cold: both groups'
    shards of both ranks published."""
    log = tmp_path_factory.mktemp("vllm-tp-log") / "hybrid-cold.log"
    engine = Engine(hybrid_dir, daemon.target, log=log, **tp_opts())
    try:
        runs = {name: engine.generate([{"prompt_token_ids": corpus_ids(hybrid_dir, seed, n),
                                        "cache_salt": name}])
                for name, (seed, n) in HYBRID_PROMPTS.items()}
    finally:
        engine.close()
    assert "Turning off hybrid kv cache manager" not in log.read_text()
    for run in runs.values():
        assert run["cached"] == [0]
    return runs


@pytest.mark.timeout(900)
def test_hybrid_groups_times_ranks(hybrid_cold: dict[str, dict[str, Any]], hybrid_dir: Path,
                                   daemon: DaemonProcess,
                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    """Sliding window + full attention at TP=2: each (group, rank) shard stored apart; a fresh
    engine loads every full-attention block and the window's sliding-window blocks on both
    ranks, with the cold run's output; a prompt whose rank-1 sliding-window shard is deleted
    is a miss for the whole engine, with the cold run's output."""
    from kvstore.client import KVClient
    from tests.vllm.models import HYBRID_WINDOW

    full = PARTIAL // BLOCK * BLOCK
    groups = [f"layers=0,2:sliding_window={HYBRID_WINDOW}", "layers=1,3:full"]
    missing = "rank1-sliding-missing"
    for name, (seed, n) in HYBRID_PROMPTS.items():
        for group in groups:
            for rank in range(TP):
                with KVClient(daemon.target, hybrid_layout(hybrid_dir, group, rank),
                              salt=name) as client:
                    assert client.lookup(corpus_ids(hybrid_dir, seed, n)) == full
    with KVClient(daemon.target, hybrid_layout(hybrid_dir, groups[0], 1),
                  salt=missing) as client:
        assert client.clear() > 0
    engine = Engine(hybrid_dir, daemon.target,
                    log=tmp_path_factory.mktemp("vllm-tp-log") / "hybrid-warm.log",
                    **tp_opts())
    try:
        served = hit_blocks(daemon)
        warm = engine.generate([{"prompt_token_ids": corpus_ids(hybrid_dir,
                                                                *HYBRID_PROMPTS["partial"]),
                                 "cache_salt": "partial"}])
        assert warm["cached"] == [full], engine.tail()
        window_blocks = -(-(HYBRID_WINDOW - 1) // BLOCK)
        assert hit_blocks(daemon) - served == TP * (full // BLOCK + window_blocks)
        assert_same_generation(warm, hybrid_cold["partial"])
        served = hit_blocks(daemon)
        out = engine.generate([{"prompt_token_ids": corpus_ids(hybrid_dir,
                                                               *HYBRID_PROMPTS[missing]),
                                "cache_salt": missing}])
        assert out["cached"] == [0], engine.tail()
        assert hit_blocks(daemon) == served
        assert_same_generation(out, hybrid_cold[missing])
    finally:
        engine.close()
