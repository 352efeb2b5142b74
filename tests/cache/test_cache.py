"""`TieredCache` scenarios with exact expectations (ported from the old orchestrator
tests; where issue 10 changed a semantic on purpose, the test says so).

Blocks are 1 KiB; the primary holds 4 blocks unless a test says otherwise, so
eviction and promotion happen after a handful of stores.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from tierkv.cache import TieredCache
from tierkv.cache.results import StoreResult
from tierkv.config import parse_config
from tierkv.contract.errors import TierUnavailable
from tierkv.contract.events import OffloadingEvent
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.memory_tier import MemoryTier
from tierkv.testing import FaultyTier

pytestmark = pytest.mark.anyio

BLOCK = 1024


def chain(tiers: Sequence[dict[str, Any]], *, blocks: int = 4, **top: Any) -> dict[str, Any]:
    return {
        "namespace": "test",
        "layout": {"block_bytes": BLOCK, "groups": [{"block_size": 16}]},
        "primary": {"capacity": blocks * BLOCK, "eviction": "lru", "pin_memory": False},
        "tiers": list(tiers),
        **top,
    }


@asynccontextmanager
async def open_cache(config: dict[str, Any]) -> AsyncIterator[TieredCache]:
    async with TieredCache(parse_config(config)) as cache:
        yield cache
        await cache.flush()
        assert_no_leaks(cache)


def assert_no_leaks(cache: TieredCache) -> None:
    """Every slot reader, reservation and flight taken was given back."""
    p = cache.primary
    for key in p.keys_in_slots():
        assert p.is_ready(key), f"{key!r} left half-written"
        assert p.readers(key) == 0, f"{key!r} leaked a reader"
    assert p.num_evictable == len(p)
    assert cache.core.index.promoting == 0
    assert cache.primary.num_staged == 0
    assert cache.index.promoting == 0
    assert all(cache.index.cascading(k) == 0 for k in cache.index.known_keys())
    assert all(h.stats.inflight_bytes == 0 for h in cache.core.tiers)
    for key in cache.index.dirty_keys():
        assert key in p, "a dirty block left the primary unwritten"


def keys(n: int, tag: str = "k") -> list[OffloadKey]:
    return [
        make_offload_key(h, 0) for h in hash_token_blocks(list(range(16 * n)), 16, namespace=tag)
    ]


def blocks(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, BLOCK), dtype=torch.uint8, generator=g)


def empty(n: int) -> torch.Tensor:
    return torch.zeros((n, BLOCK), dtype=torch.uint8)


def memory(**kw: Any) -> dict[str, Any]:
    return {"type": "memory", **kw}


def faulty(**kw: Any) -> dict[str, Any]:
    return {"type": "faulty", **kw}


# -- round trips and cascade ---------------------------------------------------------------
async def test_store_lookup_load_from_the_primary() -> None:
    async with open_cache(chain([])) as cache:
        ks, data = keys(3), blocks(3)
        result = await cache.store(ks, data)
        assert result.stored == tuple(ks) and result.ok
        hit = await cache.lookup([ks])
        assert hit.hit_tokens == 48 and hit.keys_to_load == tuple(ks)
        assert dict(hit.locations) == {k: "cpu" for k in ks}
        out = empty(3)
        loaded = await cache.load(ks, out)
        assert loaded.ok and dict(loaded.sources) == {k: "cpu" for k in ks}
        assert torch.equal(out, data)
        again = await cache.store(ks, data)
        assert again.stored == () and again.already_present == tuple(ks)


async def test_cascade_reaches_every_tier_once_and_events_come_in_order(
    faulty_tier_type: str,
) -> None:
    # 8 slots: 3 blocks fit the store's room (half is the promotions' share) in one window
    async with open_cache(chain([faulty(), memory()], blocks=8)) as cache:
        ks = keys(3)
        await cache.store(ks, blocks(3))
        await cache.flush()
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        assert tier.calls == [("store", tuple(ks))]
        assert len(cache.tier("memory")) == 3  # type: ignore[arg-type]
        events = cache.take_events()
        assert events[0] == OffloadingEvent(tuple(ks), "cpu", removed=False)
        assert {(e.medium, e.keys) for e in events[1:]} == {
            ("faulty", tuple(ks)),
            ("memory", tuple(ks)),
        }
        stats = cache.stats()
        assert stats.tiers["faulty"]["blocks_stored"] == 3
        assert stats.tiers["memory"]["bytes_in"] == 3 * BLOCK


async def test_a_block_is_protected_while_cascading_and_evictable_after(
    faulty_tier_type: str,
) -> None:
    # changed on purpose (issue 10): a store with no room waits for cascades to release
    # slots, up to store_timeout, instead of being rejected at once
    async with open_cache(chain([faulty()], blocks=2, store_timeout="100ms")) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        tier.gate = anyio.Event()
        first = keys(2, "a")
        await cache.store(first, blocks(2))
        assert cache.primary.num_evictable == 0  # both held by the running cascade
        blocked = await cache.store(keys(1, "b"), blocks(1))  # waited 100ms, then rejected
        assert blocked.rejected == tuple(keys(1, "b")) and not blocked.stored
        assert blocked.error is not None and "store_timeout" in blocked.error
        assert set(cache.primary.keys_in_slots()) == set(first)  # nothing was evicted for it
        tier.gate.set()
        await cache.flush()
        assert cache.primary.num_evictable == 2
        later = await cache.store(keys(1, "b"), blocks(1))
        assert later.stored
        assert [e.removed for e in cache.take_events() if e.medium == "cpu"][-2:] == [True, False]


async def test_a_waiting_store_goes_through_once_the_cascade_answers(
    faulty_tier_type: str,
) -> None:
    async with open_cache(chain([faulty()], blocks=2)) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        tier.gate = anyio.Event()
        await cache.store(keys(2, "a"), blocks(2))
        results: list[Any] = []
        async with anyio.create_task_group() as tg:

            async def second() -> None:
                results.append(await cache.store(keys(1, "b"), blocks(1, seed=2)))

            tg.start_soon(second)
            await anyio.sleep(0.02)
            assert not results  # waiting for room, not rejected
            tier.gate.set()
        assert results[0].ok and results[0].stored == tuple(keys(1, "b"))


async def test_a_failed_store_never_cascades(faulty_tier_type: str) -> None:
    class Exploding:
        def __len__(self) -> int:
            return 2

        async def copy_to_slots(self, view: Any, indices: Any, slots: Any) -> None:
            raise RuntimeError("GPU copy failed")

    async with open_cache(chain([faulty()])) as cache:
        ks = keys(2)
        with pytest.raises(RuntimeError, match="GPU copy failed"):
            await cache.store(ks, Exploding())
        await cache.flush()
        assert cache.tier("faulty").calls == []  # type: ignore[attr-defined]
        assert len(cache.primary) == 0 and cache.primary.num_free == 4


# -- promotion ---------------------------------------------------------------------------------
async def evict_all(cache: TieredCache, n: int = 4) -> None:
    """Fill the primary with unrelated blocks so earlier ones leave it."""
    await cache.store(keys(n, "filler"), blocks(n, seed=99))
    await cache.flush()


async def test_promotion_of_blocks_found_only_in_tier_2_of_2(faulty_tier_type: str) -> None:
    config = chain(
        [faulty(write_policy="write_through_selective", min_hits=99), memory()],
        promotion_reserve=1.0,
    )
    async with open_cache(config) as cache:
        ks, data = keys(3), blocks(3)
        await cache.store(ks, data)
        await cache.flush()
        await evict_all(cache)
        hit = await cache.lookup([ks])
        assert hit.hit_tokens == 48
        assert dict(hit.locations) == {k: "memory" for k in ks}
        out = empty(3)
        result = await cache.load(hit.keys_to_load, out)
        assert result.ok and set(result.sources.values()) == {"memory"}
        assert torch.equal(out, data)
        assert cache.primary.lookup(ks) == 3  # promoted into the primary
        faulty_tier = cache.tier("faulty")
        # location-aware (issue 10): the tier lookup found lacking the keys gets no job
        assert [op for op, _ in faulty_tier.calls] == ["lookup"]  # type: ignore[attr-defined]


async def test_partial_hit_stops_at_the_first_block_missing_everywhere() -> None:
    async with open_cache(chain([memory()])) as cache:
        ks = keys(4)
        await cache.store(ks, blocks(4))
        await cache.flush()
        await evict_all(cache)
        await cache.tier("memory").remove([ks[2]])
        hit = await cache.lookup([ks])
        assert hit.hit_tokens == 32 and hit.keys_to_load == tuple(ks[:2])


async def test_promotions_of_one_request_are_one_job_per_tier(faulty_tier_type: str) -> None:
    async with open_cache(chain([faulty()], blocks=8, promotion_reserve=1.0)) as cache:
        ks = keys(5)
        await cache.store(ks, blocks(5))
        await cache.flush()
        await evict_all(cache, 8)
        tier = cache.tier("faulty")
        tier.calls.clear()  # type: ignore[attr-defined]
        result = await cache.load(ks, empty(5))
        assert result.ok
        assert tier.calls == [("load", tuple(ks))]  # type: ignore[attr-defined]


async def test_concurrent_loads_of_one_key_share_one_promotion(faulty_tier_type: str) -> None:
    async with open_cache(chain([faulty()])) as cache:
        ks, data = keys(2), blocks(2)
        await cache.store(ks, data)
        await cache.flush()
        await evict_all(cache)
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        tier.calls.clear()
        tier.gate = anyio.Event()
        outs = [empty(2), empty(2), empty(1)]
        results: list[Any] = [None] * 3
        async with anyio.create_task_group() as tg:

            async def run(i: int, ks_: list[OffloadKey]) -> None:
                results[i] = await cache.load(ks_, outs[i])

            tg.start_soon(run, 0, ks)
            tg.start_soon(run, 1, ks)
            tg.start_soon(run, 2, ks[1:])
            await anyio.sleep(0.05)
            tier.gate.set()
        assert all(r.ok for r in results)
        assert tier.calls == [("load", tuple(ks))]
        assert torch.equal(outs[0], data) and torch.equal(outs[1], data)
        assert torch.equal(outs[2], data[1:])


async def test_a_failed_load_invalidates_the_claim(faulty_tier_type: str) -> None:
    async with open_cache(chain([faulty()])) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        ghost = keys(1, "ghost")
        tier.lie_about = set(ghost)
        hit = await cache.lookup([ghost])
        assert hit.hit_tokens == 16  # the tier claims it
        result = await cache.load(ghost, empty(1))
        assert result.failed_keys == tuple(ghost) and "lied" in result.errors[ghost[0]]
        hit = await cache.lookup([ghost])
        assert hit.hit_tokens == 0  # not believed again: no re-promotion loop


# -- write policies -----------------------------------------------------------------------------
async def test_write_back_demotes_before_freeing() -> None:
    async with open_cache(chain([memory(write_policy="write_back")])) as cache:
        first, data = keys(4, "a"), blocks(4)
        await cache.store(first, data)
        tier = cache.tier("memory")
        await cache.flush()
        # under pressure blocks were demoted; none was freed before its copy existed
        assert len(tier) == 4  # type: ignore[arg-type]
        cache.take_events()
        await cache.store(keys(2, "b"), blocks(2, seed=5))
        await cache.flush()
        events = cache.take_events()
        removed = [e for e in events if e.removed]
        assert removed and removed[0].medium == "cpu"
        for event in removed:
            for key in event.keys:
                assert await tier.lookup([key], None) == [True]  # type: ignore[arg-type]
        out = empty(4)
        assert (await cache.load(first, out)).ok and torch.equal(out, data)


async def test_write_back_writes_nothing_without_pressure() -> None:
    async with open_cache(chain([memory(write_policy="write_back")], blocks=16)) as cache:
        await cache.store(keys(2), blocks(2))
        await anyio.sleep(0.01)
        assert len(cache.tier("memory")) == 0  # type: ignore[arg-type]
        assert cache.stats().primary["write_back_pending"] == 2
        await cache.flush()  # flush (and close) writes them
        assert len(cache.tier("memory")) == 2  # type: ignore[arg-type]


async def test_selective_write_needs_min_hits() -> None:
    config = chain([memory(write_policy="write_through_selective", min_hits=2)])
    async with open_cache(config) as cache:
        tier = cache.tier("memory")
        ks = keys(2)
        await cache.lookup([ks[:1]])  # ks[0] seen once before it is stored
        await cache.store(ks, blocks(2))
        await cache.flush()
        assert len(tier) == 0  # type: ignore[arg-type]
        await cache.lookup([ks[:1]])  # second sighting of ks[0]: written now
        await cache.flush()
        assert await tier.lookup(ks, None) == [True, False]  # type: ignore[arg-type]
        await cache.lookup([ks])
        await cache.lookup([ks])
        await cache.flush()
        assert await tier.lookup(ks, None) == [True, True]  # type: ignore[arg-type]


# -- admission, timeouts, failures -------------------------------------------------------------
async def test_promotion_reserve_holds_under_a_flood_of_lookups(faulty_tier_type: str) -> None:
    config = chain([faulty()], blocks=8, promotion_reserve=0.25, promotion_wait="10ms")
    async with open_cache(config) as cache:
        ks = keys(6)
        await cache.store(ks, blocks(6))
        await cache.flush()
        await evict_all(cache, 8)
        for _ in range(50):  # requests that look up and never load reserve nothing
            hit = await cache.lookup([ks])
            assert hit.hit_tokens == 96  # the true hit: the reserve bounds staging only
        assert cache.primary.num_free + cache.primary.num_evictable == 8
        assert (await cache.store(keys(1, "new"), blocks(1))).ok
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        tier.gate = anyio.Event()
        results: list[Any] = []
        async with anyio.create_task_group() as tg:

            async def run(k: list[OffloadKey]) -> None:
                results.append(await cache.load(k, empty(len(k))))

            tg.start_soon(run, ks[:2])
            await anyio.sleep(0.01)
            tg.start_soon(run, ks[2:4])  # the share is taken: shed after promotion_wait
            await anyio.sleep(0.05)
            assert len(results) == 1 and not results[0].ok_keys
            assert "within promotion_wait" in next(iter(results[0].errors.values()))
            assert (await cache.store(keys(1, "newer"), blocks(1))).ok  # stores still fit
            tier.gate.set()
        assert results[1].ok


async def test_lookup_timeout_counts_a_slow_tier_as_a_miss(faulty_tier_type: str) -> None:
    config = chain([faulty(lookup_delay="2s")], lookup_timeout="50ms")
    async with open_cache(config) as cache:
        ks = keys(2)
        tier = cache.tier("faulty")
        await tier.store(_job(cache, ks))
        with anyio.fail_after(1):
            hit = await cache.lookup([ks])
        assert hit.hit_tokens == 0
        assert cache.stats().tiers["faulty"]["lookup_timeouts"] == 1


def _job(cache: TieredCache, ks: list[OffloadKey]) -> Any:
    """A job storing zeros for `ks` straight into a tier (bypassing the cache)."""
    from tierkv.contract.jobs import JobMetadata

    return JobMetadata(10_000 + len(ks), tuple(ks), tuple(range(len(ks))))


async def test_a_failing_tier_opens_its_breaker_and_recovers(faulty_tier_type: str) -> None:
    config = chain([faulty(failure_threshold=2, recovery_after="100ms")], blocks=16)
    async with open_cache(config) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        tier.down = True
        for i in range(2):
            await cache.store(keys(1, f"x{i}"), blocks(1))
            await cache.flush()
        stats = cache.stats().tiers["faulty"]
        assert stats["breaker"] == "open" and stats["errors"] == 2
        calls = len(tier.calls)
        await cache.store(keys(1, "skipped"), blocks(1))
        hit = await cache.lookup([keys(1, "x0")])
        assert hit.hit_tokens == 16  # the primary still serves
        await cache.flush()
        assert len(tier.calls) == calls  # an open breaker sends nothing
        assert cache.stats().tiers["faulty"]["skipped_unhealthy"] >= 1
        tier.down = False
        await anyio.sleep(0.15)
        await cache.store(keys(1, "probe"), blocks(1))  # the probe
        await cache.flush()
        assert cache.stats().tiers["faulty"]["breaker"] == "closed"
        assert tier.stored_keys() == set(keys(1, "probe"))


async def test_job_deadlines_release_everything(faulty_tier_type: str) -> None:
    config = chain([faulty(job_timeout="100ms")])
    async with open_cache(config) as cache:
        ks = keys(2)
        await cache.store(ks, blocks(2))
        await cache.flush()
        await evict_all(cache)
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        tier.hang = True
        with anyio.fail_after(2):
            result = await cache.load(ks, empty(2))
        assert result.failed_keys == tuple(ks)
        # a hung tier keeps no deadline of its own: the driver's backstop ends the job
        # after its grace, and counts the breach
        assert "timed out after 0.35s (job_timeout=0.1s)" in result.errors[ks[0]]
        with anyio.fail_after(2):
            await cache.store(keys(2, "more"), blocks(2))
            await cache.flush()  # the hung cascade also ends at its backstop
        stats = cache.stats().tiers["faulty"]
        assert stats["errors"] >= 2 and stats["deadline_breaches"] >= 2
        assert stats["abandoned_jobs"] >= 2
        # the jobs left running hold their slots until they end, then give them back
        assert cache.primary.num_quarantined == 2
        tier.hang = False
        with anyio.fail_after(2):
            await cache.core.abandoned_ended()
        assert cache.primary.num_quarantined == 0


async def test_a_store_cut_by_the_tiers_deadline_keeps_what_it_stored(
    faulty_tier_type: str,
) -> None:
    """The tier's runner owns the deadline: a cascade that stored 4 of 8 blocks when
    its job_timeout came reports those 4 held (not 0 of 8), the breaker counts no
    failure, and a later load of all 8 finds the 4 in the tier."""
    config = chain([faulty(job_timeout="300ms", stall_after_keys=4)], blocks=32)
    async with open_cache(config) as cache:
        ks, data = keys(8), blocks(8)
        with anyio.fail_after(5):
            await cache.store(ks, data)
            await cache.flush()
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        assert tier.stored_keys() == set(ks[:4])
        stats = cache.stats().tiers["faulty"]
        assert stats["blocks_stored"] == 4 and stats["failed_keys"] == 4
        assert stats["errors"] == 0 and stats["deadline_breaches"] == 0
        assert stats["breaker"] == "closed"
        assert [cache.index.held(k) != 0 for k in ks] == [True] * 4 + [False] * 4
        tier.config.stall_after_keys = None
        await evict_all(cache, 32)
        hit = await cache.lookup([ks])
        assert hit.hit_tokens == 4 * 16
        out = empty(4)
        result = await cache.load(ks[:4], out)
        assert result.ok_keys == tuple(ks[:4]) and torch.equal(out, data[:4])


async def test_cancelled_jobs_in_every_state_leak_nothing(faulty_tier_type: str) -> None:
    async with open_cache(chain([faulty()], blocks=8)) as cache:
        ks = keys(3)
        await cache.store(ks, blocks(3))
        await cache.flush()
        await evict_all(cache, 8)
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        tier.gate = anyio.Event()
        # a leader and a follower waiting on one promotion, both cancelled
        with anyio.move_on_after(0.05):
            async with anyio.create_task_group() as tg:
                tg.start_soon(cache.load, ks, empty(3))
                tg.start_soon(cache.load, ks[:1], empty(1))
        # a cascade still waiting at the gate, and a promotion too
        await cache.store(keys(1, "c"), blocks(1))
        tier.gate.set()
        await cache.flush()
        assert_no_leaks(cache)
        result = await cache.load(ks, empty(3))  # the promotion finished for nobody: fine
        assert result.ok


async def test_back_pressure_drops_cascades_instead_of_queueing(faulty_tier_type: str) -> None:
    config = chain([faulty(max_inflight_bytes=BLOCK * 2)], blocks=16)
    async with open_cache(config) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        tier.gate = anyio.Event()
        with anyio.fail_after(1):  # the store path never waits on the slow tier
            await cache.store(keys(2, "a"), blocks(2))
            await cache.store(keys(2, "b"), blocks(2))
            await cache.store(keys(2, "c"), blocks(2))
        stats = cache.stats().tiers["faulty"]
        assert stats["drops"] == 4 and stats["inflight_bytes"] == 2 * BLOCK
        tier.gate.set()
        await cache.flush()
        assert tier.stored_keys() == set(keys(2, "a"))


async def test_a_streaming_store_waits_for_a_tier_behind_instead_of_dropping(
    faulty_tier_type: str,
) -> None:
    # 24 blocks through an 8-block primary, a tier that takes 2 blocks in flight at a
    # time: every window reaches the tier, none is dropped
    config = chain([faulty(max_inflight_bytes=BLOCK * 2, delay=0.005)], blocks=8)
    async with open_cache(config) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        ks = keys(24, "s")
        result = await cache.store(ks, blocks(24))
        assert result.ok and result.stored == tuple(ks)
        await cache.flush()
        assert cache.stats().tiers["faulty"]["drops"] == 0
        assert tier.stored_keys() == set(ks)
        assert cache.stats().primary["store_waits"] > 0


async def test_nothing_a_tier_does_raises_into_the_caller(faulty_tier_type: str) -> None:
    async with open_cache(chain([faulty()])) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        ks = keys(2)
        tier.down = True
        assert (await cache.lookup([ks])).hit_tokens == 0
        assert (await cache.store(ks, blocks(2))).ok
        await cache.flush()
        await evict_all(cache)
        result = await cache.load(ks, empty(2))
        assert result.failed_keys == tuple(ks)


# -- multiple groups -------------------------------------------------------------------------------
async def test_full_and_sliding_window_groups_combine() -> None:
    config = chain([memory()], blocks=32, promotion_reserve=1.0)
    config["layout"]["groups"] = [
        {"kind": "full", "block_size": 16},
        {"kind": "sliding_window", "block_size": 16, "window": 32},
    ]
    async with open_cache(config) as cache:
        tokens = list(range(96))
        hashes = hash_token_blocks(tokens, 16, namespace="test")
        full = [make_offload_key(h, 0) for h in hashes]
        window = [make_offload_key(h, 1) for h in hashes]
        await cache.store(full, blocks(6))
        await cache.store(window[3:], blocks(3, seed=1))  # the window group keeps the tail
        hit = await cache.lookup([full, window])
        assert hit.hit_tokens == 96
        assert hit.group_keys == (tuple(full), tuple(window[4:6]))
        await cache.flush()
        await cache.store(keys(32, "filler"), blocks(32, seed=3))  # all leave the primary
        await cache.flush()
        hit = await cache.lookup([full, window])
        assert hit.hit_tokens == 96 and set(hit.locations.values()) == {"memory"}
        await cache.tier("memory").remove([window[4]])
        # 96 needs window[4]; 64 needs window[2:4], 48 window[1:3], 32 window[0:2]: none stored
        hit = await cache.lookup([full, window])
        assert hit.hit_tokens == 0 and hit.group_keys == ((), ())


async def test_window_group_limits_the_hit() -> None:
    config = chain([], blocks=32)
    config["layout"]["groups"] = [
        {"kind": "full", "block_size": 16},
        {"kind": "sliding_window", "block_size": 16, "window": 32},
    ]
    async with open_cache(config) as cache:
        hashes = hash_token_blocks(list(range(96)), 16, namespace="test")
        full = [make_offload_key(h, 0) for h in hashes]
        window = [make_offload_key(h, 1) for h in hashes]
        await cache.store(full, blocks(6))
        await cache.store([window[i] for i in (2, 3, 5)], blocks(3, seed=1))
        hit = await cache.lookup([full, window])
        assert hit.hit_tokens == 64
        assert hit.group_keys == (tuple(full[:4]), (window[2], window[3]))
        out = empty(6)
        assert (await cache.load(hit.keys_to_load, out)).ok


# -- bad input and life cycle ---------------------------------------------------------------------
async def test_bad_input_is_rejected_and_changes_nothing() -> None:
    async with open_cache(chain([memory()])) as cache:
        ks = keys(2)
        with pytest.raises(ValueError, match=r"keys\[1\] is 3 bytes; an offload key is"):
            await cache.store([ks[0], b"abc"], blocks(2))
        with pytest.raises(ValueError, match="block 1 is 1000 bytes; blocks are 1024 bytes"):
            await cache.store(ks, [bytes(BLOCK), bytes(1000)])
        with pytest.raises(ValueError, match="2 keys but 3 source blocks"):
            await cache.store(ks, blocks(3))
        with pytest.raises(ValueError, match="read-only"):
            await cache.load(ks, [bytes(BLOCK), bytes(BLOCK)])
        with pytest.raises(ValueError, match="lookup got keys for 2 groups; the layout has 1"):
            await cache.lookup([ks, ks])
        assert len(cache.primary) == 0 and cache.take_events() == []


async def test_closed_cache_refuses_work_and_leaves_no_task() -> None:
    cache = TieredCache(parse_config(chain([memory()])))
    with pytest.raises(TierUnavailable, match="not open"):
        await cache.lookup([keys(1)])
    async with cache:
        await cache.store(keys(2), blocks(2))
    assert cache.core.background == 0 and cache.core.tg is None
    with pytest.raises(TierUnavailable):
        await cache.store(keys(1), blocks(1))


async def test_from_yaml(tmp_path: Any) -> None:
    path = tmp_path / "chain.yaml"
    path.write_text(
        "namespace: y\nlayout: {block_bytes: 1KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 8KiB, pin_memory: false}\ntiers: [{type: memory}]\n"
    )
    async with TieredCache.from_yaml(path) as cache:
        assert cache.tier_names == ["memory"] and isinstance(cache.tier("memory"), MemoryTier)
        with pytest.raises(KeyError, match="no tier named 'redis'; tiers: memory"):
            cache.tier("redis")


async def test_a_tier_that_cannot_open_is_a_clear_error(faulty_tier_type: str) -> None:
    class Broken(FaultyTier):
        async def open(self) -> None:
            raise ConnectionRefusedError("connection refused on 127.0.0.1:1")

    from tierkv.registry import register_tier

    register_tier(Broken)
    with pytest.raises(
        TierUnavailable, match="tier 'faulty' failed to open: ConnectionRefusedError"
    ):
        async with TieredCache(parse_config(chain([faulty()]))):
            pass


def test_stats_shape() -> None:
    async def main() -> None:
        async with open_cache(chain([memory()])) as cache:
            await cache.store(keys(1), blocks(1))
            stats = cache.stats().as_dict()
            assert stats["primary"]["blocks_stored"] == 1
            assert set(stats["tiers"]) == {"memory"}
            assert "p99_ms" in stats["tiers"]["memory"]["job_latency"]

    anyio.run(main)


async def test_close_cancels_hung_background_jobs_and_releases_them(
    faulty_tier_type: str,
) -> None:
    cache = TieredCache(parse_config(chain([faulty(job_timeout="1h")], close_timeout="100ms")))
    await cache.open()
    tier = cache.tier("faulty")
    assert isinstance(tier, FaultyTier)
    tier.hang = True
    await cache.store(keys(2), blocks(2))  # its cascade hangs
    assert cache.stats().primary["background_jobs"] == 1
    with anyio.fail_after(2):
        await cache.close()
    assert cache.core.background == 0 and cache.core.tg is None
    assert cache.primary.readers(keys(2)[0]) == 0  # the cancelled cascade let go
    tier.hang = False


async def test_an_optional_tier_that_cannot_open_is_retried_in_the_background(
    faulty_tier_type: str,
) -> None:
    attempts: list[int] = []

    class LateTier(FaultyTier):
        async def open(self) -> None:
            attempts.append(1)
            if len(attempts) < 3:
                raise ConnectionRefusedError("not up yet")

    from tierkv.registry import register_tier

    register_tier(LateTier)
    config = chain([faulty(required=False, recovery_after="20ms")])
    async with open_cache(config) as cache:
        assert cache.stats().tiers["faulty"]["breaker"] == "not_open"
        await cache.store(keys(1, "early"), blocks(1))  # the cache works without it
        await cache.flush()
        assert cache.stats().tiers["faulty"]["skipped_unhealthy"] == 1
        with anyio.fail_after(2):
            while cache.stats().tiers["faulty"]["breaker"] != "closed":
                await anyio.sleep(0.01)
        assert len(attempts) == 3
        await cache.store(keys(1, "late"), blocks(1))
        await cache.flush()
        assert cache.tier("faulty").stored_keys() == set(keys(1, "late"))  # type: ignore[attr-defined]


async def test_a_failed_demotion_keeps_the_block_pinned_until_it_is_written(
    faulty_tier_type: str,
) -> None:
    config = chain([faulty(write_policy="write_back")], promotion_reserve=1.0)
    async with open_cache(config) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        tier.fail_jobs = 1  # the first demotion fails
        first, data = keys(4, "a"), blocks(4)
        await cache.store(first, data)  # fills the primary: the demoter wakes
        await cache.flush()
        assert cache.stats().tiers["faulty"]["errors"] == 1
        # nothing was freed unwritten: every block is either still dirty in the primary
        # (the policy never frees a dirty block) or in the tier
        for key in first:
            assert key in tier.stored_keys() or (key in cache.primary and cache.index.is_dirty(key))
        await cache.flush()  # the retry writes the rest
        assert tier.stored_keys() == set(first)
        await cache.store(keys(4, "b"), blocks(4, seed=1))
        await cache.flush()
        out = empty(4)
        assert (await cache.load(first, out)).ok and torch.equal(out, data)


async def test_a_block_that_keeps_failing_to_demote_is_given_up_and_counted(
    faulty_tier_type: str,
) -> None:
    config = chain([faulty(write_policy="write_back", failure_threshold=99)])
    async with open_cache(config) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        tier.fail_jobs = 100
        await cache.store(keys(1), blocks(1))
        for _ in range(3):
            await cache.flush()
        assert cache.stats().tiers["faulty"]["drops"] == 1
        assert cache.stats().primary["write_back_pending"] == 0
        assert cache.primary.num_evictable == 1  # unpinned after three failed attempts
        tier.fail_jobs = 0


async def test_events_are_bounded_when_nobody_takes_them() -> None:
    from tierkv.cache.core import EventLog

    async with open_cache(chain([], blocks=16)) as cache:
        cache.core.events = EventLog(cache.primary, limit=5)
        for i in range(8):
            await cache.store(keys(1, f"e{i}"), blocks(1))
        events = cache.take_events()
        assert len(events) == 5 and events[-1].keys == tuple(keys(1, "e7"))
        assert cache.stats().primary["events_dropped"] == 3


async def test_streaming_stores_leave_room_for_promotions(faulty_tier_type: str) -> None:
    # two stores of 24 blocks each stream through an 8-block primary (reserve 4) while a
    # slow tier keeps their windows pinned; a load of a 4-block prefix the tier alone
    # holds, issued while the stores wait for room, is promoted in full instead of
    # being shed for lack of room (the stores leave the reserve's room free)
    config = chain([faulty(delay=0.01)], blocks=8, promotion_reserve=0.5)
    async with open_cache(config) as cache:
        prefix, data = keys(4, "p"), blocks(4, seed=1)
        assert (await cache.store(prefix, data)).ok
        await cache.flush()
        assert (await cache.store(keys(8, "filler"), blocks(8, seed=2))).ok
        await cache.flush()
        assert not any(k in cache.primary for k in prefix)
        hit = await cache.lookup([prefix])
        assert hit.keys_to_load == tuple(prefix)
        results: list[StoreResult] = []

        async def stream(tag: str) -> None:
            results.append(await cache.store(keys(24, tag), blocks(24, seed=3)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream, "s1")
            tg.start_soon(stream, "s2")
            while cache.stats().primary["store_waits"] == 0:
                await anyio.sleep(0)
            out = empty(4)
            loaded = await cache.load(prefix, out)
        assert loaded.ok_keys == tuple(prefix), dict(loaded.errors)
        assert torch.equal(out, data)
        assert all(r.ok for r in results)
