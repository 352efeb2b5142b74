"""A block lost above is found below: a load whose located tier fails a key goes on
down the chain, whoever stored the block (issue 20, item 2)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.jobs import JobMetadata, ReqContext
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.testing import FaultyTier

pytestmark = pytest.mark.anyio

BLOCK = 4096


def keys(n: int, tag: str = "k") -> list[OffloadKey]:
    return [
        make_offload_key(h, 0) for h in hash_token_blocks(list(range(16 * n)), 16, namespace=tag)
    ]


def data(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, BLOCK), dtype=torch.uint8, generator=g)


def chain(tiers: list[dict[str, Any]], blocks: int = 32) -> dict[str, Any]:
    return {
        "namespace": "fallback",
        "layout": {"block_bytes": BLOCK, "groups": [{"block_size": 16}]},
        "primary": {"capacity": blocks * BLOCK, "pin_memory": False},
        "tiers": tiers,
        "lookup_timeout": None,  # a cold S3 client on a busy CI machine: answers all count
    }


async def test_a_block_another_server_stored_and_redis_evicted_loads_from_s3(
    redis_url: str, moto_server: Any
) -> None:
    """Two servers share redis + s3 in one namespace. B's lookup finds A's blocks in
    redis (and s3); redis evicts them before B's load; the load falls back to s3."""
    from redis.asyncio import Redis

    moto_server.create_bucket("fallback")
    s3 = {
        "type": "s3",
        "url": f"s3://fallback/{uuid.uuid4().hex}",
        "endpoint_url": moto_server.endpoint_url,
        "access_key_id": "testing",
        "secret_access_key": "testing",
        "region": "us-east-1",
    }
    config = parse_config(chain([{"type": "redis", "url": redis_url}, s3]))
    ks, blocks = keys(6), data(6)
    async with TieredCache(config) as a:
        assert (await a.store(ks, blocks)).ok
        await a.flush()
    async with TieredCache(config) as b:
        hit = await b.lookup([ks])
        assert hit.hit_tokens == 6 * 16
        assert set(hit.locations.values()) == {"redis"}
        client = Redis.from_url(redis_url)
        try:
            await client.flushdb()  # evicted (allkeys-lru) between lookup and load
        finally:
            await client.aclose()
        out = torch.zeros(6, BLOCK, dtype=torch.uint8)
        result = await b.load(hit.keys_to_load, out)
        assert result.ok, result.errors
        assert torch.equal(out, blocks)
        assert set(result.sources.values()) == {"s3"}


async def test_a_tier_nobody_asked_is_asked_once_when_the_one_above_fails(
    faulty_tier_type: str,
) -> None:
    """The lower tier did not answer the lookup (down for a moment), so only the tier
    above is believed to hold the keys; that tier fails them on load. The load asks
    the lower tier once, finds them there and loads them; keys nobody has still fail,
    after exactly one fallback lookup."""
    tiers = [{"type": "faulty", "name": "top"}, {"type": "faulty", "name": "below"}]
    async with TieredCache(parse_config(chain(tiers))) as cache:
        top, below = (h.tier for h in cache.core.tiers)
        assert isinstance(top, FaultyTier) and isinstance(below, FaultyTier)
        ks, blocks = keys(4), data(4)
        ghost = keys(1, "ghost")
        # the blocks reach `below` behind the cache's back (another server stored them)
        slots = cache.primary.view
        for i in range(4):
            slots.block(i)[:] = blocks[i].numpy().tobytes()
        job = JobMetadata(10**6, tuple(ks), tuple(range(4)), ReqContext("elsewhere"))
        assert (await below.store(job)).ok
        top.lie_about = {*ks, *ghost}
        below.down = True
        hit = await cache.lookup([[*ks, *ghost]])
        assert hit.hit_tokens == 5 * 16
        below.down = False
        below.calls.clear()
        out = torch.zeros(5, BLOCK, dtype=torch.uint8)
        result = await cache.load(hit.keys_to_load, out)
        assert result.ok_keys == tuple(ks)
        assert result.failed_keys == tuple(ghost)
        assert torch.equal(out[:4], blocks)
        assert set(result.sources.values()) == {"below"}
        assert [op for op, _ in below.calls] == ["lookup", "load"]
        stats = cache.stats()
        assert stats.tiers["below"]["fallback_lookups"] == 5
        assert stats.tiers["below"]["fallback_hits"] == 4
        assert stats.primary["load_fallbacks"] == 4
