"""Lookup against the primary: the all-resident request (answered without asking a
tier) and the partly resident one agree on hits, recency and counters."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key

pytestmark = pytest.mark.anyio


def open_cache(tiers: list[dict[str, Any]]) -> TieredCache:
    """8 slots of 1 KiB, 16 tokens a block."""
    return TieredCache(
        parse_config(
            {
                "namespace": "test",
                "layout": {"block_bytes": 1024, "groups": [{"block_size": 16}]},
                "primary": {"capacity": "8KiB", "pin_memory": False},
                "tiers": tiers,
            }
        )
    )


def keys(n: int, tag: str = "k") -> list[OffloadKey]:
    hashes = hash_token_blocks(list(range(16 * n)), 16, namespace=tag)
    return [make_offload_key(h, 0) for h in hashes]


def blocks(n: int) -> torch.Tensor:
    return torch.full((n, 1024), 7, dtype=torch.uint8)


async def test_an_all_resident_lookup_counts_touches_and_asks_no_tier() -> None:
    async with open_cache([{"type": "memory"}]) as cache:
        old, ks = keys(2, "old"), keys(3, "new")
        await cache.store(old, blocks(2))
        await cache.store(ks, blocks(3))
        await cache.flush()
        asked_before = cache.stats().tiers["memory"]["lookup_keys"]
        before = cache.stats().primary
        hit = await cache.lookup([old])
        assert hit.hit_tokens == 32 and hit.keys_to_load == tuple(old)
        assert dict(hit.locations) == dict.fromkeys(old, "cpu")
        after = cache.stats().primary
        assert after["lookups"] == before["lookups"] + 1
        assert after["hits"] == before["hits"] + 2
        assert cache.stats().tiers["memory"]["lookup_keys"] == asked_before
        order = cache.primary.policy.eviction_order()
        assert order[-2:] == [old[1], old[0]]  # looked up: the first key most recent


async def test_a_partly_resident_lookup_stops_at_the_first_gap() -> None:
    async with open_cache([]) as cache:
        ks = keys(4)
        await cache.store([ks[0], ks[1], ks[3]], blocks(3))
        before = cache.stats().primary
        hit = await cache.lookup([ks])
        assert hit.hit_tokens == 32 and hit.keys_to_load == tuple(ks[:2])
        after = cache.stats().primary
        assert after["hits"] == before["hits"] + 3  # every resident key counts
        assert after["misses"] == before["misses"] + 1
        assert cache.primary.policy.eviction_order()[-2:] == [ks[1], ks[0]]
