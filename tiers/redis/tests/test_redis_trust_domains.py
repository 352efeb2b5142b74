"""Two trust domains (servers with different MAC keys) sharing one namespace on one
real redis-server: neither serves nor deletes the other's blocks; a frame that claims
a domain's key id but fails its MAC is a forgery, and that domain deletes it."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from redis.asyncio import Redis
from tierkv_redis import RedisTier
from tierkv_redis.testing import RedisServer

from tierkv import TieredCache, parse_config
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.testing.conformance import forge_under

pytestmark = pytest.mark.anyio

BLOCK_TOKENS = 16
BLOCK_BYTES = 16 * 1024
ENV_A, ENV_B = "TIERKV_TEST_DOMAIN_A_KEY", "TIERKV_TEST_DOMAIN_B_KEY"


@pytest.fixture
def secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_A, os.urandom(32).hex())
    monkeypatch.setenv(ENV_B, os.urandom(32).hex())


def make_cache(url: str, mac_env: str) -> TieredCache:
    config: dict[str, Any] = {
        "namespace": "shared-model",
        "layout": {
            "block_bytes": BLOCK_BYTES,
            "groups": [{"kind": "full", "block_size": BLOCK_TOKENS}],
        },
        "primary": {"capacity": 64 * BLOCK_BYTES, "pin_memory": False},
        "tiers": [{"type": "redis", "url": url, "mac_key_env": mac_env}],
    }
    return TieredCache(parse_config(config))


def prefix_keys(rng: random.Random, n: int) -> list[OffloadKey]:
    tokens = [rng.randrange(32000) for _ in range(BLOCK_TOKENS * n)]
    hashes = hash_token_blocks(tokens, BLOCK_TOKENS, namespace="shared-model")
    return [make_offload_key(h, 0) for h in hashes]


async def names_present(url: str, tier: RedisTier, keys: list[OffloadKey]) -> int:
    client = Redis.from_url(url)
    try:
        return int(await client.exists(*(tier._names.main(k) for k in keys)))
    finally:
        await client.aclose()


def redis_tier_of(cache: TieredCache) -> RedisTier:
    tier = cache.core.tiers[0].tier
    assert isinstance(tier, RedisTier)
    return tier


async def test_two_domains_never_serve_nor_delete_each_others_blocks(
    redis_server: RedisServer, secrets: None
) -> None:
    rng = random.Random(31)
    keys = prefix_keys(rng, 9)
    blocks = [rng.randbytes(BLOCK_BYTES) for _ in keys]
    url = redis_server.url
    async with make_cache(url, ENV_A) as a:
        assert (await a.store(keys, blocks)).error is None
        await a.flush()
        tier_a = redis_tier_of(a)
        assert await names_present(url, tier_a, keys) == 9

    async with make_cache(url, ENV_B) as b:
        await b.lookup([keys])  # redis claims them: the names exist
        result = await b.load(keys, [bytearray(BLOCK_BYTES) for _ in keys])
        assert result.ok_keys == ()
        assert all("another trust domain" in result.errors[k] for k in keys)
        assert b.stats().tiers["redis"]["foreign_blocks"] == 9
        # a second request does not ask redis for them again: the claim failed once
        again = await b.lookup([keys])
        assert again.hit_tokens == 0
        assert b.stats().tiers["redis"]["foreign_blocks"] == 9
        assert await names_present(url, redis_tier_of(b), keys) == 9, "B deleted A's blocks"

    async with make_cache(url, ENV_A) as a2:  # a fresh server of domain A
        found = await a2.lookup([keys])
        assert found.hit_tokens == 9 * BLOCK_TOKENS
        out = [bytearray(BLOCK_BYTES) for _ in keys]
        result = await a2.load(keys, out)
        assert result.failed_keys == ()
        assert [bytes(o) for o in out] == blocks
        assert a2.stats().tiers["redis"]["foreign_blocks"] == 0


async def test_a_frame_forged_under_our_key_id_is_deleted_by_us_only(
    redis_server: RedisServer, secrets: None
) -> None:
    rng = random.Random(32)
    keys = prefix_keys(rng, 3)
    blocks = [rng.randbytes(BLOCK_BYTES) for _ in keys]
    url = redis_server.url
    async with make_cache(url, ENV_A) as a:
        await a.store(keys, blocks)
        await a.flush()
        tier = redis_tier_of(a)
        forged = forge_under(tier.framer, keys[1], rng.randbytes(BLOCK_BYTES))
        client = Redis.from_url(url)
        try:
            await client.set(tier._names.main(keys[1]), forged)
        finally:
            await client.aclose()

    async with make_cache(url, ENV_B) as b:  # not B's key id: B leaves it alone
        await b.lookup([keys])
        await b.load(keys, [bytearray(BLOCK_BYTES) for _ in keys])
        assert await names_present(url, redis_tier_of(b), keys) == 3

    async with make_cache(url, ENV_A) as a2:
        await a2.lookup([keys])
        out = [bytearray(BLOCK_BYTES) for _ in keys]
        result = await a2.load(keys, out)
        assert result.failed_keys == (keys[1],)
        assert "claims this tier's key" in result.errors[keys[1]]
        assert bytes(out[0]) == blocks[0] and bytes(out[2]) == blocks[2]
        assert bytes(out[1]) == bytes(BLOCK_BYTES), "a forged block never reaches the caller"
        tier = redis_tier_of(a2)
        assert await names_present(url, tier, [keys[1]]) == 0
        assert await names_present(url, tier, [keys[0], keys[2]]) == 2
