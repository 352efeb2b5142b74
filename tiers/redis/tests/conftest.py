"""Real `redis-server` processes for the redis tier's tests (loopback, persistence off).

Outside CI a missing redis-server skips these tests with the install hint; with CI=true
it fails them: CI must have installed it (scripts/setup.sh).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tierkv_redis.testing import RedisClusterServers, RedisServer, RedisServerMissing

from tierkv.testing import missing_server


def _new_server(directory: Path, **kwargs: Any) -> RedisServer:
    try:
        server = RedisServer(directory, **kwargs)
    except RedisServerMissing as exc:
        missing_server("a real redis-server", exc)
    server.start()
    return server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server shared by the tests that only store and load random keys."""
    server = _new_server(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A one-node Redis Cluster that owns all 16384 slots."""
    server = _new_server(tmp_path_factory.mktemp("redis-cluster"), cluster=True)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def start_redis(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start private servers (to stop, freeze or configure); all killed at teardown."""
    servers: list[RedisServer] = []

    def start(**kwargs: Any) -> RedisServer:
        directory = tmp_path / f"redis{len(servers)}"
        directory.mkdir()
        server = _new_server(directory, **kwargs)
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.close()


@pytest.fixture
def start_cluster(tmp_path: Path) -> Iterator[Callable[..., RedisClusterServers]]:
    """Start real Redis Clusters (`RedisClusterServers`) to kill and restart nodes of;
    all killed at teardown."""
    clusters: list[RedisClusterServers] = []

    def start(**kwargs: Any) -> RedisClusterServers:
        try:
            cluster = RedisClusterServers(tmp_path / f"cluster{len(clusters)}", **kwargs)
        except RedisServerMissing as exc:
            missing_server("a real redis-server", exc)
        clusters.append(cluster)
        cluster.start()
        return cluster

    try:
        yield start
    finally:
        for cluster in clusters:
            cluster.close()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
