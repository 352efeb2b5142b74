"""The raw media over the network, against real servers: plain redis-py beside the
redis tier, plain s3fs beside the s3 tier; both sides remove what they wrote."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tierkv.bench import BenchOptions, run_bench
from tierkv.config import parse_config

pytestmark = pytest.mark.anyio


@pytest.fixture
def s3_endpoint(moto_server: Any) -> str:
    moto_server.create_bucket("bench")
    return str(moto_server.endpoint_url)


async def test_redis_tier_against_plain_redis_py(
    redis_url: str, check_medium: Callable[..., None]
) -> None:
    import redis.asyncio as aioredis

    chain = parse_config(
        {
            "namespace": "t",
            "layout": {"block_bytes": "4KiB", "groups": [{"block_size": 16}]},
            "primary": {"capacity": "64KiB", "pin_memory": False},
            "tiers": [{"type": "redis", "url": redis_url, "max_connections": 4}],
        }
    )
    options = BenchOptions(
        block_bytes=64 << 10, total_bytes=512 << 10, batch=2, concurrency=2, repeat=1,
        orchestrator_keys=0,
    )  # fmt: skip
    report = await run_bench(chain, options)
    _, redis = report["media"]
    assert redis["medium"] == "redis" and redis["baseline"] == "redis-py SET/GET, 4 in flight"
    check_medium(redis, with_ratio=True)
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert await client.dbsize() == 0  # both sides removed what they wrote
    finally:
        await client.aclose()


async def test_s3_tier_against_plain_s3fs(
    s3_endpoint: str, check_medium: Callable[..., None]
) -> None:
    chain = parse_config(
        {
            "namespace": "t",
            "layout": {"block_bytes": "4KiB", "groups": [{"block_size": 16}]},
            "primary": {"capacity": "64KiB", "pin_memory": False},
            "tiers": [
                {
                    "type": "s3",
                    "url": "s3://bench/kv",
                    "endpoint_url": s3_endpoint,
                    "access_key_id": "testing",
                    "secret_access_key": "testing",
                    "region": "us-east-1",
                    "max_concurrency": 4,
                }
            ],
        }
    )
    options = BenchOptions(
        block_bytes=64 << 10, total_bytes=256 << 10, batch=2, concurrency=2, repeat=1,
        orchestrator_keys=0, media=("s3",),
    )  # fmt: skip
    report = await run_bench(chain, options)
    [s3] = report["media"]
    assert s3["baseline"] == "s3fs put/get, 4 in flight"
    check_medium(s3, with_ratio=True)
