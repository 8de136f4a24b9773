"""A Gemma-4-shaped model through the vLLM connector at tensor_parallel_size=2 (one core per
rank, as tests/vllm/test_vllm_tp.py): two KV-cache groups of different block sizes (64-token
sliding pages beside 32-token full-attention ones, tests/vllm/test_vllm_gemma4.py), each split
into one KV head per rank. Every rank stores its shard of both groups in 64-token kvstore
blocks; a fresh TP=2 engine loads them on both ranks.

    .venv-vllm/bin/python -m pytest tests/vllm/test_vllm_gemma4_tp.py -m vllm
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
    make_gemma4_model,
)
from tests.vllm.test_vllm_connector import (
    Engine,
    one_core_per_worker,
    small_daemon,
)
from tests.vllm.test_vllm_gemma4 import KV_BLOCK, PROMPTS, SLIDING_BLOCK, assert_loads_prompt
from tests.vllm.test_vllm_hybrid import group_layouts, publish_cold
from tests.vllm.test_vllm_tp import TP, tp_opts
from tests.vllm.vllm_runner import corpus_ids

pytestmark = [pytest.mark.vllm, pytest.mark.integration]


@pytest.fixture(scope="module", autouse=True)
def one_core_per_rank() -> Iterator[None]:
    with one_core_per_worker(TP):
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gemma4_model(tmp_path_factory.mktemp("vllm-gemma4-tp") / "tiny-gemma4")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from small_daemon(tmp_path_factory, "vllm-gemma4-tp")


@pytest.fixture(scope="module")
def cold(model_dir: Path, daemon: DaemonProcess,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One TP=2 engine computes the prompts cold (each rank publishing its shard of both
    groups), then exits."""
    runs, text = publish_cold(
        model_dir, daemon, tmp_path_factory.mktemp("vllm-gemma4-tp-log") / "cold.log",
        {name: corpus_ids(model_dir, seed, n) for name, (seed, n) in PROMPTS.items()},
        **tp_opts())
    assert f"kv cache group sizes ({SLIDING_BLOCK}, {KV_BLOCK // 2})" in text, text[-3000:]
    for rank in range(TP):  # both workers ran the connector, each with its own shards
        assert f"TP rank {rank} of {TP}" in text and f"#tp={TP}:rank={rank}" in text, \
            text[-3000:]
    return runs


def test_each_rank_stores_its_shard_of_both_groups(cold: dict[str, dict[str, Any]],
                                                   daemon: DaemonProcess,
                                                   model_dir: Path) -> None:
    """Every rank's shard of both groups of a cold prompt is in the daemon, in 64-token
    kvstore blocks: every whole one of the prompt."""
    from kvstore.client import KVClient

    seed, n = PROMPTS["partial"]
    ids = corpus_ids(model_dir, seed, n)
    for rank in range(TP):
        for layout in group_layouts(model_dir, (GEMMA4_SLIDING_HEAD_DIM, GEMMA4_FULL_HEAD_DIM),
                                    KV_BLOCK, rank=(rank, TP)):
            with KVClient(daemon.target, layout) as client:
                assert client.lookup(ids) == n // KV_BLOCK * KV_BLOCK, layout.model


@pytest.mark.timeout(900)  # two TP=2 engine starts (a minute or more each on 2 cores)
def test_fresh_tp2_engine_loads_both_groups_on_both_ranks(
        cold: dict[str, dict[str, Any]], daemon: DaemonProcess, model_dir: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A fresh TP=2 engine loads the prefix the cold engine published, on both ranks: every
    full-attention block and the sliding group's window, each fetched once per rank; the
    cold run's 16 greedy tokens and top-5 log-probabilities, then vLLM's own prefix cache
    gives the same again, bit for bit where it computes the same tokens."""
    engine = Engine(model_dir, daemon.target,
                    log=tmp_path_factory.mktemp("vllm-gemma4-tp-log") / "warm.log", **tp_opts())
    try:
        for name in PROMPTS:
            assert_loads_prompt(name, cold, engine, daemon, model_dir, ranks=TP)
    finally:
        engine.close()
