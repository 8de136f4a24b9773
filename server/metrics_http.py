"""The /metrics HTTP endpoint, bounded against clients that connect and never finish.

prometheus_client's own server gives every connection a thread that waits for its request
without a timeout: connections that never send one each held a thread and a file descriptor
for good, until the daemon had none left for its disk tier and its same-node engines
(docs/RELIABILITY.md, "Hostile clients"). Here a connection is closed `REQUEST_TIMEOUT_S`
after it was accepted, answered or not, and at most `MAX_CONNECTIONS` are served at once; more
are closed as they arrive. A scrape is one short request, so neither limit touches Prometheus.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

MAX_CONNECTIONS = 16
REQUEST_TIMEOUT_S = 10.0


class _Handler(WSGIRequestHandler):
    """A connection lives at most `REQUEST_TIMEOUT_S`, its request and the answer: a client
    trickling a byte at a time keeps its slot no longer than a silent one."""

    timeout = REQUEST_TIMEOUT_S  # each read, too

    def setup(self) -> None:
        super().setup()
        self._deadline = threading.Timer(REQUEST_TIMEOUT_S, self._expire)
        self._deadline.daemon = True
        self._deadline.start()

    def _expire(self) -> None:
        with contextlib.suppress(OSError):  # already closed
            self.connection.shutdown(socket.SHUT_RDWR)  # the handler's reads and writes end

    def finish(self) -> None:
        self._deadline.cancel()
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # no line per scrape


class _BoundedServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most `MAX_CONNECTIONS` at once."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: closed at once, its descriptor back
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that timed out or went away: nothing to report


def serve_metrics(registry: CollectorRegistry, port: int, host: str) -> WSGIServer:
    """Serve `registry` at http://host:port/metrics on a daemon thread; returns the server."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class: type[_BoundedServer] = type("_Server", (_BoundedServer,),
                                             {"address_family": family})
    httpd: WSGIServer = make_server(host, port, make_wsgi_app(registry), server_class,
                                    handler_class=_Handler)
    threading.Thread(target=httpd.serve_forever, name="kvstore-metrics", daemon=True).start()
    return httpd
