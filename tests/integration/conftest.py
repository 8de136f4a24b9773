"""Integration fixtures: real Redis servers on free loopback ports, stopped by pid."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import redis_servers
from tests.redis_servers import RedisClusterNodes, RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A standalone `redis-server`."""
    if not redis_servers.available():
        pytest.skip(redis_servers.SKIP_REASON)
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterNodes]:
    """A 3-node Redis Cluster (primaries only), `cluster_state:ok` on every node."""
    if not redis_servers.available():
        pytest.skip(redis_servers.SKIP_REASON)
    cluster = RedisClusterNodes(tmp_path / "cluster", 3).start()
    yield cluster
    cluster.stop()
