"""Blocks shared across tensor-parallel degrees (`kvstore.shared_model`): the tiny random Llama
(2 KV heads) published by a TP=2 engine is a hit for a TP=1 engine, and the other way round.

With the key set, every block is stored one KV head at a time under layouts that name the
shared model id and the head, not the degree (`SHARED#kv-head=1:of=2`): a TP=2 rank moves its
one head, a TP=1 worker both, each through a head slice of vLLM's cache. Two configurations
compute K/V that differ in the last bits, so the check is the issue's: a warm run's
log-probabilities differ from its own engine's recompute by no more than the two degrees'
recomputes differ from each other (within a small allowance for rounding), with the same
greedy tokens where the two recomputes agree.

    .venv-vllm/bin/python -m pytest tests/vllm/test_vllm_tp_share.py -m vllm
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.server.process import DaemonProcess

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run `bash scripts/setup_vllm.sh`, "
                "then `.venv-vllm/bin/python -m pytest tests/vllm -m vllm`",
                allow_module_level=True)

from tests.vllm.test_vllm_connector import BLOCK, Engine, expected_cached, hit_blocks, small_daemon
from tests.vllm.test_vllm_tp import PARTIAL, TP, one_core_per_rank  # noqa: F401 (a fixture)
from tests.vllm.vllm_runner import corpus_ids, make_model

pytestmark = [pytest.mark.vllm, pytest.mark.integration]
log = logging.getLogger(__name__)
SHARED = "tiny-llama-shared"
HEADS = 2  # the model's KV heads: one shard each
PROMPTS = {"from-tp2": (81, PARTIAL), "from-tp1": (82, PARTIAL), "head-missing": (83, PARTIAL)}
RECOMPUTE = "recompute"  # a salt nothing was published under: the engine computes the prompt
ROUNDING = 1e-4  # allowance for float32 rounding on top of the two degrees' difference


def engine_at(tp: int, model: Path, daemon: DaemonProcess, log_path: Path,
              **more: Any) -> Engine:
    opts: dict[str, Any] = {"extra": {"kvstore.shared_model": SHARED}, **more}
    if tp > 1:
        opts["llm_kwargs"] = {**opts.get("llm_kwargs", {}), "tensor_parallel_size": tp,
                              "distributed_executor_backend": "mp"}
    return Engine(model, daemon.target, log=log_path, **opts)


def head_layout(head: int) -> Any:
    import torch

    from kvstore.layout import KVLayout

    return KVLayout(model=f"{SHARED}#kv-head={head}:of={HEADS}", num_layers=2, num_kv_heads=1,
                    head_dim=64, dtype=torch.float32, block_tokens=BLOCK)


def head_client(daemon: DaemonProcess, head: int, salt: str = "") -> Any:
    """A client of one head's shard layout."""
    from kvstore.client import KVClient

    return KVClient(daemon.target, head_layout(head), salt=salt)


def distance(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest difference of a top-5 log-probability the two runs share, over the steps
    before their greedy tokens part (after that they continue different texts)."""
    worst = 0.0
    for ta, tb, sa, sb in zip(a["tokens"][0], b["tokens"][0], a["top"][0], b["top"][0],
                              strict=True):
        common = sa.keys() & sb.keys()
        assert len(common) >= 4, (sa, sb)
        worst = max(worst, max(abs(sa[t] - sb[t]) for t in common))
        if ta != tb:
            break
    return worst


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("vllm-share") / "tiny-llama")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from small_daemon(tmp_path_factory, "vllm-share")


@pytest.fixture(scope="module")
def runs(model_dir: Path, daemon: DaemonProcess,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """TP=2 publishes one prompt; TP=1 loads it and publishes another; a fresh TP=2 engine
    loads that one. Each engine also computes the prompt it loads under a salt nothing was
    published under (its own recompute). Engines one at a time (2 cores)."""
    logs = tmp_path_factory.mktemp("vllm-share-log")
    ids = {name: corpus_ids(model_dir, seed, n) for name, (seed, n) in PROMPTS.items()}
    out: dict[str, dict[str, Any]] = {}

    def run(engine: Engine, key: str, prompt: str, salt: str | None = None) -> None:
        served = hit_blocks(daemon)
        req: dict[str, Any] = {"prompt_token_ids": ids[prompt]}
        if salt is not None:
            req["cache_salt"] = salt
        out[key] = {**engine.generate([req]), "served": hit_blocks(daemon) - served,
                    "tail": engine.tail(60)}

    engine = engine_at(TP, model_dir, daemon, logs / "tp2-cold.log")
    try:
        run(engine, "tp2/from-tp2", "from-tp2")  # cold: publishes both heads
        run(engine, "tp2/from-tp1", "from-tp1", RECOMPUTE)
    finally:
        engine.close()
    engine = engine_at(1, model_dir, daemon, logs / "tp1.log")
    try:
        run(engine, "tp1/from-tp2", "from-tp2", RECOMPUTE)
        run(engine, "tp1-warm/from-tp2", "from-tp2")  # loads what TP=2 published
        run(engine, "tp1/from-tp1", "from-tp1")  # cold: publishes both heads
        run(engine, "tp1/head-missing", "head-missing", "gone")
    finally:
        engine.close()
    with head_client(daemon, 1, "gone") as client:  # one head's shard of it deleted
        assert client.clear() > 0
    engine = engine_at(TP, model_dir, daemon, logs / "tp2-warm.log")
    try:
        run(engine, "tp2-warm/from-tp1", "from-tp1")  # loads what TP=1 published
        run(engine, "tp2/head-missing", "head-missing", "gone")
    finally:
        engine.close()
    text = (logs / "tp2-cold.log").read_text()
    for rank in range(TP):  # each rank moved its own head's shard
        assert f"TP rank {rank} of {TP}" in text and f"{SHARED}#kv-head={rank}:of=2" in text
    return out


@pytest.mark.timeout(1200)  # three engine starts, two of them TP=2
def test_both_heads_stored_under_the_shared_layouts(runs: dict[str, dict[str, Any]],
                                                    daemon: DaemonProcess,
                                                    model_dir: Path) -> None:
    """Every full block of each published prompt is in the daemon once per KV head, under
    the shared id: by TP=2's two ranks (one head each) and by TP=1's one worker (both)."""
    full = PARTIAL // BLOCK * BLOCK
    for name in ("from-tp2", "from-tp1"):
        ids = corpus_ids(model_dir, *PROMPTS[name])
        for head in range(HEADS):
            with head_client(daemon, head) as client:
                assert client.lookup(ids) == full, (name, head)
    for key in ("tp2/from-tp2", "tp1/from-tp1"):
        assert runs[key]["cached"] == [0], runs[key]["tail"]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize(("loader", "publisher"), [("tp1", "tp2"), ("tp2", "tp1")])
def test_published_at_one_degree_is_a_hit_at_the_other(runs: dict[str, dict[str, Any]],
                                                       loader: str, publisher: str) -> None:
    """The warm run loads the other degree's blocks (vLLM reports the cached tokens; the
    daemon serves every block once per head), and its log-probabilities are as close to its
    own engine's recompute as the two degrees' recomputes are to each other."""
    prompt = f"from-{publisher}"
    warm = runs[f"{loader}-warm/{prompt}"]
    own, other = runs[f"{loader}/{prompt}"], runs[f"{publisher}/{prompt}"]
    cached = expected_cached(PARTIAL)
    assert warm["cached"] == [cached], warm["tail"]
    assert warm["served"] == HEADS * -(-cached // BLOCK), warm["tail"]
    assert own["cached"] == [0]
    apart, off = distance(own, other), distance(warm, own)
    log.warning("%s loading %s's blocks: |warm - own recompute| %.2e, |recomputes| %.2e",
                loader, publisher, off, apart)
    assert off <= apart + ROUNDING, (off, apart)
    # The first token follows the loaded prefix only: the same as the own recompute's.
    assert warm["tokens"][0][0] == own["tokens"][0][0]


@pytest.mark.timeout(1200)
def test_a_missing_head_is_a_miss_for_every_degree(runs: dict[str, dict[str, Any]]) -> None:
    """TP=1 published a salted prompt's two heads; one head's shard is deleted. A TP=2
    engine then finds the prompt a miss on both ranks: nothing fetched, computed whole."""
    out = runs["tp2/head-missing"]
    assert out["cached"] == [0], out["tail"]
    assert out["served"] == 0, out["tail"]


# ---- MLA: the latent is the same on every rank: one shard, saved by rank 0, loaded by all
MLA_PROMPT = 6 * 16 + 4  # MLA_BLOCK = 16: loads 6 blocks, computes 4


@pytest.fixture(scope="module")
def mla_runs(daemon: DaemonProcess, tmp_path_factory: pytest.TempPathFactory,
             ) -> dict[str, dict[str, Any]]:
    """The DeepSeek-V2-shaped model: a TP=2 engine publishes a prompt (and computes another
    under a salt), then a TP=1 engine computes the first under a salt and loads it."""
    from tests.vllm.models import MLA_ENGINE, make_mla_model

    model = make_mla_model(tmp_path_factory.mktemp("vllm-share-mla") / "tiny-deepseek-v2")
    logs = tmp_path_factory.mktemp("vllm-share-mla-log")
    ids = corpus_ids(model, 85, MLA_PROMPT, sentences=30)
    out: dict[str, dict[str, Any]] = {}

    def run(engine: Engine, key: str, salt: str | None = None) -> None:
        served = hit_blocks(daemon)
        req: dict[str, Any] = {"prompt_token_ids": ids}
        if salt is not None:
            req["cache_salt"] = salt
        out[key] = {**engine.generate([req]), "served": hit_blocks(daemon) - served,
                    "tail": engine.tail(60)}

    for tp, keys in ((TP, ("tp2",)), (1, ("tp1", "tp1-warm"))):
        path = logs / f"tp{tp}.log"
        engine = engine_at(tp, model, daemon, path, **MLA_ENGINE)
        try:
            for key in keys:
                run(engine, key, RECOMPUTE if key == "tp1" else None)
        finally:
            engine.close()
        out[key]["log"] = path.read_text()
    out["tp2"]["ids"] = ids
    return out


@pytest.mark.timeout(1200)
def test_mla_latent_stored_once_and_shared_across_degrees(mla_runs: dict[str, dict[str, Any]],
                                                          daemon: DaemonProcess) -> None:
    """At TP=2 the latent (identical on both ranks) is saved once, by rank 0, under the
    shared id; a TP=1 engine loads it, its output as close to its own recompute as the two
    degrees' outputs are to each other."""
    import torch

    from kvstore.client import KVClient
    from kvstore.layout import KVLayout
    from tests.vllm.models import MLA_BLOCK, MLA_LATENT

    cold, own, warm = mla_runs["tp2"], mla_runs["tp1"], mla_runs["tp1-warm"]
    cached = MLA_PROMPT // MLA_BLOCK * MLA_BLOCK
    saves = [line for line in cold["log"].splitlines() if f" saved {cached} tokens" in line]
    assert len(saves) == 1, saves  # rank 0's save only: rank 1 holds the same latent
    layout = KVLayout(model=SHARED, num_layers=2, num_kv_heads=1, head_dim=MLA_LATENT,
                      dtype=torch.float32, block_tokens=MLA_BLOCK, kv_kind="mla")
    with KVClient(daemon.target, layout) as client:
        assert client.lookup(cold["ids"]) == MLA_PROMPT // MLA_BLOCK * MLA_BLOCK
    assert cold["cached"] == [0] and own["cached"] == [0]
    assert warm["cached"] == [cached], warm["tail"]
    assert warm["served"] == cached // MLA_BLOCK, warm["tail"]
    apart, off = distance(own, cold), distance(warm, own)
    log.warning("MLA: tp1 loading tp2's latent: |warm - own recompute| %.2e, |recomputes| "
                "%.2e", off, apart)
    assert off <= apart + ROUNDING, (off, apart)
    assert warm["tokens"][0][0] == own["tokens"][0][0]
