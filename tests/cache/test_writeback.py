"""Write-back under pressure (issue 18): a down write-back tier never stops caching at
any `write_back_max_dirty`, blocks owed to a healthy tier are never dropped to make
room, and the background loop takes its batches without walking the dirty set."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tierkv.cache import TieredCache
from tierkv.cache.index import KeyIndex
from tierkv.config import parse_config
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.testing import FaultyTier

pytestmark = pytest.mark.anyio

BLOCK = 1024


def keys(n: int, tag: str) -> list[OffloadKey]:
    return [
        make_offload_key(h, 0) for h in hash_token_blocks(list(range(16 * n)), 16, namespace=tag)
    ]


def data(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, BLOCK), dtype=torch.uint8, generator=g)


def chain(**top: Any) -> dict[str, Any]:
    return {
        "namespace": "wb",
        "layout": {"block_bytes": BLOCK, "groups": [{"block_size": 16}]},
        "primary": {"capacity": 16 * BLOCK, "pin_memory": False},
        "tiers": [
            {
                "type": "faulty",
                "write_policy": "write_back",
                "recovery_after": "1h",
                "failure_threshold": 2,
            }
        ],
        **top,
    }


@pytest.mark.parametrize("bound", [1.0, 0.75])
async def test_a_down_write_back_tier_never_stops_caching_whatever_the_bound(
    faulty_tier_type: str, bound: float
) -> None:
    async with TieredCache(parse_config(chain(write_back_max_dirty=bound))) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        tier.down = True
        for i in range(12):  # 48 blocks through 16 slots, every one dirty for the tier
            ks = keys(4, f"down{i}")
            result = await cache.store(ks, data(4, i))
            assert result.ok and result.stored == tuple(ks), (i, result.error)
            assert (await cache.lookup([ks])).hit_tokens == 64
        stats = cache.stats().primary
        assert stats["store_rejected"] == 0
        assert stats["write_back_dropped"] >= 48 - 16  # what left the primary unwritten
        tier.down = False


async def test_room_for_a_store_never_drops_blocks_owed_to_a_healthy_tier(
    faulty_tier_type: str,
) -> None:
    # a healthy tier whose write-backs fail (its breaker stays closed): the blocks stay
    # dirty and the store that needs their room is rejected, not served by dropping them
    config = chain(write_back_max_dirty=1.0, write_back_headroom=0, store_timeout="200ms")
    config["tiers"][0]["failure_threshold"] = 1000
    async with TieredCache(parse_config(config)) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        first = keys(16, "owed")
        assert (await cache.store(first, data(16))).ok
        tier.fail_jobs = 10_000
        result = await cache.store(keys(4, "more"), data(4, 1))
        assert result.rejected and not result.stored
        stats = cache.stats()
        assert stats.primary["write_back_dropped"] == 0
        assert stats.tiers["faulty"]["breaker"] == "closed"
        assert all(k in cache.primary and cache.index.is_dirty(k) for k in first)
        tier.fail_jobs = 0


class CountingSet:
    """A `skip` set that counts how often it is asked."""

    def __init__(self, keys: set[OffloadKey]) -> None:
        self.keys = keys
        self.asked = 0

    def __contains__(self, key: object) -> bool:
        self.asked += 1
        return key in self.keys


def test_a_write_back_batch_walks_only_one_batch_of_the_dirty_set() -> None:
    index = KeyIndex(1 << 20)
    dirty = [bytes([i % 256, i // 256]) * 8 for i in range(50_000)]
    for key in dirty:
        index.mark_dirty(key, 1)
    skip = CountingSet(set(dirty[:3]))  # the oldest three are being written back
    assert index.oldest_dirty(64, skip) == dirty[3:67]
    assert skip.asked == 67  # 64 taken + 3 skipped, of 50,000 dirty keys
    index.clean(dirty[3], 0)
    assert index.oldest_dirty(2) == [dirty[0], dirty[1]]
    assert index.oldest_dirty(0) == []
