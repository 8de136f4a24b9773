"""Pipeline parallel through the vLLM connector: a 4-layer random Llama at
pipeline_parallel_size=2 on vLLM's CPU build (layers 0-1 on stage 0, 2-3 on stage 1), one core
per worker.

vLLM 0.32's CPU build fails PP > 1 on its first step (a buffer only a GPU warm-up allocates);
the engines here load tests/vllm/pp_plugin, a vLLM plugin that allocates it, and nothing else
changes (docs/ENGINES.md, "Pipeline parallel"). Each stage stores its layers' shard under a
layout naming them (`MODEL#pp=2:layers=2-3`); the scheduler counts a block cached only when
both stages' shards are. One engine computes the prompts cold and publishes them, one loads
with stage 0's fetches failing, and a fresh engine loads what both left.

    .venv-vllm/bin/python -m pytest tests/vllm/test_vllm_pp.py -m vllm
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
    Engine,
    assert_prefix_cache_bit_identical,
    assert_same_generation,
    expected_cached,
    fetched_blocks,
    hit_blocks,
    one_core_per_worker,
    small_daemon,
)
from tests.vllm.test_vllm_tp import fake_config, fake_groups, full_spec
from tests.vllm.vllm_runner import corpus_ids, make_model

pytestmark = [pytest.mark.vllm, pytest.mark.integration]
PP = 2
LAYERS = 4
STAGES = ("0-1", "2-3")  # each stage's layers, as vLLM's get_pp_indices splits 4 by 2
PLUGIN = Path(__file__).parent / "pp_plugin"
PARTIAL = 9 * BLOCK + 12  # past its last full block: loads 9 blocks, computes 12 tokens
PROMPTS = {"partial": (81, PARTIAL), "whole": (82, 8 * BLOCK)}  # name: (corpus seed, tokens)
MISSING = {"stage1-missing": (1, 83), "stage0-missing": (0, 84)}  # salt: (stage deleted, seed)
FLAKY_SEED = 85
EXTENDED = PARTIAL + 3 * BLOCK  # the flaky prompt, 3 new full blocks past what was published


def pp_opts() -> dict[str, Any]:
    return {"python_path": (PLUGIN,),
            "llm_kwargs": {"pipeline_parallel_size": PP, "distributed_executor_backend": "mp"}}


def stage_layout(model: Path, stage: int | None) -> Any:
    """The layout of `stage`'s shard (`groups_for_vllm`), by hand; None: the PP=1 layout."""
    import torch

    from kvstore.layout import KVLayout

    name = str(model) if stage is None else f"{model}#pp={PP}:layers={STAGES[stage]}"
    return KVLayout(model=name, num_layers=LAYERS if stage is None else LAYERS // PP,
                    num_kv_heads=2, head_dim=64, dtype=torch.float32, block_tokens=BLOCK)


# ---- no engine: the layouts
def pp_config(tp: int = 1, kv_heads: int = 2) -> Any:
    cfg = fake_config(tp, pp=PP, kv_heads=kv_heads)
    cfg.model_config.get_total_num_hidden_layers = lambda: LAYERS
    return cfg


def stage_spec(spec: Any, stage: int) -> Any:
    """`spec`'s cache config as stage `stage`'s workers get it (its own layers' names)."""
    first = stage * LAYERS // PP
    return fake_groups(spec.kv_cache_groups[0].kv_cache_spec, [
        f"model.layers.{first + i}.attn" for i in range(LAYERS // PP)])


def test_layouts_per_stage_and_refusals() -> None:
    """Each stage's layout holds its layers and names them; every worker's group lists every
    stage's shards (the scheduler looks them all up), each worker holds only its stage's; TP x
    PP gives one shard per (stage, rank); `shared_model` names the layers, not the degree; an
    MLA latent is one shard per stage; hybrid models and a split that is not vLLM's are
    refused at start."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from kvstore.client.integrations.vllm import (
        ConnectorConfig,
        ConnectorConfigError,
        groups_for_vllm,
    )

    cfg = ConnectorConfig()
    want = [f"m#pp={PP}:layers={layers}" for layers in STAGES]
    for stage in range(PP):
        (g,) = groups_for_vllm(pp_config(), stage_spec(full_spec(2), stage), cfg, 0, stage)
        assert (g.layout.model, g.layout.num_layers, g.stage) == (want[stage], 2, stage)
        assert [(s.layout.model, s.stage, s.ranks) for s in g.all_shards] == [
            (want[0], 0, (0,)), (want[1], 1, (0,))]
        assert g.shards_of(0, stage) == [g.all_shards[stage]]
    for stage in range(PP):
        for rank in range(2):
            (g,) = groups_for_vllm(pp_config(tp=2), stage_spec(full_spec(1), stage), cfg, rank,
                                   stage)
            assert [(s.index, s.layout.model, s.stage, s.ranks) for s in g.all_shards] == [
                (2 * st + r, f"{want[st]}#tp=2:rank={r}", st, (r,))
                for st in range(PP) for r in range(2)]
            assert [s.index for s in g.shards_of(rank, stage)] == [2 * stage + rank]
    shared = ConnectorConfig.from_extra({"kvstore.shared_model": "llama"})
    (g,) = groups_for_vllm(pp_config(), stage_spec(full_spec(2), 1), shared, 0, 1)
    assert [s.layout.model for s in g.shards_of(0, 1)] == [
        f"llama#layers=2-3#kv-head={h}:of=2" for h in range(2)]
    mla = fake_groups(MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576,
                                       dtype=torch.float32))
    (g,) = groups_for_vllm(pp_config(tp=2, kv_heads=1), stage_spec(mla, 1), cfg, 1, 1)
    assert [(s.layout.model, s.ranks) for s in g.all_shards] == [
        (f"{w}#tp=2", (0, 1)) for w in want]
    with pytest.raises(ConnectorConfigError, match=r"layers \[0, 1\], not \(2, 4\)"):
        groups_for_vllm(pp_config(), stage_spec(full_spec(2), 0), cfg, 0, 1)
    two = fake_groups(full_spec(2).kv_cache_groups[0].kv_cache_spec)
    two.kv_cache_groups *= 2  # two KV-cache groups: a hybrid model
    with pytest.raises(ConnectorConfigError, match="not hybrid models"):
        groups_for_vllm(pp_config(), two, cfg)


# ---- engines
@pytest.fixture(scope="module", autouse=True)
def one_core_per_stage() -> Iterator[None]:
    with one_core_per_worker(PP):
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("vllm-pp") / "tiny-llama", layers=LAYERS)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from small_daemon(tmp_path_factory, "vllm-pp")


def salted(ids: list[int], salt: str) -> dict[str, Any]:
    return {"prompt_token_ids": ids, "cache_salt": salt}


@pytest.fixture(scope="module")
def cold(model_dir: Path, daemon: DaemonProcess,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One PP=2 engine computes every prompt cold (each stage publishing its layers), and the
    flaky prompt's extension under another salt (its reference output), then exits."""
    log = tmp_path_factory.mktemp("vllm-pp-log") / "cold.log"
    engine = Engine(model_dir, daemon.target, log=log, **pp_opts())
    try:
        runs = {name: engine.generate([corpus_ids(model_dir, seed, n)])
                for name, (seed, n) in PROMPTS.items()}
        for salt, (_, seed) in MISSING.items():
            runs[salt] = engine.generate([salted(corpus_ids(model_dir, seed, PARTIAL), salt)])
        runs["flaky"] = engine.generate([salted(corpus_ids(model_dir, FLAKY_SEED, PARTIAL),
                                                "flaky")])
        runs["extended"] = engine.generate([salted(corpus_ids(model_dir, FLAKY_SEED, EXTENDED),
                                                   "extended-reference")])
    finally:
        engine.close()
    text = log.read_text()
    for stage in range(PP):  # both workers ran the connector, each with its own layers
        assert f"PP stage {stage} of {PP}" in text and f"#pp={PP}:layers={STAGES[stage]}" \
            in text, text[-3000:]
    for run in runs.values():
        assert run["cached"] == [0]
    return runs


@pytest.fixture(scope="module")
def flaky(model_dir: Path, daemon: DaemonProcess, cold: dict[str, dict[str, Any]],
          tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An engine whose stage-0 fetches come back a block short (that block NaN) runs the flaky
    prompt extended by 3 new blocks: the stages agree on the shorter load, vLLM recomputes
    from the failed block, and stage 1, whose own load was whole, publishes none of the new
    blocks it computed over stage 0's failed one (they would be NaN)."""
    log = tmp_path_factory.mktemp("vllm-pp-log") / "flaky.log"
    engine = Engine(model_dir, daemon.target, log=log, connector="StageFlakyKVStoreConnector",
                    module="tests.vllm.flaky_connector", **pp_opts())
    try:
        served = hit_blocks(daemon)
        out = engine.generate([salted(corpus_ids(model_dir, FLAKY_SEED, EXTENDED), "flaky")])
        out["served"] = hit_blocks(daemon) - served
    finally:
        engine.close()
    out["log"] = log.read_text()
    return out


@pytest.fixture(scope="module")
def warm_engine(model_dir: Path, daemon: DaemonProcess, flaky: dict[str, Any],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """A fresh PP=2 engine: nothing of the earlier engines' is in it but what kvstore holds."""
    e = Engine(model_dir, daemon.target,
               log=tmp_path_factory.mktemp("vllm-pp-log") / "warm.log", **pp_opts())
    yield e
    e.close()


def test_each_stage_stores_its_layers(cold: dict[str, dict[str, Any]], daemon: DaemonProcess,
                                      model_dir: Path) -> None:
    """Both stages' shards of a cold prompt are in the daemon, each under its layers' layout,
    every full block; nothing under the PP=1 layout (the default keeps degrees apart)."""
    from kvstore.client import KVClient

    ids = corpus_ids(model_dir, *PROMPTS["partial"])
    for stage in range(PP):
        with KVClient(daemon.target, stage_layout(model_dir, stage)) as client:
            assert client.lookup(ids) == PARTIAL // BLOCK * BLOCK, stage
    with KVClient(daemon.target, stage_layout(model_dir, None)) as client:
        assert client.lookup(ids) == 0


@pytest.mark.timeout(900)  # three PP=2 engine starts (a minute or more each on 2 cores)
@pytest.mark.parametrize("name", ["partial", "whole"])
def test_fresh_engine_loads_every_stage(name: str, cold: dict[str, dict[str, Any]],
                                        warm_engine: Engine, daemon: DaemonProcess,
                                        model_dir: Path) -> None:
    """A fresh PP=2 engine loads the prompt from kvstore: vLLM reports the cached tokens, the
    daemon counts each block fetched twice (once per stage's shard), and the 16 greedy tokens
    and top-5 log-probabilities match the cold run's (recompute) within LOGPROB_TOL. A second
    run is vLLM's own prefix cache: at the same number of computed tokens (the partial
    prompt), its log-probabilities are bit-identical to the kvstore load's."""
    seed, n = PROMPTS[name]
    ids = corpus_ids(model_dir, seed, n)
    cached = expected_cached(n)
    served = hit_blocks(daemon)
    warm = warm_engine.generate([ids])
    assert warm["cached"] == [cached], warm_engine.tail()
    assert hit_blocks(daemon) - served == PP * fetched_blocks(cached)
    assert_same_generation(warm, cold[name])
    again = warm_engine.generate([ids])  # vLLM's prefix cache (the blocks loaded before)
    assert again["cached"][0] >= n // BLOCK * BLOCK - BLOCK, warm_engine.tail()
    assert_same_generation(again, cold[name])
    if name == "partial":  # whole blocks: vLLM's own cache recomputes the last one
        assert_prefix_cache_bit_identical(warm, again)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("salt", sorted(MISSING))
def test_shard_missing_on_one_stage_is_a_miss(salt: str, cold: dict[str, dict[str, Any]],
                                              warm_engine: Engine, daemon: DaemonProcess,
                                              model_dir: Path) -> None:
    """The cold engine published both stages' shards of a salted prompt; one stage's are
    deleted. The prompt is then a miss for the whole engine, however complete the other
    stage's shard is: nothing fetched, vLLM computes it, the cold run's output."""
    from kvstore.client import KVClient

    stage, seed = MISSING[salt]
    ids = corpus_ids(model_dir, seed, PARTIAL)
    with KVClient(daemon.target, stage_layout(model_dir, stage), salt=salt) as client:
        assert client.lookup(ids) == PARTIAL // BLOCK * BLOCK
        assert client.clear() > 0
    with KVClient(daemon.target, stage_layout(model_dir, 1 - stage), salt=salt) as client:
        assert client.lookup(ids) == PARTIAL // BLOCK * BLOCK  # the other shard is whole
    served = hit_blocks(daemon)
    out = warm_engine.generate([salted(ids, salt)])
    assert out["cached"] == [0], warm_engine.tail()
    assert hit_blocks(daemon) == served
    assert_same_generation(out, cold[salt])


@pytest.mark.timeout(900)
def test_failed_load_on_one_stage_is_recomputed_and_never_published(
        cold: dict[str, dict[str, Any]], flaky: dict[str, Any], warm_engine: Engine,
        daemon: DaemonProcess, model_dir: Path) -> None:
    """Stage 0's load came back a block short (NaN), stage 1's whole: stage 1 took stage 0's
    shorter figure, both reported the failed blocks, and the flaky engine's output is the
    reference's (the extended prompt computed cold). Then a fresh engine loads the extended
    prompt, every full block of it from kvstore, with the reference's output: what the
    recompute published is right, and stage 1 published nothing it computed over the NaN
    block (a block already stored is never overwritten, so one published then would be
    loaded now)."""
    log = flaky["log"]
    assert flaky["served"] >= PP * (PARTIAL // BLOCK - 1)
    assert "on PP stage 1 of 2, another rank only" in log, log[-3000:]
    assert "vLLM recomputes the rest" in log, log[-3000:]
    assert_same_generation(flaky, cold["extended"])
    ids = corpus_ids(model_dir, FLAKY_SEED, EXTENDED)
    served = hit_blocks(daemon)
    warm = warm_engine.generate([salted(ids, "flaky")])
    assert warm["cached"] == [expected_cached(EXTENDED)], warm_engine.tail()
    assert hit_blocks(daemon) - served == PP * fetched_blocks(expected_cached(EXTENDED))
    assert_same_generation(warm, cold["extended"])
