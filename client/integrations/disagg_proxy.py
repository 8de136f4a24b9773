"""A proxy for disaggregated prefill over vLLM's OpenAI servers, with vLLM's own P/D flow.

    python -m kvstore.client.integrations.disagg_proxy \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

The prefill servers run the kvstore connector with `"kv_role": "kv_producer"`, the decode
servers with `"kv_role": "kv_consumer"` (docs/ENGINES.md, "Disaggregated prefill"). Clients
send OpenAI requests to the proxy. Each `POST /v1/completions` or `/v1/chat/completions`:

1. goes to the next prefill server (round robin over `--prefill`) as vLLM's
   `toy_proxy_server.py` sends it: `max_tokens=1` (and `max_completion_tokens=1` when the
   request has it), `stream` off, without `stream_options`, `min_tokens` and
   `min_completion_tokens`, with `"kv_transfer_params": {"do_remote_decode": true, ...}`.
   A kvstore producer answers once the prompt's blocks are committed, with
   `"kv_transfer_params": {"kvstore_prefilled_tokens": N}`;
2. then goes as the client sent it, with those `kv_transfer_params`, to the next decode server
   (round robin over `--decode`), whose answer is the client's: streamed as it arrives when
   the client asked for `"stream": true`.

A server that cannot be reached is skipped for the next one of its kind (nothing was sent to
it, so trying another is safe); when none can be, the client gets 502 with each server's
reason. A server's own error answer (a 400 for a bad request, say) goes to the client as it
came. `GET /health` answers 200 while the proxy runs; `GET /v1/models` asks a decode server.

Standard library only (a thread per connection): it runs in any environment with kvstore,
vLLM's included, and vLLM's own proxies work in its place (ENGINES.md).
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("kvstore.disagg_proxy")

COMPLETIONS = ("/v1/completions", "/v1/chat/completions")
# What vLLM's toy_proxy_server.py asks a prefill server with (its NIXL fields, unused here).
PREFILL_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None}
CHUNK = 1 << 16
# A request body larger than this is refused (413) before it is read: a 128k-token prompt is
# about 1 MB of JSON, and a thread reading a body a client claims but never sends is held.
MAX_BODY_BYTES = 64 << 20


class UnreachableError(Exception):
    """No server of a kind could be reached: the proxy answers 502 with this message."""


class BadUpstreamError(Exception):
    """A server answered something that is not an OpenAI response: 502 too."""


@dataclass(frozen=True)
class Upstream:
    """One vLLM OpenAI server, from its base URL (`http://HOST:PORT`, optionally a path)."""

    url: str
    https: bool
    host: str
    port: int
    prefix: str  # a base path before /v1/..., usually ""

    @classmethod
    def parse(cls, url: str) -> Upstream:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected a server URL like http://HOST:PORT, got {url!r}")
        https = parts.scheme == "https"
        return cls(url.rstrip("/"), https, parts.hostname,
                   parts.port or (443 if https else 80), parts.path.rstrip("/"))

    def connect(self, connect_timeout: float, timeout: float | None,
                ) -> http.client.HTTPConnection:
        """A connected HTTP connection; OSError when the server cannot be reached. Connecting
        has its own short timeout: a server that is down fails fast, while an answer may
        take as long as a prefill does (`timeout`, between bytes)."""
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=connect_timeout)
        try:
            conn.connect()
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
        except BaseException:
            conn.close()
            raise
        return conn


class RoundRobin:
    """Servers of one kind in turn; `order()` is every server, starting with the next one."""

    def __init__(self, servers: Sequence[Upstream]) -> None:
        if not servers:
            raise ValueError("at least one server is needed")
        self.servers = list(servers)
        self._next = itertools.count()
        self._lock = threading.Lock()

    def order(self) -> list[Upstream]:
        with self._lock:
            i = next(self._next) % len(self.servers)
        return self.servers[i:] + self.servers[:i]


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The request a prefill server gets: one output token, no stream (vLLM's proxy)."""
    req = dict(body)
    req["kv_transfer_params"] = dict(PREFILL_TRANSFER_PARAMS)
    req["stream"] = False
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        req.pop(key, None)  # vLLM's proxy: not supported for the prefill leg
    return req


def decode_body(body: Mapping[str, Any], kv_transfer_params: Any) -> dict[str, Any]:
    """The request a decode server gets: the client's, with the prefill's transfer params
    (when it returned any; otherwise the client's own, as vLLM's proxy does)."""
    req = dict(body)
    if kv_transfer_params:
        req["kv_transfer_params"] = kv_transfer_params
    return req


@dataclass
class Proxy:
    prefill: RoundRobin
    decode: RoundRobin
    connect_timeout: float = 5.0
    timeout: float | None = 3600.0

    def open(self, servers: RoundRobin, kind: str, method: str, path: str,
             body: Mapping[str, Any] | None, headers: Mapping[str, str],
             ) -> tuple[Upstream, http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a request to the first server of `servers` that can be reached; its
        connection and response (status and headers read, body not)."""
        failures = []
        data = json.dumps(body).encode() if body is not None else None
        for server in servers.order():
            try:
                conn = server.connect(self.connect_timeout, self.timeout)
            except OSError as e:
                log.warning("%s server %s unreachable: %s", kind, server.url, e)
                failures.append(f"{server.url}: {e}")
                continue
            try:
                send = {"Content-Type": "application/json", **headers} if data else dict(headers)
                conn.request(method, server.prefix + path, body=data, headers=send)
                return server, conn, conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                # Sent, or partly: another server might run it twice, so no retry.
                conn.close()
                raise UnreachableError(f"{kind} server {server.url} failed: "
                                       f"{type(e).__name__}: {e}") from e
        raise UnreachableError(f"no {kind} server reachable: " + "; ".join(failures))

    def prefill_leg(self, path: str, body: Mapping[str, Any], headers: Mapping[str, str],
                    request_id: str) -> tuple[Any, tuple[int, str, bytes] | None]:
        """(the prefill's kv_transfer_params, None), or (None, the prefill server's error
        answer) for the client."""
        began = time.monotonic()
        server, conn, resp = self.open(self.prefill, "prefill", "POST", path,
                                       prefill_body(body), headers)
        try:
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise UnreachableError(f"prefill server {server.url} failed: "
                                   f"{type(e).__name__}: {e}") from e
        finally:
            conn.close()
        if resp.status != 200:
            log.warning("request %s: prefill server %s answered %d: %s", request_id,
                        server.url, resp.status, raw[:300].decode(errors="replace"))
            return None, (resp.status, resp.getheader("Content-Type") or "application/json",
                          raw)
        try:
            answer = json.loads(raw)
        except ValueError as e:
            raise BadUpstreamError(f"prefill server {server.url} answered 200 without JSON: "
                                   f"{raw[:200].decode(errors='replace')!r}") from e
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not params:
            log.warning("request %s: prefill server %s returned no kv_transfer_params (is it "
                        "a kvstore kv_producer?): the decode server computes the prompt",
                        request_id, server.url)
        log.info("request %s: prefill on %s in %.3f s, kv_transfer_params %s", request_id,
                 server.url, time.monotonic() - began, json.dumps(params))
        return params, None


def error_body(status: int, message: str) -> bytes:
    kind = {502: "BadGateway", 400: "BadRequestError", 404: "NotFoundError"}.get(status, "Error")
    return json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": status}}).encode()


class Handler(BaseHTTPRequestHandler):
    """One client connection; `server.proxy` does the work."""

    server: ProxyServer
    protocol_version = "HTTP/1.1"  # keep-alive: every answer has a length or is chunked

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def send_body(self, status: int, content_type: str, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def fail(self, status: int, message: str) -> None:
        self.send_body(status, "application/json", error_body(status, message))

    def forward_headers(self, request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id}
        auth = self.headers.get("Authorization")
        if auth is None and os.environ.get("OPENAI_API_KEY"):
            auth = f"Bearer {os.environ['OPENAI_API_KEY']}"  # as vLLM's proxy
        if auth is not None:
            headers["Authorization"] = auth
        return headers

    def do_GET(self) -> None:
        proxy = self.server.proxy
        if self.path == "/health":
            self.send_body(200, "application/json", json.dumps({
                "status": "ok", "prefill": [s.url for s in proxy.prefill.servers],
                "decode": [s.url for s in proxy.decode.servers]}).encode())
        elif self.path == "/v1/models":
            try:
                _, conn, resp = proxy.open(proxy.decode, "decode", "GET", self.path, None,
                                           self.forward_headers(str(uuid.uuid4())))
                try:
                    self.relay(resp)
                finally:
                    conn.close()
            except UnreachableError as e:
                self.fail(502, str(e))
        else:
            self.fail(404, f"not found: GET {self.path}")

    def do_POST(self) -> None:
        if self.path not in COMPLETIONS:
            self.fail(404, f"not found: POST {self.path} (the proxy serves "
                           f"{', '.join(COMPLETIONS)})")
            return
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True  # its body, if any, is still on the socket
            self.fail(411, "a request body with Content-Length is needed")
            return
        n = int(length) if length.strip().isdigit() else -1
        if not 0 <= n <= MAX_BODY_BYTES:
            self.close_connection = True  # its body, if any, is still on the socket
            self.fail(400 if n < 0 else 413, f"Content-Length {length!r}: the proxy takes "
                      f"request bodies of 0 to {MAX_BODY_BYTES} bytes")
            return
        try:
            body = json.loads(self.rfile.read(n))
        except ValueError as e:
            self.fail(400, f"the request body is not JSON: {e}")
            return
        if not isinstance(body, dict):
            self.fail(400, "the request body must be a JSON object")
            return
        proxy = self.server.proxy
        # Both legs carry it: vLLM names the request after it (cmpl-ID...) in its logs.
        request_id = str(uuid.uuid4())
        headers = self.forward_headers(request_id)
        try:
            params, error = proxy.prefill_leg(self.path, body, headers, request_id)
            if error is not None:
                self.send_body(*error)
                return
            server, conn, resp = proxy.open(proxy.decode, "decode", "POST", self.path,
                                            decode_body(body, params), headers)
        except (UnreachableError, BadUpstreamError) as e:
            log.error("request %s: %s", request_id, e)
            self.fail(502, str(e))
            return
        log.info("request %s: decode on %s (%d)", request_id, server.url, resp.status)
        try:
            self.relay(resp)
        except (OSError, http.client.HTTPException) as e:
            # The answer has begun (or the client left): nothing more can be said to it.
            log.warning("request %s: relaying %s's answer stopped: %s", request_id, server.url,
                        e)
            self.close_connection = True
        finally:
            conn.close()  # a client gone mid-stream: vLLM aborts the request

    def relay(self, resp: http.client.HTTPResponse) -> None:
        """A server's answer to the client: whole when it has a length, else chunk by
        chunk as it arrives (a stream)."""
        content_type = resp.getheader("Content-Type") or "application/json"
        if resp.getheader("Content-Length") is not None:
            self.send_body(resp.status, content_type, resp.read())
            return
        self.send_response(resp.status)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while chunk := resp.read1(CHUNK):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")


class ProxyServer(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client never holds up shutdown

    def __init__(self, address: tuple[str, int], proxy: Proxy) -> None:
        self.proxy = proxy
        super().__init__(address, Handler)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvstore.client.integrations.disagg_proxy",
        description="Disaggregated prefill proxy for vLLM OpenAI servers running the kvstore "
                    "connector (kv_producer / kv_consumer).", allow_abbrev=False)
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill (kv_producer) server, e.g. http://127.0.0.1:8100; repeat "
                        "for several (round robin)")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode (kv_consumer) server; repeat for several (round robin)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--connect-timeout", type=float, default=5.0,
                   help="seconds to connect to a server before trying the next one")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds a server may go without sending a byte (a long prompt's "
                        "prefill on a CPU takes minutes); 0: no limit")
    p.add_argument("--log-level", default="info",
                   choices=("debug", "info", "warning", "error"))
    return p


def make_server(args: argparse.Namespace) -> ProxyServer:
    proxy = Proxy(RoundRobin([Upstream.parse(u) for u in args.prefill]),
                  RoundRobin([Upstream.parse(u) for u in args.decode]),
                  connect_timeout=args.connect_timeout, timeout=args.timeout or None)
    return ProxyServer((args.host, args.port), proxy)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = make_server(args)
    except ValueError as e:
        parser.error(str(e))
    host, port = server.server_address[:2]
    log.info("disaggregated prefill proxy on http://%s:%s: prefill %s, decode %s", host, port,
             ", ".join(s.url for s in server.proxy.prefill.servers),
             ", ".join(s.url for s in server.proxy.decode.servers))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
