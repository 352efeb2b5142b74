"""Prefetch for queued requests (issue 21, item 3): stage 1 into the primary ahead of
the request's turn, under a budget running loads always win.

Real tiers: the memory tier (its `faulty` variant, whose jobs can wait on a gate or
fail), and nvme in a temporary directory.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from tierkv.cache import TieredCache
from tierkv.cache.prefetch import Prefetch
from tierkv.config import parse_config
from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.room import Kind
from tierkv.testing import FaultyTier

pytestmark = pytest.mark.anyio

BLOCK = 1024
_fillers = itertools.count()


def keys(n: int, tag: str = "k") -> list[OffloadKey]:
    return [
        make_offload_key(h, 0) for h in hash_token_blocks(list(range(16 * n)), 16, namespace=tag)
    ]


def blocks(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, BLOCK), dtype=torch.uint8, generator=g)


def ctx(request_id: str) -> ReqContext:
    return ReqContext(request_id=request_id)


def nvme(tmp_path: Path) -> dict[str, Any]:
    return {"type": "nvme", "path": str(tmp_path / "nvme"), "capacity": "1MiB", "fsync": "never"}


def chain(tiers: list[dict[str, Any]], primary_blocks: int = 16, **top: Any) -> dict[str, Any]:
    # 16 slots, promotion reserve 0.5: promotions hold 8, prefetches (share 0.5) 4
    return {
        "namespace": "prefetch",
        "layout": {"block_bytes": BLOCK, "groups": [{"block_size": 16}]},
        "primary": {"capacity": primary_blocks * BLOCK, "pin_memory": False},
        "tiers": tiers,
        **top,
    }


@asynccontextmanager
async def opened(config: dict[str, Any]) -> AsyncIterator[TieredCache]:
    async with TieredCache(parse_config(config)) as cache:
        yield cache
        for tier in cache.tier_names:
            if isinstance(faulty := cache.tier(tier), FaultyTier):
                faulty.gate = None
        await cache.flush()


async def only_below(cache: TieredCache, ks: list[OffloadKey], data: torch.Tensor) -> None:
    """Store `ks` (reaching every tier), then push them out of the primary."""
    assert (await cache.store(ks, data)).ok
    await cache.flush()
    n = cache.primary.num_blocks
    assert (await cache.store(keys(n, f"filler{next(_fillers)}"), blocks(n, 9))).ok
    await cache.flush()
    assert not any(k in cache.primary for k in ks)


def room(cache: TieredCache) -> tuple[int, int, int]:
    """(free + evictable, held, promoting) slots of the primary."""
    p = cache.primary
    return p.num_free + p.num_evictable, p.num_held, p.num_staged


def assert_nothing_left(cache: TieredCache) -> None:
    p = cache.primary
    assert p.num_held == 0 and p.num_staged == 0
    assert cache.index.promoting == 0
    prefetches = cache.promoter.prefetches
    assert prefetches.holding == 0 and not prefetches.active


def tier_reads(cache: TieredCache, name: str) -> tuple[int, int]:
    stats = cache.stats().tiers[name]
    return stats["load_jobs"], stats["blocks_loaded"]


async def until(condition: Any, timeout: float = 2.0) -> None:
    with anyio.fail_after(timeout):
        while not condition():
            await anyio.sleep(0.002)


async def test_prefetch_then_load_reads_no_tier_and_is_byte_identical(tmp_path: Path) -> None:
    async with opened(chain([nvme(tmp_path)])) as cache:
        ks, data = keys(4), blocks(4)
        await only_below(cache, ks, data)
        before = room(cache)
        p = cache.prefetch([ks], ctx("r1"))  # returns at once: nothing read yet
        assert isinstance(p, Prefetch) and not p.done
        await p.wait()
        assert p.promoted == ks and p.held == set(ks) and not p.shed and not p.failed
        assert cache.primary.num_held == 4  # held for the request: not evictable
        reads = tier_reads(cache, "nvme")
        assert reads == (1, 4)  # one window, one tier job

        out = torch.zeros_like(data)
        result = await cache.load(ks, out, ctx("r1"))
        assert result.ok and set(result.sources.values()) == {"cpu"}
        assert torch.equal(out, data)
        assert tier_reads(cache, "nvme") == reads  # the load read no tier
        stats = cache.stats().primary
        assert stats["prefetched_blocks"] == 4 and stats["prefetch_used"] == 4
        assert stats["prefetch_cancelled"] == 0 and stats["prefetch_shed"] == 0
        assert room(cache) == before  # the load released the prefetch: all evictable again
        assert p.held == set() and cache.cancel_prefetch("r1") == 0
        assert_nothing_left(cache)


async def test_prefetch_of_a_lookup_result_and_of_keys_past_the_hit(tmp_path: Path) -> None:
    """A `LookupResult` is prefetched as is; keys past the hit (the first block no tier
    holds) are not prefetched."""
    async with opened(chain([{"type": "memory"}, nvme(tmp_path)])) as cache:
        ks, data = keys(3), blocks(3)
        await only_below(cache, ks, data)
        hit = await cache.lookup([ks])
        p = cache.prefetch(hit, ctx("a"))
        await p.wait()
        assert p.promoted == ks
        cache.cancel_prefetch(ctx("a"))

        more = keys(6, "more")
        await only_below(cache, more[:2] + more[3:], blocks(5, 3))  # block 2 is nowhere
        p = cache.prefetch([more], ctx("b"))
        await p.wait()
        assert p.promoted == more[:2]  # the hit ends at block 2
        assert cache.cancel_prefetch("b") == 1
        assert_nothing_left(cache)


@pytest.mark.parametrize("same_request", [True, False])
async def test_a_load_during_a_prefetch_joins_its_flight(
    faulty_tier_type: str, same_request: bool
) -> None:
    async with opened(chain([{"type": "faulty"}])) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        ks, data = keys(4), blocks(4)
        await only_below(cache, ks, data)
        tier.calls.clear()
        tier.gate = anyio.Event()
        p = cache.prefetch([ks], ctx("r1"))
        await until(lambda: cache.primary.num_staged == 4)  # the window reads, gated
        out = torch.zeros_like(data)
        results: dict[str, Any] = {}

        async def load() -> None:
            results["load"] = await cache.load(ks, out, ctx("r1" if same_request else "r2"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(load)
            await anyio.sleep(0.02)
            assert "load" not in results  # waiting on the prefetch's window
            tier.gate.set()
        result = results["load"]
        assert result.ok and torch.equal(out, data)
        read = [k for op, call in tier.calls if op == "load" for k in call]
        assert sorted(read) == sorted(ks)  # one tier read per key
        await p.wait()
        stats = cache.stats().primary
        assert stats["prefetched_blocks"] == 4 and stats["prefetch_used"] == 4
        if same_request:  # the request's load ended its prefetch
            assert p.held == set() and cache.primary.num_held == 0
        else:  # another request's load: the prefetch still holds them for its own
            assert p.held == set(ks) and cache.primary.num_held == 4
            assert cache.cancel_prefetch("r1") == 1
            assert cache.stats().primary["prefetch_cancelled"] == 0  # they were used
        assert_nothing_left(cache)


async def test_cancel_releases_held_blocks_and_a_window_in_flight(faulty_tier_type: str) -> None:
    async with opened(chain([{"type": "faulty"}])) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        ks, data = keys(8), blocks(8)
        await only_below(cache, ks, data)
        before = room(cache)

        held = cache.prefetch([ks[:4]], ctx("held"))
        await held.wait()
        assert room(cache) == (before[0] - 4, 4, 0)
        assert cache.cancel_prefetch(ctx("held")) == 1
        assert room(cache) == before  # promoted blocks stay, as ordinary evictable blocks
        assert all(cache.primary.is_ready(k) for k in ks[:4])

        tier.gate = anyio.Event()
        reading = cache.prefetch([ks[4:]], ctx("reading"))
        await until(lambda: cache.primary.num_staged == 4)
        reading.cancel()
        tier.gate.set()
        await reading.wait()
        await cache.flush()
        assert reading.promoted == ks[4:] and reading.held == set()
        assert room(cache) == before  # the window landed evictable: no slot leaked
        assert cache.stats().primary["prefetch_cancelled"] == 8
        out = torch.zeros_like(data)
        result = await cache.load(ks, out)
        assert result.ok and torch.equal(out, data)
        assert set(result.sources.values()) == {"cpu"}
        assert_nothing_left(cache)


async def test_the_budget_caps_prefetches_and_a_concurrent_load_gets_its_room(
    faulty_tier_type: str,
) -> None:
    """16 slots, reserve 0.5: promotions hold 8, prefetches 4 of them."""
    async with opened(chain([{"type": "faulty"}], promotion_wait="2s")) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        queued, running = keys(8, "queued"), keys(4, "running")
        data = blocks(4, 1)
        await only_below(cache, queued, blocks(8, 2))
        await only_below(cache, running, data)
        assert cache.promoter.prefetches.budget == 4
        tier.gate = anyio.Event()
        p = cache.prefetch([queued], ctx("q"))
        await until(lambda: cache.primary.num_staged == 4)
        assert cache.primary.promotion_room() == 4  # the rest of the reserve is the loads'
        out = torch.zeros_like(data)
        results: dict[str, Any] = {}

        async def load() -> None:
            results["load"] = await cache.load(running, out, ctx("run"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(load)
            await until(lambda: cache.primary.num_staged == 8)  # the load got its room at once
            tier.gate.set()
        await p.wait()
        assert results["load"].ok and torch.equal(out, data)
        assert p.promoted == queued[:4] and p.shed == queued[4:]
        stats = cache.stats().primary
        assert stats["prefetch_shed"] == 4 and stats["promotions_shed"] == 0
        assert stats["promotion_waits"] == 0
        # a second prefetch finds the budget held by the first: it sheds everything
        second = cache.prefetch([queued[4:]], ctx("q2"))
        await second.wait()
        assert second.promoted == [] and second.shed == queued[4:]
        cache.cancel_prefetch("q")
        assert_nothing_left(cache)


async def test_a_prefetch_never_takes_room_a_waiting_load_waits_for(
    faulty_tier_type: str,
) -> None:
    """Reserve 0.25 of 16: promotions hold 4. One load holds them, a second waits: a
    prefetch starts nothing until the waiting load has its room (wait) or sheds
    (best_effort)."""
    config = chain([{"type": "faulty"}], promotion_reserve=0.25, promotion_wait="2s")
    async with opened(config) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        first, second, queued = keys(4, "a"), keys(2, "b"), keys(2, "q")
        await only_below(cache, first + second + queued, blocks(8, 4))
        tier.gate = anyio.Event()
        results: dict[str, Any] = {}

        async def load(name: str, ks: list[OffloadKey]) -> None:
            out = torch.zeros(len(ks), BLOCK, dtype=torch.uint8)
            results[name] = await cache.load(ks, out, ctx(name))

        async with anyio.create_task_group() as tg:
            tg.start_soon(load, "first", first)
            await until(lambda: cache.primary.num_staged == 4)
            tg.start_soon(load, "second", second)
            await until(lambda: cache.primary.waiting(Kind.PROMOTION) == 1)
            eager = cache.prefetch([queued], ctx("eager"))
            patient = cache.prefetch([queued], ctx("patient"), policy="wait", timeout=2)
            await eager.wait()
            assert eager.promoted == [] and eager.shed == queued  # a load waits: shed
            await anyio.sleep(0.03)
            assert not patient.done and cache.primary.num_staged == 4
            tier.gate.set()
        await patient.wait()
        assert results["first"].ok and results["second"].ok
        assert patient.promoted == queued
        assert cache.stats().primary["promotions_shed"] == 0
        cache.cancel_prefetch("patient")
        assert_nothing_left(cache)


async def test_a_load_taking_over_its_prefetch_keeps_the_room_it_still_needs(
    faulty_tier_type: str,
) -> None:
    """A's load takes over A's prefetch (4 blocks held, the whole budget), which wakes
    B's `wait` prefetch; A has 20 more blocks to promote, in windows of 4 (16 slots,
    promotions hold 8). While A has blocks left to promote (`owed`), B starts nothing,
    even when a window of A lands and frees room: that room is A's next window. Once A
    has started its last window, B gets the room A leaves."""
    async with opened(chain([{"type": "faulty"}], promotion_wait="2s")) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        a, b = keys(24, "a"), keys(4, "b")
        data = blocks(24, 3)
        await only_below(cache, a, data)
        await only_below(cache, b, blocks(4, 4))
        prefetches = cache.promoter.prefetches
        early = cache.prefetch([a[:4]], ctx("A"))
        await early.wait()
        assert early.promoted == a[:4] and prefetches.holding == prefetches.budget == 4
        patient = cache.prefetch([b], ctx("B"), policy="wait", timeout=5)
        await until(lambda: prefetches.waiting_for_room == 1)
        tier.gate = anyio.Event()
        out = torch.zeros_like(data)
        results: dict[str, Any] = {}

        async def load() -> None:
            results["A"] = await cache.load(a, out, ctx("A"))

        owing_seen = 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(load)
            await until(lambda: cache.primary.num_staged > 0)  # A's windows are reading
            while "A" not in results:
                if prefetches.owed > 0:
                    owing_seen += 1
                    assert patient.window is None and patient.promoted == []
                # let the windows reading now land, one step at a time; B polls meanwhile
                tier.gate.set()
                await anyio.sleep(0)
                tier.gate = anyio.Event()
                await anyio.sleep(0.015)
            tier.gate.set()
        assert owing_seen >= 2  # the check above ran while A had windows left to start
        assert prefetches.owed == 0
        assert results["A"].ok and torch.equal(out, data)
        await patient.wait()
        assert patient.promoted == b
        stats = cache.stats().primary
        assert stats["promotion_waits"] == 0 and stats["promotions_shed"] == 0
        cache.cancel_prefetch("B")
        assert_nothing_left(cache)


async def test_best_effort_sheds_at_once_and_wait_gives_up_after_its_timeout(
    faulty_tier_type: str,
) -> None:
    config = chain([{"type": "faulty"}], promotion_reserve=0.25, promotion_wait="2s")
    async with opened(config) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        running, queued = keys(4, "run"), keys(2, "q")
        await only_below(cache, running + queued, blocks(6, 5))
        tier.gate = anyio.Event()
        async with anyio.create_task_group() as tg:
            out = torch.zeros(4, BLOCK, dtype=torch.uint8)
            tg.start_soon(cache.load, running, out, ctx("run"))
            await until(lambda: cache.primary.promotion_room() == 0)
            eager = cache.prefetch([queued], ctx("eager"))
            short = cache.prefetch([queued], ctx("short"), policy="wait", timeout=0.05)
            long = cache.prefetch([queued], ctx("long"), policy="wait", timeout=5)
            with anyio.fail_after(1):
                await eager.wait()
            assert eager.shed == queued
            started = anyio.current_time()
            await short.wait()
            assert anyio.current_time() - started < 1
            assert short.shed == queued and not long.done
            await until(lambda: cache.promoter.prefetches.waiting_for_room == 1)  # long
            tier.gate.set()
        await long.wait()
        assert long.promoted == queued and not long.shed
        assert cache.promoter.prefetches.waiting_for_room == 0
        assert cache.stats().primary["prefetch_shed"] == 4
        cache.cancel_prefetch("long")
        assert_nothing_left(cache)


async def test_close_with_a_prefetch_in_flight_and_one_holding(faulty_tier_type: str) -> None:
    config = chain([{"type": "faulty"}], close_timeout="100ms")
    cache = TieredCache(parse_config(config))
    async with cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        ks = keys(4)
        await only_below(cache, ks, blocks(4))
        holding = cache.prefetch([ks[:2]], ctx("holding"))
        await holding.wait()
        tier.gate = anyio.Event()  # never set: close() cancels the window
        reading = cache.prefetch([ks[2:]], ctx("reading"))
        await until(lambda: cache.primary.num_staged == 2)
    assert holding.done and reading.done and not cache.is_open
    assert reading.promoted == [] and set(reading.failed) == set(ks[2:])
    assert holding.held == set()
    assert cache.core.background == 0
    assert_nothing_left(cache)


async def test_a_prefetch_whose_tier_fails_falls_back_down_the_chain(
    faulty_tier_type: str, tmp_path: Path
) -> None:
    async with opened(chain([{"type": "faulty"}, nvme(tmp_path)])) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        ks, data = keys(4), blocks(4)
        await only_below(cache, ks, data)
        tier.fail_jobs = 1
        p = cache.prefetch([ks], ctx("r"))
        await p.wait()
        assert p.promoted == ks and not p.failed
        reads = tier_reads(cache, "nvme")
        assert reads[1] == 4
        out = torch.zeros_like(data)
        result = await cache.load(ks, out, ctx("r"))
        assert result.ok and torch.equal(out, data)
        assert tier_reads(cache, "nvme") == reads
        assert_nothing_left(cache)


async def test_a_failed_prefetch_leaves_nothing_behind(faulty_tier_type: str) -> None:
    async with opened(chain([{"type": "faulty"}])) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        ks, data = keys(4), blocks(4)
        await only_below(cache, ks, data)
        before = room(cache)
        tier.fail_jobs = 1
        p = cache.prefetch([ks], ctx("r"))
        await p.wait()
        await cache.flush()
        assert p.promoted == [] and set(p.failed) == set(ks) and p.held == set()
        assert room(cache) == before and not any(k in cache.primary for k in ks)
        assert_nothing_left(cache)
        # the later load is an ordinary load: the tier that failed is not believed
        # again until the blocks are stored there again (as after a failed load)
        out = torch.zeros_like(data)
        result = await cache.load(ks, out, ctx("r"))
        assert result.failed_keys == tuple(ks) and all(result.errors.values())
        await only_below(cache, ks, data)
        result = await cache.load(ks, out, ctx("r"))
        assert result.ok and torch.equal(out, data)
        assert_nothing_left(cache)


async def test_bad_arguments_raise_and_change_nothing(tmp_path: Path) -> None:
    async with opened(chain([nvme(tmp_path)])) as cache:
        ks = keys(2)
        with pytest.raises(ValueError, match="request_id"):
            cache.prefetch([ks], ReqContext())
        with pytest.raises(ValueError, match="groups"):
            cache.prefetch([ks, ks], ctx("r"))
        with pytest.raises(ValueError, match="keys_per_group"):
            cache.prefetch([[b"x"]], ctx("r"))
        with pytest.raises(ValueError, match="timeout"):
            cache.prefetch([ks], ctx("r"), policy="wait")
        with pytest.raises(ValueError, match="timeout"):
            cache.prefetch([ks], ctx("r"), timeout=1.0)
        with pytest.raises(ValueError, match="policy"):
            cache.prefetch([ks], ctx("r"), policy="eager")  # type: ignore[arg-type]
        assert not cache.promoter.prefetches.active
        assert cache.cancel_prefetch("r") == 0 and cache.cancel_prefetch(ReqContext()) == 0
