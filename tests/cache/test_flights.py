"""The `FlightRunner`: stage 1 of a promotion, shared by loads and prefetches. It
reserves the window's slots from the promotion share, points the index at its flight,
reads it, and hands each waiter a reader when it lands; and the seam a load uses to
keep prefetches off the room it will take (`Prefetcher.owe` / `settle`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import torch

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key

pytestmark = pytest.mark.anyio

BLOCK = 1024


def keys(n: int, tag: str = "k") -> list[OffloadKey]:
    return [
        make_offload_key(h, 0) for h in hash_token_blocks(list(range(16 * n)), 16, namespace=tag)
    ]


@asynccontextmanager
async def below(n: int) -> AsyncIterator[tuple[TieredCache, list[OffloadKey]]]:
    """A cache of 8 slots (promotions may hold 4) whose memory tier alone holds `n`
    blocks."""
    config = {
        "namespace": "flights",
        "layout": {"block_bytes": BLOCK, "groups": [{"block_size": 16}]},
        "primary": {"capacity": 8 * BLOCK, "pin_memory": False},
        "tiers": [{"type": "memory"}],
    }
    async with TieredCache(parse_config(config)) as cache:
        ks = keys(n)
        assert (await cache.store(ks, torch.ones(n, BLOCK, dtype=torch.uint8))).ok
        await cache.flush()
        fill = torch.zeros(8, BLOCK, dtype=torch.uint8)
        assert (await cache.store(keys(8, "filler"), fill)).ok
        await cache.flush()
        assert not any(k in cache.primary for k in ks)
        yield cache, ks
        await cache.flush()
        assert cache.primary.num_held == 0 and cache.index.promoting == 0


async def test_a_window_reads_what_fits_the_share_and_names_the_first_refused() -> None:
    async with below(6) as (cache, ks):
        runner = cache.promoter.flights
        flight, refused = runner.start(ks[:6], ReqContext())
        assert flight is not None and flight.keys == ks[:4]  # the share: 4 slots
        assert refused == ks[4]
        assert all(cache.index.flight(k) is flight for k in ks[:4])
        assert cache.primary.num_staged == 4
        await flight.wait()
        assert cache.index.promoting == 0 and cache.primary.num_staged == 0
        for k in flight.keys:  # whoever started it gets one reader on each block
            assert flight.take(k) == "memory" and flight.take(k) is None
        cache.primary.complete_load(flight.keys)


async def test_keys_already_promoting_or_resident_start_no_window() -> None:
    async with below(2) as (cache, ks):
        runner = cache.promoter.flights
        first, _ = runner.start(ks[:1], ReqContext())
        assert first is not None
        again, refused = runner.start(ks[:1], ReqContext())  # in flight: join it instead
        assert again is None and refused is None
        await first.wait()
        assert first.take(ks[0]) == "memory"
        cache.primary.complete_load([ks[0]])
        resident, refused = runner.start(ks[:1], ReqContext())
        assert resident is None and refused is None


async def test_a_failed_read_is_reported_and_frees_the_slot() -> None:
    async with below(1) as (cache, ks):
        await cache.tier("memory").remove(ks)  # gone without telling the cache
        flight, _ = cache.promoter.flights.start(ks, ReqContext())
        assert flight is not None
        await flight.wait()
        assert flight.take(ks[0]) is None and ks[0] not in cache.primary
        assert flight.error(ks[0]) == "not in the memory tier"  # the tier's own reason
        assert cache.index.location(ks[0]) is None  # its claim is not believed again


async def test_loads_owe_room_to_the_prefetches_and_settle_it() -> None:
    async with below(1) as (cache, _):
        prefetches = cache.promoter.prefetches
        room = cache.primary.promotion_room()
        assert prefetches.room() == prefetches.budget < room  # the budget bounds it now
        prefetches.owe(room - 1)  # a load will take all but one slot of the room
        assert prefetches.owed == room - 1 and prefetches.room() == 1
        prefetches.settle(room - 1)
        assert prefetches.owed == 0 and prefetches.room() == prefetches.budget
