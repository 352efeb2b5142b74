"""Shared fixtures for the core tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tierkv.registry import register_tier, unregister_tier
from tierkv.testing import FaultyTier, missing_server


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def faulty_tier_type() -> Iterator[str]:
    """Makes `type: faulty` (tierkv.testing.FaultyTier) available to configs."""
    register_tier(FaultyTier)
    yield "faulty"
    unregister_tier("faulty")


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A real redis-server on a free loopback port (persistence off), for this test."""
    try:
        from tierkv_redis.testing import RedisServer

        server = RedisServer(tmp_path)
    except Exception as exc:  # tierkv-redis or redis-server missing
        missing_server("tierkv-redis and a redis-server", exc)
    with server:
        yield server.url


@pytest.fixture(scope="module")
def moto_server() -> Iterator[Any]:
    """moto's S3 server on a free loopback port; tests create their buckets."""
    try:
        from tierkv_s3.testing import MotoServer

        server = MotoServer()
    except Exception as exc:  # tierkv-s3 or moto missing
        missing_server("tierkv-s3 and moto", exc)
    with server:
        yield server
