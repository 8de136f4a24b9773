"""Gemma-4-shaped models through the vLLM connector (tests/vllm/models.py,
`make_gemma4_model`): full-attention layers of twice the sliding layers' head dim, so vLLM's
hybrid KV-cache manager makes the groups' pages equal by giving the sliding group twice the
block size (64 tokens against 32), and the last layers reading earlier layers' K/V.

A kvstore block spans whole blocks of every group: the least common multiple of their sizes
(`groups_for_vllm`), so both groups' blocks are keyed over the same 64 tokens. One engine
computes the prompts cold and publishes them, then exits; a fresh engine loads them.

    .venv-vllm/bin/python -m pytest tests/vllm/test_vllm_gemma4.py -m vllm
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

from tests.vllm.models import (
    GEMMA4_FULL_HEAD_DIM,
    GEMMA4_SLIDING_HEAD_DIM,
    HYBRID_WINDOW,
    make_gemma4_model,
)
from tests.vllm.test_vllm_connector import (
    BLOCK,
    MAX_TOKENS,
    Engine,
    assert_prefix_cache_bit_identical,
    assert_same_generation,
    hit_blocks,
    small_daemon,
)
from tests.vllm.test_vllm_hybrid import group_layouts, publish_cold
from tests.vllm.test_vllm_tp import fake_config
from tests.vllm.vllm_runner import corpus_ids

pytestmark = [pytest.mark.vllm, pytest.mark.integration]
SLIDING_BLOCK = 2 * BLOCK  # vLLM's block size for the sliding group: its pages are half as big
KV_BLOCK = 2 * BLOCK  # kvstore's: lcm(64, 32)
PARTIAL = 9 * BLOCK + 12  # 300 tokens: loads 4 kvstore blocks (256 tokens), computes 44
WHOLE = 8 * BLOCK  # 256 tokens, whole blocks: loads all but the last token
PROMPTS = {"partial": (61, PARTIAL), "whole": (62, WHOLE)}  # name: (corpus seed, tokens)


def two_groups(sizes: tuple[int, int]) -> Any:
    """A `KVCacheConfig` of a sliding and a full-attention group of these block sizes."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    sliding = SlidingWindowSpec(block_size=sizes[0], num_kv_heads=2,
                                head_size=GEMMA4_SLIDING_HEAD_DIM, dtype=torch.float32,
                                sliding_window=HYBRID_WINDOW)
    full = FullAttentionSpec(block_size=sizes[1], num_kv_heads=2,
                             head_size=GEMMA4_FULL_HEAD_DIM, dtype=torch.float32)
    return SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=sliding, layer_names=["m.layers.0.a", "m.layers.2.a"]),
        SimpleNamespace(kv_cache_spec=full, layer_names=["m.layers.1.a", "m.layers.3.a"])])


def test_block_spans_every_groups_blocks() -> None:
    """No engine: groups of block sizes 64 and 32 get one kvstore block size, their least
    common multiple (or `kvstore.block_tokens` where it is a multiple of both), at TP=2 too,
    and each group keeps its own vLLM block size; a block size that is not a multiple of
    every group's, or a padded page, is refused by name."""
    import dataclasses

    from kvstore.client.integrations.vllm import (
        ConnectorConfig,
        ConnectorConfigError,
        groups_for_vllm,
    )

    for sizes, want in (((64, 32), 64), ((32, 48), 96), ((32, 32), 32)):
        groups = groups_for_vllm(fake_config(1), two_groups(sizes), ConnectorConfig())
        assert [g.layout.block_tokens for g in groups] == [want, want], sizes
        assert [g.block_size for g in groups] == list(sizes)
        assert [g.sliding_window for g in groups] == [HYBRID_WINDOW, None]
    for rank in range(2):  # TP=2: every rank's shards of both groups, in 64-token blocks
        groups = groups_for_vllm(fake_config(2), two_groups((64, 32)), ConnectorConfig(), rank)
        assert {s.layout.block_tokens for g in groups for s in g.all_shards} == {64}
        assert [len(g.all_shards) for g in groups] == [2, 2]
    wide = ConnectorConfig(block_tokens=128)
    assert {g.layout.block_tokens
            for g in groups_for_vllm(fake_config(1), two_groups((64, 32)), wide)} == {128}
    with pytest.raises(ConnectorConfigError, match=r"multiple of vLLM's block size of every "
                                                   r"KV-cache group \[64, 32\]"):
        groups_for_vllm(fake_config(1), two_groups((64, 32)), ConnectorConfig(block_tokens=32))
    padded = two_groups((64, 32))
    spec = padded.kv_cache_groups[1].kv_cache_spec
    padded.kv_cache_groups[1].kv_cache_spec = dataclasses.replace(
        spec, page_size_padded=spec.page_size_bytes + 64)
    with pytest.raises(ConnectorConfigError, match="group 1's pages are padded"):
        groups_for_vllm(fake_config(1), padded, ConnectorConfig())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gemma4_model(tmp_path_factory.mktemp("vllm-gemma4") / "tiny-gemma4")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from small_daemon(tmp_path_factory, "vllm-gemma4")


@pytest.fixture(scope="module")
def cold(model_dir: Path, daemon: DaemonProcess,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One engine computes every prompt cold (publishing both groups' blocks), then exits."""
    runs, text = publish_cold(
        model_dir, daemon, tmp_path_factory.mktemp("vllm-gemma4-log") / "cold.log",
        {name: corpus_ids(model_dir, seed, n) for name, (seed, n) in PROMPTS.items()})
    # vLLM gave the groups different block sizes.
    assert f"kv cache group sizes ({SLIDING_BLOCK}, {BLOCK})" in text, text[-3000:]
    return runs


@pytest.fixture(scope="module")
def warm_engine(model_dir: Path, daemon: DaemonProcess, cold: dict[str, dict[str, Any]],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """A fresh engine: nothing of the cold engine's is left in it but what kvstore holds."""
    e = Engine(model_dir, daemon.target,
               log=tmp_path_factory.mktemp("vllm-gemma4-log") / "warm.log")
    yield e
    e.close()


def test_groups_stored_in_blocks_of_the_common_size(cold: dict[str, dict[str, Any]],
                                                     daemon: DaemonProcess,
                                                     model_dir: Path) -> None:
    """Both groups' blocks of a cold prompt are in the daemon under their own layouts, in
    kvstore blocks of 64 tokens: every whole one of the prompt."""
    from kvstore.client import KVClient

    ids = corpus_ids(model_dir, *PROMPTS["partial"])
    # The shared layers 4 and 5 have no cache of their own: two layers per group.
    for layout in group_layouts(model_dir, (GEMMA4_SLIDING_HEAD_DIM, GEMMA4_FULL_HEAD_DIM),
                                KV_BLOCK):
        with KVClient(daemon.target, layout) as client:
            assert client.lookup(ids) == PARTIAL // KV_BLOCK * KV_BLOCK, layout


@pytest.mark.timeout(900)  # two engine starts (tens of seconds each on 2 cores)
@pytest.mark.parametrize("name", ["partial", "whole"])
def test_fresh_engine_loads_gemma4_prefix_with_cold_logprobs(
        name: str, cold: dict[str, dict[str, Any]], warm_engine: Engine,
        daemon: DaemonProcess, model_dir: Path) -> None:
    """A fresh engine loads the prefix the cold engine published: whole kvstore blocks of the
    prompt (never its last token), every full-attention block and the sliding group's last
    64-token block only (its window), with the cold run's 16 greedy tokens and top-5
    log-probabilities; vLLM's own prefix cache then gives the same again."""
    assert_loads_prompt(name, cold, warm_engine, daemon, model_dir)


def assert_loads_prompt(name: str, cold: dict[str, dict[str, Any]], engine: Engine,
                        daemon: DaemonProcess, model_dir: Path, ranks: int = 1) -> None:
    """`engine` (fresh) loads prompt `name` from kvstore: whole kvstore blocks (never the last
    token), every full-attention block and the sliding group's window, each fetched once per
    rank of `ranks`; the cold run's tokens and logprobs, then vLLM's own prefix cache gives
    the same again, bit for bit where it computes the same tokens."""
    seed, n = PROMPTS[name]
    cached = min(n // KV_BLOCK * KV_BLOCK, n - 1)
    assert cached > HYBRID_WINDOW
    served = hit_blocks(daemon)
    warm = engine.generate([corpus_ids(model_dir, seed, n)])
    assert warm["cached"] == [cached], engine.tail()
    full_blocks = -(-cached // KV_BLOCK)
    # vLLM keeps cdiv(window - 1, 64) = 1 sliding block before the resumed length.
    first_sw = (cached - HYBRID_WINDOW + 1) // SLIDING_BLOCK * SLIDING_BLOCK
    window_blocks = full_blocks - first_sw // KV_BLOCK
    assert hit_blocks(daemon) - served == ranks * (full_blocks + window_blocks)
    assert (f"group 0 tokens [{first_sw}, {cached}), group 1 tokens [0, {cached})"
            in engine.tail(200)), engine.tail()
    assert len(warm["logprobs"][0]) == MAX_TOKENS >= 8
    assert_same_generation(warm, cold[name])
    again = engine.generate([corpus_ids(model_dir, seed, n)])  # vLLM's prefix cache
    assert_same_generation(again, cold[name])
    if name == "partial":  # whole blocks: vLLM's own cache recomputes the last one
        assert_prefix_cache_bit_identical(warm, again)
