"""Claims: a block a lookup reported in a tier is still there when the request loads it.

The race these tests pin down (seen in trace replays): lookup reports blocks in a tier,
a store's cascade then makes the tier evict (its own capacity LRU) exactly those
blocks, and the load that follows misses. With claims, the tier's eviction passes
over them until the request's load ends, the request ends or `claim_lease` runs out;
each claim ends exactly once, whatever the load did."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.jobs import JobMetadata, ReqContext
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.contract.tier import SecondaryTierManager

pytestmark = pytest.mark.anyio

BLOCK = 1024
FRAME = BLOCK + 70  # a framed block of a 36-byte key in the memory tier


def keys(n: int, tag: str) -> list[OffloadKey]:
    return [
        make_offload_key(h, 0) for h in hash_token_blocks(list(range(16 * n)), 16, namespace=tag)
    ]


def data(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, BLOCK), dtype=torch.uint8, generator=g)


def config(tier: dict[str, Any], primary_blocks: int = 4) -> Any:
    return parse_config(
        {
            "namespace": "claims",
            "layout": {"block_bytes": BLOCK, "groups": [{"block_size": 16}]},
            "primary": {"capacity": primary_blocks * BLOCK, "pin_memory": False},
            "tiers": [tier],
        }
    )


def memory(capacity_blocks: int = 6, **fields: Any) -> dict[str, Any]:
    return {"type": "memory", "capacity": capacity_blocks * FRAME, **fields}


async def stage(cache: TieredCache) -> tuple[list[OffloadKey], torch.Tensor]:
    """The tier full (6 blocks), the 2 blocks of `a` its least recently used and gone
    from the primary: the next store into the tier evicts them unless claimed."""
    a, a_data = keys(2, "a"), data(2, 1)
    await cache.store(a, a_data)
    await cache.flush()
    await cache.store(keys(4, "c"), data(4, 2))
    await cache.flush()
    return a, a_data


async def evict_pressure(cache: TieredCache) -> None:
    """A store whose cascade needs the room of two blocks in the tier."""
    await cache.store(keys(2, "b"), data(2, 3))
    await cache.flush()


def claims_in(cache: TieredCache, name: str) -> int:
    return cache.tier(name).claims.sweep()


@pytest.mark.parametrize("lease", [10.0, 0.0])
async def test_a_claimed_hit_survives_the_eviction_a_store_causes(lease: float) -> None:
    """lookup -> a store that evicts the claimed blocks -> load: every block loads,
    byte for byte. `claim_lease: 0` turns claims off, and the same sequence loses
    the hit: the race is real and only the claim closes it."""
    async with TieredCache(config(memory(claim_lease=lease))) as cache:
        a, a_data = await stage(cache)
        ctx = ReqContext(request_id="r1")
        hit = await cache.lookup([a], ctx)
        assert dict(hit.locations) == dict.fromkeys(a, "memory")
        await evict_pressure(cache)
        out = torch.zeros(2, BLOCK, dtype=torch.uint8)
        result = await cache.load(hit.keys_to_load, out, ctx)
        stats = cache.stats().tiers["memory"]
        if lease:
            assert result.ok, result.errors
            assert torch.equal(out, a_data)
            assert stats["protected"] == 2
            assert stats["lease_expired"] == 0 and stats["claims_held"] == 0
            assert claims_in(cache, "memory") == 0
        else:
            assert set(result.failed_keys) == set(a)
            assert stats["protected"] == 0


@pytest.mark.parametrize("ctx", [None, ReqContext()])
async def test_a_lookup_without_a_request_id_keeps_its_hit_too(ctx: ReqContext | None) -> None:
    """A server that passes no request ids: the hit still survives the eviction a
    store causes between lookup and load (it lost 1-53 loads per 3,000 trace
    requests before), and the load ends the claims it used."""
    async with TieredCache(config(memory())) as cache:
        a, a_data = await stage(cache)
        hit = await cache.lookup([a], ctx)
        assert claims_in(cache, "memory") == 2
        await evict_pressure(cache)
        out = torch.zeros(2, BLOCK, dtype=torch.uint8)
        result = await cache.load(hit.keys_to_load, out, ctx)
        assert result.ok, result.errors
        assert torch.equal(out, a_data)
        stats = cache.stats().tiers["memory"]
        assert stats["protected"] == 2 and stats["claims_held"] == 0
        assert stats["lease_expired"] == 0
        assert claims_in(cache, "memory") == 0 and len(cache.core.claims) == 0


async def test_anonymous_claims_end_one_per_load_oldest_first() -> None:
    """Two lookups without request ids of the same blocks: each load ends one claim
    per key (the oldest), so the second lookup's hit stays claimed until its load."""
    async with TieredCache(config(memory())) as cache:
        a, _ = await stage(cache)
        await cache.lookup([a])
        await cache.lookup([a])
        assert cache.stats().tiers["memory"]["claims_held"] == 4
        out = torch.zeros(2, BLOCK, dtype=torch.uint8)
        assert (await cache.load(a, out)).ok
        assert cache.stats().tiers["memory"]["claims_held"] == 2
        assert claims_in(cache, "memory") == 2
        assert (await cache.load(a, out)).ok
        assert cache.stats().tiers["memory"]["claims_held"] == 0
        assert not cache.core.claims._anonymous


async def test_anonymous_claims_nobody_loads_end_with_their_lease() -> None:
    async with TieredCache(config(memory(claim_lease=0.05))) as cache:
        a, _ = await stage(cache)
        for _ in range(3):
            await cache.lookup([a])
        await anyio.sleep(0.1)
        await evict_pressure(cache)  # sweeps the ledger, then evicts the unclaimed
        stats = cache.stats().tiers["memory"]
        assert stats["lease_expired"] == 6 and stats["claims_held"] == 0
        assert len(cache.core.claims) == 0 and not cache.core.claims._anonymous


async def test_the_lease_bounds_a_claim_nobody_lets_go() -> None:
    """A request that looks up and never loads holds its claims only for the lease:
    then the blocks are evictable again and the claims count as lease_expired."""
    async with TieredCache(config(memory(claim_lease=0.05))) as cache:
        a, _ = await stage(cache)
        await cache.lookup([a], ReqContext(request_id="never-loads"))
        assert claims_in(cache, "memory") == 2
        await anyio.sleep(0.1)
        await evict_pressure(cache)
        assert await cache.tier("memory").lookup(a, ReqContext()) == [False, False]
        stats = cache.stats().tiers["memory"]
        assert stats["protected"] == 2
        assert stats["lease_expired"] == 2
        assert stats["claims_held"] == 0
        assert len(cache.core.claims) == 0
        # the late load finds nothing to let go: each claim ended exactly once
        out = torch.zeros(2, BLOCK, dtype=torch.uint8)
        await cache.load(a, out, ReqContext(request_id="never-loads"))
        assert cache.stats().tiers["memory"]["lease_expired"] == 2


async def test_end_request_lets_the_claims_go() -> None:
    async with TieredCache(config(memory())) as cache:
        a, _ = await stage(cache)
        ctx = ReqContext(request_id="aborted")
        await cache.lookup([a], ctx)
        assert claims_in(cache, "memory") == 2
        cache.end_request(ctx)
        cache.end_request("aborted")  # twice: nothing more to end
        assert claims_in(cache, "memory") == 0
        stats = cache.stats().tiers["memory"]
        assert (stats["claims_held"], stats["lease_expired"]) == (0, 0)
        await evict_pressure(cache)  # evictable again: the LRU goes first
        assert await cache.tier("memory").lookup(a, ReqContext()) == [False, False]


async def test_a_second_lookup_replaces_the_requests_claims() -> None:
    """A waiting request is looked up again every scheduler step: its claims are
    renewed, not stacked."""
    async with TieredCache(config(memory())) as cache:
        a, _ = await stage(cache)
        ctx = ReqContext(request_id="waiting")
        for _ in range(3):
            await cache.lookup([a], ctx)
        assert claims_in(cache, "memory") == 2
        stats = cache.stats().tiers["memory"]
        assert stats["protected"] == 6 and stats["claims_held"] == 2
        await cache.lookup([a[:1]], ctx)  # a shorter hit: the other claim ends
        assert claims_in(cache, "memory") == 1
        out = torch.zeros(1, BLOCK, dtype=torch.uint8)
        assert (await cache.load(a[:1], out, ctx)).ok
        assert claims_in(cache, "memory") == 0


async def test_a_failed_load_lets_its_claims_go(faulty_tier_type: str) -> None:
    async with TieredCache(config({"type": "faulty", "capacity": 6 * FRAME})) as cache:
        a, _ = await stage(cache)
        ctx = ReqContext(request_id="fails")
        hit = await cache.lookup([a], ctx)
        tier: Any = cache.tier("faulty")
        tier.fail_jobs = 1
        result = await cache.load(hit.keys_to_load, torch.zeros(2, BLOCK, dtype=torch.uint8), ctx)
        assert set(result.failed_keys) == set(a)
        assert claims_in(cache, "faulty") == 0
        stats = cache.stats().tiers["faulty"]
        assert (stats["protected"], stats["claims_held"], stats["lease_expired"]) == (2, 0, 0)


async def test_a_cancelled_load_lets_its_claims_go(faulty_tier_type: str) -> None:
    async with TieredCache(config({"type": "faulty", "capacity": 6 * FRAME})) as cache:
        a, _ = await stage(cache)
        ctx = ReqContext(request_id="cancelled")
        hit = await cache.lookup([a], ctx)
        tier: Any = cache.tier("faulty")
        tier.gate = anyio.Event()  # the load's read waits at the tier
        with anyio.move_on_after(0.05) as scope:
            await cache.load(hit.keys_to_load, torch.zeros(2, BLOCK, dtype=torch.uint8), ctx)
        assert scope.cancelled_caught
        assert claims_in(cache, "faulty") == 0
        assert cache.stats().tiers["faulty"]["claims_held"] == 0
        tier.gate.set()
        await cache.flush()


async def test_a_load_that_times_out_lets_its_claims_go(faulty_tier_type: str) -> None:
    """The tier hangs on the load past its job_timeout and the backstop: the load fails
    its keys, and its claims end with it."""
    tier = {"type": "faulty", "capacity": 6 * FRAME, "job_timeout": 0.05}
    async with TieredCache(config(tier)) as cache:
        a, _ = await stage(cache)
        ctx = ReqContext(request_id="timed-out")
        hit = await cache.lookup([a], ctx)
        faulty: Any = cache.tier("faulty")
        faulty.hang = True
        result = await cache.load(hit.keys_to_load, torch.zeros(2, BLOCK, dtype=torch.uint8), ctx)
        assert set(result.failed_keys) == set(a)
        assert cache.stats().tiers["faulty"]["deadline_breaches"] == 1
        assert claims_in(cache, "faulty") == 0
        assert cache.stats().tiers["faulty"]["claims_held"] == 0
        faulty.hang = False


async def test_a_lookup_the_tier_answers_too_late_claims_nothing(faulty_tier_type: str) -> None:
    tier = {"type": "faulty", "capacity": 6 * FRAME}
    async with TieredCache(config(tier)) as cache:
        a, _ = await stage(cache)
        faulty: Any = cache.tier("faulty")
        faulty.config = faulty.config.model_copy(update={"lookup_delay": 0.2})
        cache.config = cache.config.model_copy(update={"lookup_timeout": 0.02})
        cache.core.config = cache.config
        hit = await cache.lookup([a], ReqContext(request_id="slow"))
        assert hit.hit_tokens == 0
        assert claims_in(cache, "faulty") == 0
        assert cache.stats().tiers["faulty"]["protected"] == 0


async def test_claims_end_while_the_breaker_is_open(faulty_tier_type: str) -> None:
    """A tier whose breaker opened between lookup and load serves nothing, and its
    claims still end with the load (a claim is bookkeeping, not a call that can fail)."""
    async with TieredCache(config({"type": "faulty", "capacity": 6 * FRAME})) as cache:
        a, _ = await stage(cache)
        ctx = ReqContext(request_id="breaker")
        hit = await cache.lookup([a], ctx)
        handle = cache.core.tiers[0]
        for _ in range(handle.config.failure_threshold):
            handle._record("load", False)
        assert not handle.usable("load")
        result = await cache.load(hit.keys_to_load, torch.zeros(2, BLOCK, dtype=torch.uint8), ctx)
        assert set(result.failed_keys) == set(a)
        assert claims_in(cache, "faulty") == 0
        assert cache.stats().tiers["faulty"]["claims_held"] == 0


async def test_a_full_tier_of_claimed_blocks_refuses_the_store() -> None:
    """Room that only claimed blocks could make is not made: the cascade's blocks fail
    ("no room"), the claimed ones stay and load."""
    async with TieredCache(config(memory(capacity_blocks=2))) as cache:
        a, a_data = keys(2, "a"), data(2, 1)
        tier: SecondaryTierManager = cache.tier("memory")
        view = cache.primary.view
        for slot in (0, 1):  # free slots of a fresh cache: the tier alone holds `a`
            view.block(slot)[:] = a_data[slot].numpy().tobytes()
        assert (await tier.store(JobMetadata(10**6, tuple(a), (0, 1)))).ok
        ctx = ReqContext(request_id="holds-all")
        hit = await cache.lookup([a], ctx)
        assert hit.count_in("memory") == 2
        await evict_pressure(cache)
        stats = cache.stats().tiers["memory"]
        assert stats["blocks_stored"] == 0 and stats["failed_keys"] == 2
        assert await tier.lookup(a, ctx) == [True, True]
        out = torch.zeros(2, BLOCK, dtype=torch.uint8)
        assert (await cache.load(hit.keys_to_load, out, ctx)).ok
        assert torch.equal(out, a_data)


async def test_stores_refused_for_claimed_room_do_not_open_the_breaker() -> None:
    """A tier full of claimed blocks is full, not down: stores it refuses for room do
    not count against its health, so the claimed blocks stay loadable (an open breaker
    would make the tier a miss and lose the very hits the claims keep)."""
    async with TieredCache(config(memory(capacity_blocks=2))) as cache:
        a, a_data = keys(2, "a"), data(2, 1)
        tier: SecondaryTierManager = cache.tier("memory")
        view = cache.primary.view
        for slot in (0, 1):
            view.block(slot)[:] = a_data[slot].numpy().tobytes()
        assert (await tier.store(JobMetadata(10**6, tuple(a), (0, 1)))).ok
        ctx = ReqContext(request_id="holds-all")
        hit = await cache.lookup([a], ctx)
        threshold = cache.core.tiers[0].config.failure_threshold
        for n in range(threshold + 1):
            await cache.store(keys(2, f"refused{n}"), data(2, 40 + n))
            await cache.flush()
        stats = cache.stats().tiers["memory"]
        assert stats["failed_keys"] == 2 * (threshold + 1)
        assert stats["breaker"] == "closed" and stats["errors"] == 0
        out = torch.zeros(2, BLOCK, dtype=torch.uint8)
        assert (await cache.load(hit.keys_to_load, out, ctx)).ok
        assert torch.equal(out, a_data)


async def test_close_ends_every_claim() -> None:
    cache = TieredCache(config(memory()))
    async with cache:
        a, _ = await stage(cache)
        await cache.lookup([a], ReqContext(request_id="open-at-close"))
        assert cache.stats().tiers["memory"]["claims_held"] == 2
    assert len(cache.core.claims) == 0
    assert cache.stats().tiers["memory"]["claims_held"] == 0


CHAINS = {i: (keys(2, f"s{i}"), data(2, 100 + i)) for i in range(5)}
OPS = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 4)),
    st.tuples(st.just("lookup"), st.integers(0, 1), st.integers(0, 4)),
    st.tuples(st.just("load"), st.integers(0, 1)),
    st.tuples(st.sampled_from(["flush", "yield"])),
)
# a request's turn as a server takes it: lookup, then (others' stores and loads running
# meanwhile) its load; the turns of two requests interleave freely
TURNS = st.lists(
    st.tuples(st.integers(0, 1), st.integers(0, 4), st.lists(st.integers(0, 4), max_size=3)),
    min_size=1,
    max_size=8,
).map(
    lambda turns: [
        op
        for r, chain, stores in turns
        for op in [("lookup", r, chain), *(("store", c) for c in stores), ("load", r)]
    ]
)


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.lists(OPS, min_size=1, max_size=30), TURNS))
def test_a_claimed_block_always_loads_its_bytes(ops: list[tuple[Any, ...]]) -> None:
    """Whatever the interleaving of lookups, stores (their cascades running in the
    background) and loads: a load of a block its request's lookup found in the tier
    (claimed, lease unexpired) returns exactly its bytes. Two requests claim at most
    4 blocks of a tier of 6, so a store always finds an unclaimed block to evict."""
    anyio.run(_replay_ops, ops)


async def _replay_ops(ops: list[tuple[Any, ...]]) -> None:
    tier = memory(capacity_blocks=6, claim_lease=60)
    async with TieredCache(config(tier, primary_blocks=2)) as cache:
        hits: dict[int, tuple[Any, int]] = {}  # request -> its last lookup, its chain
        for op in ops:
            if op[0] == "store":
                await cache.store(*CHAINS[op[1]])
            elif op[0] == "lookup":
                hits[op[1]] = (await cache.lookup([CHAINS[op[2]][0]], _ctx(op[1])), op[2])
            elif op[0] == "load" and op[1] in hits:
                hit, chain = hits.pop(op[1])
                await _load_and_check(cache, hit, CHAINS[chain], _ctx(op[1]))
            elif op[0] == "flush":
                await cache.flush()
            else:
                await anyio.sleep(0)
        assert cache.stats().tiers["memory"]["lease_expired"] == 0


def _ctx(request: int) -> ReqContext:
    return ReqContext(request_id=f"req{request}")


async def _load_and_check(
    cache: TieredCache, hit: Any, chain: tuple[list[OffloadKey], torch.Tensor], ctx: ReqContext
) -> None:
    keys_to_load = hit.keys_to_load
    out = torch.zeros(len(keys_to_load), BLOCK, dtype=torch.uint8)
    result = await cache.load(keys_to_load, out, ctx)
    ok = set(result.ok_keys)
    chain_keys, chain_data = chain
    for j, key in enumerate(keys_to_load):
        if hit.locations[key] == "memory":
            assert key in ok, f"a claimed block failed to load: {result.errors[key]}"
        if key in ok:
            assert torch.equal(out[j], chain_data[chain_keys.index(key)])
