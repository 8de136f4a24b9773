"""The /metrics endpoint's bounds (`server/metrics_http.py`): a connection lives at most the
request timeout, answered or not, and at most MAX_CONNECTIONS are served at once."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Gauge

import kvstore.server.metrics_http as mh


@pytest.fixture
def server():
    registry = CollectorRegistry()
    Gauge("kvtest_up", "a gauge", registry=registry).set(1)
    httpd = mh.serve_metrics(registry, 0, "127.0.0.1")
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def _closed_after(sock: socket.socket, within_s: float, trickle: bool) -> float | None:
    """Seconds until the server closed `sock`, sending a byte every 0.2 s if `trickle`."""
    began = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - began < within_s:
        try:
            if trickle:
                sock.send(b"G")
            if sock.recv(1) == b"":
                return time.monotonic() - began
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - began
    return None


def test_a_client_trickling_its_request_is_closed_at_the_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each read comes within the socket timeout, so only the whole-request deadline ends it:
    before it, such a client kept its slot for as long as it trickled."""
    monkeypatch.setattr(mh, "REQUEST_TIMEOUT_S", 1.0)
    monkeypatch.setattr(mh._Handler, "timeout", 1.0)
    httpd = mh.serve_metrics(CollectorRegistry(), 0, "127.0.0.1")
    with socket.create_connection(("127.0.0.1", httpd.server_address[1])) as s:
        took = _closed_after(s, 6.0, trickle=True)
    httpd.shutdown()
    httpd.server_close()
    assert took is not None and took < 4.0, took


def test_past_the_connection_limit_a_connection_is_closed_at_once_and_scrapes_go_on(
        server: int) -> None:
    held = [socket.create_connection(("127.0.0.1", server)) for _ in range(mh.MAX_CONNECTIONS)]
    try:
        time.sleep(3)  # each accepted, its slot taken (accepts can be slow on a loaded host)
        with socket.create_connection(("127.0.0.1", server)) as extra:
            took = _closed_after(extra, 4.0, trickle=False)
        assert took is not None and took < 4.0, took  # before the 10 s timeout: the limit
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    body = urllib.request.urlopen(f"http://127.0.0.1:{server}/metrics", timeout=5).read()
    assert b"kvtest_up 1.0" in body
