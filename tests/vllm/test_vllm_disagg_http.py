"""Disaggregated prefill as operators run it (issue 17): one kvstore daemon, two `vllm serve`
OpenAI servers (the connector as `kv_producer` and as `kv_consumer`) and kvstore's proxy
(`python -m kvstore.client.integrations.disagg_proxy`), each its own process, on the tiny
random Llama (32-token blocks).

Each server's request log (`--enable-log-requests`) shows its leg as vLLM's P/D flow sends it,
under one request id: the producer's with `max_tokens=1` and `do_remote_decode`, the
consumer's with the producer's `kvstore_prefilled_tokens`.
Through the proxy, a completion of a prompt of whole blocks, a streamed completion of a prompt
ending inside a block and a chat completion each answer with the tokens and top-5
log-probabilities of the decode server computing the prompt itself (the single instance: the
consumer saves nothing, and a `cache_salt` keeps that run out of both caches), and the decode
server loaded every full block from kvstore: the daemon served them (Stats), vLLM counts them
as external hits (its /metrics and the answer's `cached_tokens`), and the connector logged the
load. A proxy whose only prefill (or decode) server is down answers 502 naming it at once; one
with a dead server beside a live one goes round it.

    .venv-vllm/bin/python -m pytest tests/vllm/test_vllm_disagg_http.py -m vllm  # 2 servers
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run `bash scripts/setup_vllm.sh`",
                allow_module_level=True)

from benchmarks.vllm_disagg import PREFILLED
from benchmarks.vllm_serving import metric
from benchmarks.vllm_ttft import LOAD_LINE
from kvstore.server.process import ROOT, DaemonProcess
from tests.vllm.compose import Service, free_port, healthy, http, wait_for
from tests.vllm.test_vllm_connector import (
    BLOCK,
    MAX_TOKENS,
    assert_same_generation,
    expected_cached,
    fetched_blocks,
    logging_config,
)
from tests.vllm.test_vllm_disagg import stats
from tests.vllm.vllm_runner import TOP_K, corpus, make_model

pytestmark = [pytest.mark.vllm, pytest.mark.integration]
START_S = 600  # two vLLM servers starting at once on 2 cores
# Plain concatenation: the tiny tokenizer has no chat template of its own.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"  # tokens loaded through the connector
# vLLM's request log (--enable-log-requests): its id is "cmpl-" + the proxy's X-Request-Id.
RECEIVED = re.compile(r"Received request cmpl-(?P<id>[0-9a-f-]{36})\S*: params: (?P<params>.*)")


def vllm_serve(model: Path, role: str, port: int, target: str, root: Path) -> Service:
    """`vllm serve` (its module, as docker-compose.yml runs it) with the connector in `role`
    on the daemon at `target`; flags as the in-process engines of test_vllm_disagg.py."""
    (root / "chat.jinja").write_text(CHAT_TEMPLATE)
    ktc = {"kv_connector": "KVStoreConnector",
           "kv_connector_module_path": "kvstore.client.integrations.vllm", "kv_role": role,
           "kv_connector_extra_config": {"kvstore.target": target,
                                         "kvstore.consumer_wait_s": 5.0}}
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", f"--model={model}",
            "--dtype=float32", "--enforce-eager", f"--block-size={BLOCK}",
            "--max-model-len=1024", "--max-num-seqs=4", "--seed=0", "--host=127.0.0.1",
            f"--port={port}", f"--chat-template={root / 'chat.jinja'}",
            "--enable-prompt-tokens-details", "--enable-log-requests",  # each leg's params
            f"--kv-transfer-config={json.dumps(ktc)}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
           "VLLM_LOGGING_CONFIG_PATH": str(logging_config())}
    return Service(role, argv, root / f"{role}.log", env)


def start_proxy(root: Path, name: str, prefill: list[str], decode: list[str],
                ) -> tuple[Service, str]:
    """kvstore's proxy as operators run it, in this (vLLM's) environment; it and its URL."""
    port = free_port()
    argv = [sys.executable, "-m", "kvstore.client.integrations.disagg_proxy", "--port",
            str(port), *(a for u in prefill for a in ("--prefill", u)),
            *(a for u in decode for a in ("--decode", u))]
    proxy = Service(name, argv, root / f"{name}.log", {**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    wait_for("health", lambda: healthy(url), proxy, 30)
    return proxy, url


@dataclass
class Stack:
    daemon: DaemonProcess
    producer: Service
    consumer: Service
    producer_url: str
    consumer_url: str
    proxy_url: str
    model: str
    root: Path


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = Path(tmp_path_factory.mktemp("pd-http"))
    model = make_model(root / "tiny-llama")
    daemon = DaemonProcess(root / "kv", "--host-bytes", "64MiB").start()
    started: list[Service] = []
    try:
        ports = {"kv_producer": free_port(), "kv_consumer": free_port()}
        for role, port in ports.items():  # both start at once: half the wait
            started.append(vllm_serve(model, role, port, daemon.target, root))
        urls = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
        for service in started:
            wait_for("health", lambda s=service: healthy(urls[s.name]), service, START_S)
        proxy, proxy_url = start_proxy(root, "proxy", [urls["kv_producer"]],
                                       [urls["kv_consumer"]])
        started.append(proxy)
        yield Stack(daemon, started[0], started[1], urls["kv_producer"], urls["kv_consumer"],
                    proxy_url, str(model), root)
    finally:
        for service in reversed(started):
            service.stop()
        daemon.kill()


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(n)]


def completion(model: str, prompt: Any, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": TOP_K, "return_token_ids": True, **extra}


def generation(choices: list[dict[str, Any]]) -> dict[str, Any]:
    """Tokens, chosen-token log-probabilities and top-k of one completion (its choices, or
    a stream's chunks' choices in order), shaped for `assert_same_generation`."""
    tokens: list[int] = []
    logprobs: list[float] = []
    top: list[dict[str, float]] = []
    for c in choices:
        tokens += c.get("token_ids") or []
        lp = c.get("logprobs") or {}
        logprobs += lp.get("token_logprobs") or []
        top += lp.get("top_logprobs") or []
    return {"tokens": [tokens], "logprobs": [logprobs], "top": [top]}


def stream(url: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A streamed completion: its chunks' choices, and its usage (final chunk)."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    choices: list[dict[str, Any]] = []
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=300) as resp:
        assert resp.headers.get("Content-Type", "").startswith("text/event-stream")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            choices += chunk.get("choices") or []
            usage = chunk.get("usage") or usage
    return choices, usage


def cached_tokens(answer: dict[str, Any]) -> int:
    return int((answer.get("usage") or {}).get("prompt_tokens_details", {})
               .get("cached_tokens") or 0)


def error_of(url: str, body: dict[str, Any], timeout: float = 30) -> tuple[int, str, float]:
    """(HTTP status, error message, seconds) of a request that must fail."""
    began = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as e:
        http(url, body, timeout=timeout)
    took = time.monotonic() - began
    return e.value.code, json.loads(e.value.read())["error"]["message"], took


def log_lines(service: Service) -> list[str]:
    return service.log_path.read_text(errors="replace").splitlines()


def reference(pd: Stack, body: dict[str, Any], path: str = "/v1/completions") -> dict[str, Any]:
    """The single instance's answer: the decode server computing the prompt itself, under a
    salt of its own (neither kvstore nor vLLM's prefix cache then serves it to the proxied
    request, which has no salt)."""
    stored = stats(pd.daemon).stored_blocks
    ref = http(pd.consumer_url + path, {**body, "cache_salt": "single-instance"})
    assert cached_tokens(ref) == 0
    assert stats(pd.daemon).stored_blocks == stored, "the consumer saved blocks"
    return dict(ref)


@pytest.mark.timeout(1200)
def test_proxy_completion_decodes_like_one_instance_from_kvstore(pd: Stack) -> None:
    ids = prompt_ids(6 * BLOCK, seed=1)  # whole blocks: the consumer computes the last token
    body = completion(pd.model, ids)
    ref = reference(pd, body)
    want = generation(ref["choices"])
    assert len(set(want["tokens"][0])) > 2, f"the model repeats itself: {want['tokens']}"
    before, hits = stats(pd.daemon), metric(pd.consumer_url, EXTERNAL_HITS)
    seen = {s.name: len(log_lines(s)) for s in (pd.producer, pd.consumer)}
    got = http(pd.proxy_url + "/v1/completions", body)
    # Each server got its leg as vLLM's P/D flow sends it, under the one request id.
    legs = {s.name: [m for line in log_lines(s)[seen[s.name]:]
                     if (m := RECEIVED.search(line))] for s in (pd.producer, pd.consumer)}
    (prefill,), (decode,) = legs["kv_producer"], legs["kv_consumer"]
    assert prefill["id"] == decode["id"]
    assert "max_tokens=1," in prefill["params"] and \
        "'kv_transfer_params': {'do_remote_decode': True" in prefill["params"]
    assert f"max_tokens={MAX_TOKENS}," in decode["params"] and \
        f"'kv_transfer_params': {{'{PREFILLED}': {len(ids)}, " \
        "'kvstore_prefill_tokens_per_s': " in decode["params"]  # the producer's rate too
    assert_same_generation(generation(got["choices"]), want)
    assert cached_tokens(got) == expected_cached(len(ids)) == len(ids) - 1
    after = stats(pd.daemon)
    # The producer stored the prompt's 6 blocks; the consumer fetched them all and stored none.
    assert after.stored_blocks - before.stored_blocks == len(ids) // BLOCK
    assert after.hit_blocks - before.hit_blocks == fetched_blocks(len(ids) - 1)
    assert metric(pd.consumer_url, EXTERNAL_HITS) - hits == len(ids) - 1
    loads = [LOAD_LINE.search(line) for line in log_lines(pd.consumer)[seen["kv_consumer"]:]]
    assert [(int(m[1]), int(m[2])) for m in loads if m] == [(0, len(ids) - 1)]


@pytest.mark.timeout(600)
def test_proxy_streams_the_decode_servers_answer(pd: Stack) -> None:
    ids = prompt_ids(5 * BLOCK + 7, seed=2)  # ends inside a block: its 7 tokens recomputed
    body = completion(pd.model, ids)
    want = generation(reference(pd, body)["choices"])
    hits = stats(pd.daemon).hit_blocks
    choices, usage = stream(pd.proxy_url + "/v1/completions",
                            {**body, "stream_options": {"include_usage": True}})
    assert len(choices) >= MAX_TOKENS  # token by token, not one answer
    assert_same_generation(generation(choices), want)
    assert usage["prompt_tokens_details"]["cached_tokens"] == expected_cached(len(ids)) == \
        5 * BLOCK
    assert stats(pd.daemon).hit_blocks - hits == 5


@pytest.mark.timeout(600)
def test_proxy_chat_completion(pd: Stack) -> None:
    body = {"model": pd.model, "messages": [{"role": "user",
                                             "content": " ".join(corpus(30, seed=3))}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": True,
            "top_logprobs": TOP_K}
    ref = reference(pd, body, "/v1/chat/completions")
    got = http(pd.proxy_url + "/v1/chat/completions", body)
    assert got["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
    for a, b in zip(got["choices"][0]["logprobs"]["content"],
                    ref["choices"][0]["logprobs"]["content"], strict=True):
        assert a["token"] == b["token"] and abs(a["logprob"] - b["logprob"]) < 1e-3, (a, b)
    prompt = got["usage"]["prompt_tokens"]
    assert prompt >= 4 * BLOCK, prompt
    assert cached_tokens(got) == expected_cached(prompt) == prompt // BLOCK * BLOCK


@pytest.mark.timeout(600)
def test_proxy_answers_502_when_a_server_is_down(pd: Stack) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    body = completion(pd.model, prompt_ids(2 * BLOCK, seed=4))
    proxies: list[Service] = []
    try:
        for name, prefill, decode in (("no-prefill", [dead], [pd.consumer_url]),
                                      ("no-decode", [pd.producer_url], [dead])):
            proxy, url = start_proxy(pd.root, name, prefill, decode)
            proxies.append(proxy)
            status, message, took = error_of(url + "/v1/completions", body)
            kind = "prefill" if name == "no-prefill" else "decode"
            assert status == 502 and f"no {kind} server reachable: {dead}" in message, message
            assert "Connection refused" in message and took < 10, (message, took)
        # A dead server beside a live one is gone round, whichever the turn starts with.
        proxy, url = start_proxy(pd.root, "failover", [dead, pd.producer_url],
                                 [pd.consumer_url, dead])
        proxies.append(proxy)
        want = generation(reference(pd, body)["choices"])
        for _ in range(2):
            got = http(url + "/v1/completions", body)
            assert_same_generation(generation(got["choices"]), want)
            assert cached_tokens(got) == 2 * BLOCK - 1
        assert sum("unreachable" in line for line in log_lines(proxies[-1])) == 2
    finally:
        for p in proxies:
            p.stop()
