"""The test harness's Redis servers: a port taken before the bind moves the server, not the test."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests import redis_servers
from tests.redis_servers import RedisServer

pytestmark = pytest.mark.skipif(not redis_servers.available(), reason=redis_servers.SKIP_REASON)


@pytest.mark.parametrize("taken", ["port", "bus port"])
def test_a_port_taken_before_the_first_start_moves_the_server(tmp_path: Path, taken: str) -> None:
    server = RedisServer(tmp_path / "node", cluster=True)
    chosen = server.port
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind(("127.0.0.1", chosen if taken == "port" else chosen + 10000))
    blocker.listen()
    try:
        server.start()
        try:
            assert server.port != chosen
            assert redis_servers.cli(server.port, "PING").strip() == "PONG"
        finally:
            server.stop()
    finally:
        blocker.close()


def test_a_restart_keeps_its_port_and_says_why_it_failed(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "node").start()
    port = server.port
    server.kill()
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", port))
    blocker.listen()
    try:
        with pytest.raises(RuntimeError, match="Address already in use"):
            server.start(timeout=5)
        assert server.port == port  # a node restarts where the Cluster knows it
    finally:
        blocker.close()
    server.start()
    try:
        assert server.port == port
    finally:
        server.stop()
