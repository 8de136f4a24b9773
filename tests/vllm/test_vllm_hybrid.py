"""Hybrid models through the vLLM connector: a Gemma-3-shaped random model (tests/vllm/models.py)
whose sliding-window layers (0, 2; window 64) and full-attention layers (1, 3) form two
KV-cache groups under vLLM's hybrid KV-cache manager, which vLLM's CPU build runs and keeps on
because the connector implements `SupportsHMA`.

Each group is stored under its own layout (its own keys); a load fetches every full-attention
block of the prefix and only the sliding-window blocks vLLM allocates for the resumed length
(the window's). One engine computes the prompts cold and publishes them, then exits; a fresh
engine loads them from kvstore.

    .venv-vllm/bin/python -m pytest tests/vllm/test_vllm_hybrid.py -m vllm
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

from tests.vllm.models import HYBRID_WINDOW, make_hybrid_model
from tests.vllm.test_vllm_connector import (
    BLOCK,
    MAX_TOKENS,
    Engine,
    assert_prefix_cache_bit_identical,
    assert_same_generation,
    hit_blocks,
    require_varied_output,
    small_daemon,
)
from tests.vllm.vllm_runner import corpus_ids

pytestmark = [pytest.mark.vllm, pytest.mark.integration]
PARTIAL = 9 * BLOCK + 12  # past its last full block: loads 9 blocks, computes 12 tokens
WHOLE = 9 * BLOCK  # whole blocks: loads all but the last token (a partial page)
PROMPTS = {"partial": (51, PARTIAL), "whole": (52, WHOLE)}  # name: (corpus seed, tokens)
# Salted prompts whose blocks of one group the test deletes: (salt, group deleted, seed).
MISSING = {"sliding-missing": (0, 53), "full-missing": (1, 54)}
# vLLM's sliding-window manager keeps cdiv(window - 1, block) blocks before a resumed length
# (vllm/v1/core/single_type_kv_cache_manager.py): the only ones a load fetches for that group.
WINDOW_BLOCKS = -(-(HYBRID_WINDOW - 1) // BLOCK)


def group_layouts(model: Path, head_dims: tuple[int, int] = (64, 64),
                  block_tokens: int = BLOCK, rank: tuple[int, int] | None = None) -> list[Any]:
    """The layouts the connector derives (`groups_for_vllm`) for a model whose layers 0 and 2
    form the sliding-window group and 1 and 3 the full-attention one, 2 KV heads each of
    `head_dims` (sliding, full), built by hand: the tests find the engine's blocks with
    them. `rank`: (rank, TP degree), that rank's shard of each group (its share of the heads)."""
    import torch

    from kvstore.layout import KVLayout

    suffix = f"#tp={rank[1]}:rank={rank[0]}" if rank is not None else ""
    heads = 2 // rank[1] if rank is not None else 2

    def layout(tag: str, head_dim: int) -> KVLayout:
        return KVLayout(model=f"{model}#kv-group:{tag}{suffix}", num_layers=2,
                        num_kv_heads=heads, head_dim=head_dim, dtype=torch.float32,
                        block_tokens=block_tokens)

    return [layout(f"layers=0,2:sliding_window={HYBRID_WINDOW}", head_dims[0]),
            layout("layers=1,3:full", head_dims[1])]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hybrid_model(tmp_path_factory.mktemp("vllm-hybrid") / "tiny-gemma3")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from small_daemon(tmp_path_factory, "vllm-hybrid")


@pytest.fixture(scope="module")
def cold(model_dir: Path, daemon: DaemonProcess,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One engine computes every prompt cold (publishing both groups' blocks), then exits."""
    log = tmp_path_factory.mktemp("vllm-hybrid-log") / "cold.log"
    requests: dict[str, Any] = {name: corpus_ids(model_dir, seed, n)
                                for name, (seed, n) in PROMPTS.items()}
    for salt, (_, seed) in MISSING.items():
        requests[salt] = {"prompt_token_ids": corpus_ids(model_dir, seed, PARTIAL),
                          "cache_salt": salt}
    runs, text = publish_cold(model_dir, daemon, log, requests)
    assert "sliding_window=64" in text and "layers=1,3:full" in text, text[-3000:]
    return runs


def publish_cold(model_dir: Path, daemon: DaemonProcess, log: Path,
                 requests: dict[str, Any], **engine_opts: Any,
                 ) -> tuple[dict[str, dict[str, Any]], str]:
    """One engine (`engine_opts`: `Engine`'s, e.g. TP) computes each request (a prompt's token
    ids, or vLLM's prompt dict) cold, publishing every group's blocks, then exits: its runs
    (none cached anything, each with varied output) and its log. vLLM must have kept its
    hybrid KV-cache manager on (it turns it off, with a warning, for a connector that does
    not implement SupportsHMA)."""
    engine = Engine(model_dir, daemon.target, log=log, **engine_opts)
    try:
        runs = {name: engine.generate([request]) for name, request in requests.items()}
    finally:
        engine.close()
    text = log.read_text()
    assert "Turning off hybrid kv cache manager" not in text
    for run in runs.values():
        assert run["cached"] == [0]
        require_varied_output(run)
    return runs, text


@pytest.fixture(scope="module")
def warm_engine(model_dir: Path, daemon: DaemonProcess, cold: dict[str, dict[str, Any]],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """A fresh engine: nothing of the cold engine's is left in it but what kvstore holds."""
    e = Engine(model_dir, daemon.target,
               log=tmp_path_factory.mktemp("vllm-hybrid-log") / "warm.log")
    yield e
    e.close()


def test_groups_stored_apart(cold: dict[str, dict[str, Any]], daemon: DaemonProcess,
                             model_dir: Path) -> None:
    """Both groups' blocks of a cold prompt are in the daemon, each under its own layout:
    every full block of the prompt, in both (any prefix length can be resumed)."""
    from kvstore.client import KVClient

    ids = corpus_ids(model_dir, *PROMPTS["partial"])
    for layout in group_layouts(model_dir):
        with KVClient(daemon.target, layout) as client:
            assert client.lookup(ids) == PARTIAL // BLOCK * BLOCK, layout


@pytest.mark.timeout(900)  # two engine starts (tens of seconds each on 2 cores)
@pytest.mark.parametrize("name", ["partial", "whole"])
def test_fresh_engine_loads_hybrid_prefix_with_cold_logprobs(
        name: str, cold: dict[str, dict[str, Any]], warm_engine: Engine,
        daemon: DaemonProcess, model_dir: Path) -> None:
    """A prompt longer than the window, published by the cold engine, is loaded by a fresh
    engine from kvstore: vLLM reports the cached tokens, the daemon counts every
    full-attention block and only the window's sliding-window blocks fetched, and the 16
    greedy tokens and top-5 log-probabilities match the cold run's within LOGPROB_TOL. A
    second run is vLLM's own prefix cache (the loaded blocks cached by vLLM): the same again."""
    seed, n = PROMPTS[name]
    cached = min(n // BLOCK * BLOCK, n - 1)
    assert cached > HYBRID_WINDOW
    served = hit_blocks(daemon)
    warm = warm_engine.generate([corpus_ids(model_dir, seed, n)])
    assert warm["cached"] == [cached], warm_engine.tail()
    full_blocks = -(-cached // BLOCK)
    assert hit_blocks(daemon) - served == full_blocks + WINDOW_BLOCKS
    assert len(warm["logprobs"][0]) == MAX_TOKENS >= 8
    assert_same_generation(warm, cold[name])
    first_sw = cached - HYBRID_WINDOW + 1
    assert (f"group 0 tokens [{first_sw // BLOCK * BLOCK}, {cached}), group 1 tokens [0, "
            f"{cached})") in warm_engine.tail(200), warm_engine.tail()
    again = warm_engine.generate([corpus_ids(model_dir, seed, n)])  # vLLM's prefix cache
    assert again["cached"][0] >= n // BLOCK * BLOCK - BLOCK, warm_engine.tail()
    assert_same_generation(again, cold[name])
    if name == "partial":  # whole blocks: vLLM's own cache recomputes the last one
        assert_prefix_cache_bit_identical(warm, again)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("salt", sorted(MISSING))
def test_prefix_missing_one_group_is_a_miss(salt: str, cold: dict[str, dict[str, Any]],
                                            warm_engine: Engine, daemon: DaemonProcess,
                                            model_dir: Path) -> None:
    """The cold engine published both groups of a salted prompt; the blocks of one group are
    deleted (its namespace cleared). Then the prompt is a miss, however complete the other
    group is: nothing fetched, vLLM computes it, the cold run's output."""
    from kvstore.client import KVClient

    group, seed = MISSING[salt]
    ids = corpus_ids(model_dir, seed, PARTIAL)
    layouts = group_layouts(model_dir)
    with KVClient(daemon.target, layouts[group], salt=salt) as client:
        assert client.lookup(ids) == PARTIAL // BLOCK * BLOCK
        assert client.clear() > 0
        assert client.lookup(ids) == 0
    with KVClient(daemon.target, layouts[1 - group], salt=salt) as client:
        assert client.lookup(ids) == PARTIAL // BLOCK * BLOCK  # the other group is whole
    served = hit_blocks(daemon)
    out = warm_engine.generate([{"prompt_token_ids": ids, "cache_salt": salt}])
    assert out["cached"] == [0], warm_engine.tail()
    assert hit_blocks(daemon) == served
    assert_same_generation(out, cold[salt])


@pytest.mark.timeout(900)
def test_failed_group_load_is_recomputed(cold: dict[str, dict[str, Any]], model_dir: Path,
                                         daemon: DaemonProcess, warm_engine: Engine) -> None:
    """Fetches come back a block short with a poisoned tail (1e4), in every group
    (tests/vllm/flaky_connector.py): the request's load is reported failed (vLLM takes no
    per-block error with several groups), vLLM recomputes the prompt, does not load it again,
    and the output is the cold run's. The prompt's blocks are in kvstore (the cold engine
    published them): the engine fetched, and threw the fetch away."""
    warm_engine.close()  # two engines at once do not fit 2 cores' time budget
    engine = Engine(model_dir, daemon.target, connector="FiniteFlakyKVStoreConnector",
                    module="tests.vllm.flaky_connector")
    try:
        served = hit_blocks(daemon)
        out = engine.generate([corpus_ids(model_dir, *PROMPTS["partial"])])
        assert hit_blocks(daemon) > served, "the run did not fetch from kvstore"
        assert "vLLM recomputes the request" in engine.tail(400)
        assert_same_generation(out, cold["partial"])
    finally:
        engine.close()
