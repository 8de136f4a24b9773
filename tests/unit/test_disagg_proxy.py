"""kvstore's disaggregated-prefill proxy without vLLM: the requests it makes of each leg (as
vLLM's toy_proxy_server.py makes them), its round robin, and the process itself in this
environment (no FastAPI, no vLLM) answering 502 at once when no server can be reached. The
flow through real `vllm serve` processes: tests/vllm/test_vllm_disagg_http.py."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from kvstore.client.integrations.disagg_proxy import (
    MAX_BODY_BYTES,
    PREFILL_TRANSFER_PARAMS,
    RoundRobin,
    Upstream,
    decode_body,
    prefill_body,
)
from kvstore.server.process import ROOT
from tests.redis_servers import free_port


def test_prefill_leg_asks_for_one_token_without_stream():
    client = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 64, "stream": True,
              "stream_options": {"include_usage": True}, "min_tokens": 4,
              "max_completion_tokens": 64, "min_completion_tokens": 2, "temperature": 0}
    sent = dict(client)
    assert prefill_body(client) == {
        "model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "stream": False,
        "max_completion_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                               "remote_engine_id": None, "remote_block_ids": None,
                               "remote_host": None, "remote_port": None}}
    assert client == sent  # the decode leg gets the client's request as sent
    # Chat requests without max_completion_tokens get none (vLLM's proxy adds only max_tokens).
    assert "max_completion_tokens" not in prefill_body({"messages": []})
    assert prefill_body({})["kv_transfer_params"] is not PREFILL_TRANSFER_PARAMS


def test_decode_leg_carries_the_prefills_transfer_params():
    client = {"prompt": "x", "stream": True, "kv_transfer_params": {"client": 1}}
    assert decode_body(client, {"kvstore_prefilled_tokens": 192}) == {
        "prompt": "x", "stream": True, "kv_transfer_params": {"kvstore_prefilled_tokens": 192}}
    # No params from the prefill (not a kvstore producer): the client's own, as vLLM's proxy.
    assert decode_body(client, None) == client and decode_body(client, {}) == client


def test_round_robin_starts_each_turn_at_the_next_server():
    servers = [Upstream.parse(f"http://127.0.0.1:{p}") for p in (1, 2, 3)]
    rr = RoundRobin(servers)
    firsts = [rr.order() for _ in range(4)]
    assert [o[0].port for o in firsts] == [1, 2, 3, 1]
    assert [s.port for s in firsts[1]] == [2, 3, 1]  # then the others, for failover


def test_server_urls():
    u = Upstream.parse("http://127.0.0.1:8100/")
    assert (u.url, u.host, u.port, u.prefix, u.https) == ("http://127.0.0.1:8100", "127.0.0.1",
                                                          8100, "", False)
    assert Upstream.parse("https://127.0.0.1/base").prefix == "/base"
    assert Upstream.parse("https://127.0.0.1/base").port == 443
    for bad in ("127.0.0.1:8100", "ftp://127.0.0.1", "http://"):
        with pytest.raises(ValueError, match="http://HOST:PORT"):
            Upstream.parse(bad)
    with pytest.raises(ValueError, match="at least one"):
        RoundRobin([])


@pytest.fixture
def dead_proxy(tmp_path) -> Iterator[tuple[str, list[str]]]:
    """The proxy process (`python -m`, this interpreter) over servers nobody listens on."""
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]
    port = free_port()
    log = open(tmp_path / "proxy.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.client.integrations.disagg_proxy",
                             "--prefill", dead[0], "--prefill", dead[1], "--decode", dead[2],
                             "--port", str(port)], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2).close()
                break
            except OSError:
                assert proc.poll() is None, (tmp_path / "proxy.log").read_text()
                assert time.monotonic() < end, "the proxy did not start"
                time.sleep(0.1)
        yield url, dead
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


def post(url: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.integration
def test_no_reachable_server_is_a_502_naming_each(dead_proxy):
    url, dead = dead_proxy
    health = json.loads(urllib.request.urlopen(url + "/health", timeout=5).read())
    assert health == {"status": "ok", "prefill": dead[:2], "decode": dead[2:]}
    for path in ("/v1/completions", "/v1/chat/completions"):
        began = time.monotonic()
        status, body = post(url + path, json.dumps({"model": "m", "prompt": "x"}).encode())
        assert time.monotonic() - began < 10
        message = body["error"]["message"]
        assert status == 502 and message.startswith("no prefill server reachable"), body
        assert all(f"{d}: [Errno 111] Connection refused" in message for d in dead[:2])
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url + "/v1/models", timeout=5)
    assert e.value.code == 502 and dead[2] in json.loads(e.value.read())["error"]["message"]
    assert post(url + "/v1/completions", b"not json")[0] == 400
    # A length that is not a byte count, or far past any prompt, is refused before any read
    # (read to the end, -1 would hold a thread until the client hangs up).
    for length, status in (("-1", 400), ("x", 400), (str(MAX_BODY_BYTES + 1), 413)):
        conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=10)
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Length", length)
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == status, (length, resp.status)
        assert "Content-Length" in json.loads(resp.read())["error"]["message"]
        conn.close()
    assert post(url + "/v1/completions", b"[1]")[0] == 400
    assert post(url + "/v1/embeddings", b"{}")[0] == 404
