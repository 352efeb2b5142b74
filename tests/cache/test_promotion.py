"""Loads and the primary's room: a load waits briefly for promotion room instead of
shedding its hit, and a store's cascade in flight never takes the room the next
request's promotion needs (issue 18).

A `faulty` tier whose jobs wait on a gate holds cascades and promotions in flight
for as long as a test needs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.errors import ConfigError
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.testing import FaultyTier

pytestmark = pytest.mark.anyio

BLOCK = 1024


def keys(n: int, tag: str = "k") -> list[OffloadKey]:
    return [
        make_offload_key(h, 0) for h in hash_token_blocks(list(range(16 * n)), 16, namespace=tag)
    ]


def blocks(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, BLOCK), dtype=torch.uint8, generator=g)


def chain(primary_blocks: int, **top: Any) -> dict[str, Any]:
    return {
        "namespace": "room",
        "layout": {"block_bytes": BLOCK, "groups": [{"block_size": 16}]},
        "primary": {"capacity": primary_blocks * BLOCK, "pin_memory": False},
        "tiers": [{"type": "faulty"}],
        **top,
    }


@asynccontextmanager
async def opened(config: dict[str, Any]) -> AsyncIterator[tuple[TieredCache, FaultyTier]]:
    async with TieredCache(parse_config(config)) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        yield cache, tier
        tier.gate = None
        await cache.flush()
        p = cache.primary
        assert p.num_staged == 0 and p.num_held == 0 and cache.index.promoting == 0


async def only_in_the_tier(cache: TieredCache, ks: list[OffloadKey], data: torch.Tensor) -> None:
    """Store `ks` (reaching the tier), then push them out of the primary."""
    assert (await cache.store(ks, data)).ok
    await cache.flush()
    n = cache.primary.num_blocks
    assert (await cache.store(keys(n, "filler"), blocks(n, 9))).ok
    await cache.flush()
    assert not any(k in cache.primary for k in ks)


async def test_a_load_that_finds_the_share_taken_waits_and_gets_its_hit(
    faulty_tier_type: str,
) -> None:
    # 8 slots, promotions may hold 2: the first load's window takes both
    async with opened(chain(8, promotion_reserve=0.25, promotion_wait="2s")) as (cache, tier):
        ks, data = keys(4), blocks(4)
        await only_in_the_tier(cache, ks, data)
        tier.gate = anyio.Event()
        first, second = torch.zeros(2, BLOCK, dtype=torch.uint8), torch.zeros_like(data[2:])
        results: dict[str, Any] = {}

        async def load(name: str, k: list[OffloadKey], out: torch.Tensor) -> None:
            results[name] = await cache.load(k, out)

        async with anyio.create_task_group() as tg:
            tg.start_soon(load, "first", ks[:2], first)
            await anyio.sleep(0.02)
            assert cache.primary.promotion_room() == 0
            tg.start_soon(load, "second", ks[2:], second)
            await anyio.sleep(0.05)
            assert "second" not in results  # waiting, not shed
            tier.gate.set()  # the first window lands and its slots go back to the share
        assert results["first"].ok and results["second"].ok
        assert torch.equal(first, data[:2]) and torch.equal(second, data[2:])
        stats = cache.stats().primary
        assert stats["promotions_shed"] == 0 and stats["promotion_waits"] >= 1


async def test_a_load_sheds_after_promotion_wait(faulty_tier_type: str) -> None:
    async with opened(chain(8, promotion_reserve=0.25, promotion_wait="30ms")) as (cache, tier):
        ks, data = keys(4), blocks(4)
        await only_in_the_tier(cache, ks, data)
        tier.gate = anyio.Event()
        results: dict[str, Any] = {}

        async def load(name: str, k: list[OffloadKey]) -> None:
            results[name] = await cache.load(k, torch.zeros(len(k), BLOCK, dtype=torch.uint8))

        async with anyio.create_task_group() as tg:
            tg.start_soon(load, "first", ks[:2])
            await anyio.sleep(0.02)
            with anyio.fail_after(1):
                await load("second", ks[2:])
            tier.gate.set()
        second = results["second"]
        assert second.failed_keys == tuple(ks[2:])
        assert all("promotion_wait" in why for why in second.errors.values())
        assert cache.stats().primary["promotions_shed"] == 2
        assert results["first"].ok


async def test_a_store_cascading_to_a_slow_tier_leaves_room_for_the_next_promotion(
    faulty_tier_type: str,
) -> None:
    """Requests one at a time: a store whose cascade is still on its way down must not
    hold the slots the next request's load promotes into (it used to take all but 2 of
    8 slots, and the load shed 1 of its 3 blocks)."""
    async with opened(chain(8, promotion_wait=0)) as (cache, tier):
        old, old_data = keys(3, "old"), blocks(3, 1)
        await only_in_the_tier(cache, old, old_data)
        tier.gate = anyio.Event()  # cascades (and promotions) wait from here on
        new, new_data = keys(6, "new"), blocks(6, 2)
        out = torch.zeros_like(old_data)
        results: dict[str, Any] = {}

        async def store() -> None:
            results["store"] = await cache.store(new, new_data)

        async def load() -> None:
            results["load"] = await cache.load(old, out)

        async with anyio.create_task_group() as tg:
            tg.start_soon(store)
            await anyio.sleep(0.02)  # its first window is placed, its cascade waits
            assert cache.primary.num_held == 4  # the promotions' half is left alone
            tg.start_soon(load)
            await anyio.sleep(0.02)
            tier.gate.set()
        assert results["load"].ok, results["load"].errors
        assert results["store"].ok and len(results["store"].stored) == 6
        assert torch.equal(out, old_data)
        assert cache.stats().primary["promotions_shed"] == 0


async def test_a_store_larger_than_its_room_streams_around_the_promotions_share(
    faulty_tier_type: str,
) -> None:
    async with opened(chain(8)) as (cache, tier):
        ks, data = keys(12), blocks(12)
        stored = await cache.store(ks, data)
        assert stored.ok and len(stored.stored) == 12
        await cache.flush()
        assert tier.stored_keys() >= set(ks)
        # no store job carried more than the store's room (8 slots less a share of 4)
        assert max(len(k) for op, k in tier.calls if op == "store") <= 4


def test_promotion_wait_must_be_a_duration_of_zero_or_more(faulty_tier_type: str) -> None:
    with pytest.raises(ConfigError, match="promotion_wait"):
        parse_config(chain(8, promotion_wait="-1s"))
    assert parse_config(chain(8, promotion_wait="20ms")).promotion_wait == pytest.approx(0.02)


async def test_a_store_of_a_block_a_failing_promotion_is_writing_stores_it_itself(
    faulty_tier_type: str,
) -> None:
    """A store meets its key being written by a promotion. `already_present` would be
    a lie if that promotion then fails: the store waits for it and, when it failed,
    writes the block itself (issue 20, item 6)."""
    async with opened(chain(8)) as (cache, tier):
        (k,) = keys(1, "contested")
        data = blocks(1, 3)
        tier.lie_about = {k}  # the tier claims it; its load will fail
        tier.gate = anyio.Event()
        results: dict[str, Any] = {}

        async def load() -> None:
            results["load"] = await cache.load([k], torch.zeros(1, BLOCK, dtype=torch.uint8))

        async def store() -> None:
            results["store"] = await cache.store([k], data)

        async with anyio.create_task_group() as tg:
            await cache.lookup([[k]])
            tg.start_soon(load)
            while k not in cache.primary:  # the promotion has reserved its slot
                await anyio.sleep(0.001)
            tg.start_soon(store)
            await anyio.sleep(0.05)
            assert "store" not in results, "the store waits for the write in flight"
            tier.gate.set()
        assert results["load"].failed_keys == (k,)
        assert results["store"].stored == (k,) and results["store"].already_present == ()
        out = torch.zeros(1, BLOCK, dtype=torch.uint8)
        assert (await cache.load([k], out)).ok
        assert torch.equal(out, data)


async def test_a_store_of_a_block_a_succeeding_promotion_is_writing_reports_it_present(
    faulty_tier_type: str,
) -> None:
    async with opened(chain(8)) as (cache, tier):
        ks, data = keys(2, "promoted"), blocks(2, 4)
        await only_in_the_tier(cache, ks, data)
        tier.gate = anyio.Event()
        results: dict[str, Any] = {}

        async def load() -> None:
            results["load"] = await cache.load(ks[:1], torch.zeros(1, BLOCK, dtype=torch.uint8))

        async def store() -> None:
            results["store"] = await cache.store(ks, blocks(2, 5))

        async with anyio.create_task_group() as tg:
            await cache.lookup([ks[:1]])
            tg.start_soon(load)
            while ks[0] not in cache.primary:
                await anyio.sleep(0.001)
            tg.start_soon(store)
            await anyio.sleep(0.05)
            assert "store" not in results
            tier.gate.set()
        assert results["load"].ok
        assert results["store"].already_present == (ks[0],)
        assert results["store"].stored == (ks[1],)
