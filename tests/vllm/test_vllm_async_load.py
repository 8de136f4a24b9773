"""Asynchronous loads (`kvstore.async_load`): the connector loads in a background thread and
reports the load to vLLM when it is done; vLLM keeps the request unscheduled
(`WAITING_FOR_REMOTE_KVS`) meanwhile and runs the others.

A cold engine (synchronous loads, the default) publishes the prompts; engines with
`async_load` load them: the cold run's tokens and log-probabilities, alone and in a batch beside
a request computed meanwhile; a load that comes short is reported failed and vLLM recomputes
the request whole, with the cold run's output; a request aborted while its load is under way
keeps its blocks until the load is done, and the request that then gets them computes right.

    .venv-vllm/bin/python -m pytest tests/vllm/test_vllm_async_load.py -m vllm
"""

from __future__ import annotations

import importlib.util
import re
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
    assert_same_generation,
    expected_cached,
    fetched_blocks,
    hit_blocks,
    small_daemon,
)
from tests.vllm.vllm_runner import corpus_ids, make_model

pytestmark = [pytest.mark.vllm, pytest.mark.integration]
PARTIAL = 9 * BLOCK + 12  # loads 9 blocks, computes 12 tokens
WHOLE = 8 * BLOCK  # loads all but the last token (a partial page)
PROMPTS = {"partial": (101, PARTIAL), "whole": (102, WHOLE), "flaky": (103, PARTIAL),
           "beside": (104, PARTIAL), "aborted": (105, PARTIAL)}  # name: (corpus seed, tokens)
# A KV cache of 14 blocks of 32 tokens (13 usable): a 300-token prompt and its 16 tokens take
# 10, so while one request holds its blocks another of that size cannot be scheduled.
SMALL_CACHE = {"max_model_len": 400, "llm_kwargs": {"num_gpu_blocks_override": 14}}
ASYNC = {"kvstore.async_load": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("vllm-async") / "tiny-llama")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from small_daemon(tmp_path_factory, "vllm-async")


def ids_of(model: Path, name: str) -> list[int]:
    return corpus_ids(model, *PROMPTS[name])


@pytest.fixture(scope="module")
def cold(model_dir: Path, daemon: DaemonProcess) -> dict[str, dict[str, Any]]:
    """A synchronous engine computes every prompt, publishing it, then exits ("beside" under a
    salt of its own)."""
    engine = Engine(model_dir, daemon.target)
    try:
        runs = {name: engine.generate([ids_of(model_dir, name)])
                for name in PROMPTS if name != "beside"}
        runs["beside"] = engine.generate([{"prompt_token_ids": ids_of(model_dir, "beside"),
                                           "cache_salt": "cold"}])
    finally:
        engine.close()
    for run in runs.values():
        assert run["cached"] == [0]
    return runs


@pytest.fixture(scope="module")
def async_engine(model_dir: Path, daemon: DaemonProcess, cold: dict[str, dict[str, Any]],
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    e = Engine(model_dir, daemon.target, extra=ASYNC,
               log=tmp_path_factory.mktemp("vllm-async-log") / "async.log")
    yield e
    e.close()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["partial", "whole"])
def test_async_load_gives_the_cold_output(name: str, cold: dict[str, dict[str, Any]],
                                          async_engine: Engine, daemon: DaemonProcess,
                                          model_dir: Path) -> None:
    """A fresh engine loads the prompt in the background: vLLM reports the cached tokens, the
    daemon counts the blocks fetched, the connector logs the load from its loader thread, and
    the 16 greedy tokens and top-5 log-probabilities are the cold run's."""
    n = PROMPTS[name][1]
    cached = expected_cached(n)
    served = hit_blocks(daemon)
    warm = async_engine.generate([ids_of(model_dir, name)])
    assert warm["cached"] == [cached], async_engine.tail()
    assert hit_blocks(daemon) - served == fetched_blocks(cached)
    assert f"loaded group 0 tokens [0, {cached})" in async_engine.tail(200)
    assert_same_generation(warm, cold[name])


@pytest.mark.timeout(900)
def test_async_load_beside_a_request_computed_meanwhile(
        cold: dict[str, dict[str, Any]], async_engine: Engine, daemon: DaemonProcess,
        model_dir: Path) -> None:
    """One batch: a prompt loaded in the background and one nothing holds, computed by the
    engine while the other loads. Each gives its cold run's output."""
    async_engine.reset()
    out = async_engine.call(op="generate", max_tokens=16, prompts=[
        ids_of(model_dir, "partial"),
        {"prompt_token_ids": ids_of(model_dir, "beside"), "cache_salt": "never-published"}])
    assert out["cached"] == [expected_cached(PARTIAL), 0], async_engine.tail()
    for i, name in enumerate(("partial", "beside")):
        one = {k: [out[k][i]] for k in ("tokens", "logprobs", "top")}
        assert_same_generation(one, cold[name])


@pytest.mark.timeout(900)
def test_short_async_load_is_recomputed(cold: dict[str, dict[str, Any]], model_dir: Path,
                                        daemon: DaemonProcess, async_engine: Engine) -> None:
    """Fetches come back a block short, the block past what they report poisoned
    (tests/vllm/flaky_connector.py, finite: see FiniteFlakyKVStoreConnector): the load is
    reported failed, vLLM recomputes the request whole, and the output is the cold run's."""
    async_engine.close()  # one engine at a time on 2 cores
    engine = Engine(model_dir, daemon.target, connector="FiniteFlakyKVStoreConnector",
                    module="tests.vllm.flaky_connector", extra=ASYNC)
    try:
        served = hit_blocks(daemon)
        out = engine.generate([ids_of(model_dir, "flaky")])
        assert hit_blocks(daemon) > served, "the run did not fetch from kvstore"
        assert "vLLM recomputes the request" in engine.tail(400)
        assert_same_generation(out, cold["flaky"])
    finally:
        engine.close()


@pytest.mark.timeout(900)
def test_request_aborted_mid_load_keeps_its_blocks_until_the_load_ends(
        cold: dict[str, dict[str, Any]], model_dir: Path, daemon: DaemonProcess,
        async_engine: Engine, tmp_path: Path) -> None:
    """A request whose background load is under way (held back SLOW_LOAD_S by
    tests/vllm/flaky_connector.py:SlowLoadKVStoreConnector) is aborted; another request of the
    same size is submitted into a KV cache that cannot hold both. The loader then writes the
    aborted request's pages: had vLLM handed them to the other request at the abort, its output
    would be wrong. It is the cold run's, the loader finished after the abort and reported it
    (vLLM's prefix cache then resets: no request holds blocks), and the aborted prompt, asked
    again, loads with the cold run's output."""
    async_engine.close()  # one engine at a time on 2 cores
    log = tmp_path / "abort.log"
    engine = Engine(model_dir, daemon.target, log=log, connector="SlowLoadKVStoreConnector",
                    module="tests.vllm.flaky_connector", extra=ASYNC, **SMALL_CACHE)
    try:
        out = engine.call(op="abort_mid_load", abort=ids_of(model_dir, "aborted"), wait_s=1.5,
                          max_tokens=16, prompts=[{"prompt_token_ids": ids_of(model_dir, "beside"),
                                                   "cache_salt": "after-abort"}])
        assert out["cached"] == [0], engine.tail()
        assert_same_generation(out, cold["beside"])
        engine.reset()  # fails unless every request's blocks, the aborted one's too, are free
        again = engine.generate([ids_of(model_dir, "aborted")])
        assert again["cached"] == [expected_cached(PARTIAL)], engine.tail()
        assert_same_generation(again, cold["aborted"])
    finally:
        engine.close()
    text = log.read_text()
    aborted_at = text.index("kvstore-test: aborted request 'aborted'")
    assert re.search(r"kvstore: request aborted\S* loaded group 0 tokens \[0, "
                     rf"{expected_cached(PARTIAL)}\)", text[aborted_at:]), text[-3000:]
