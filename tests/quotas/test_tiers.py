"""Quotas on secondary tiers (`tenants.quotas.<tier>`): the cache removes the victims
the quota rule allows before a cascade, declines what has no room, and counts (but
does not enforce) quotas on tiers that cannot name their victims."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.metrics import registry_for
from tierkv.quotas.tiers import TierQuotaGate

pytestmark = pytest.mark.anyio

BLOCK = 4096


def chain(quotas: str, tier: str = "{type: memory, capacity: 80KiB}", primary: int = 8) -> str:
    return f"""
namespace: tier-quotas
layout: {{block_bytes: 4KiB, groups: [{{block_size: 16}}]}}
primary: {{capacity: {primary * 4}KiB, pin_memory: false}}
tiers: [{tier}]
tenants: {{quotas: {quotas}}}
"""


def keys(n: int, salt: str) -> list[OffloadKey]:
    hashes = hash_token_blocks(list(range(16 * n)), 16, namespace=f"tq|{salt}")
    return [make_offload_key(h, 0) for h in hashes]


def blocks(n: int, fill: int = 0) -> torch.Tensor:
    return torch.full((n, BLOCK), fill, dtype=torch.uint8)


def gate(cache: TieredCache) -> TierQuotaGate:
    gate = cache.core.tiers[0].quotas
    assert gate is not None
    return gate


async def in_tier(cache: TieredCache, ks: list[OffloadKey]) -> list[bool]:
    return await cache.tier(cache.tier_names[0]).lookup(ks, ReqContext())


async def flood(cache: TieredCache, tenant: str, rounds: int, n: int = 4) -> None:
    for i in range(rounds):
        await cache.store(keys(n, f"{tenant}{i}"), blocks(n), ctx=ReqContext(tenant=tenant))
        await cache.flush()


async def test_a_named_tenant_keeps_its_share_of_the_tier() -> None:
    a = ReqContext(tenant="a")
    ka = keys(6, "a")
    async with TieredCache(parse_config(chain("{memory: {tenants: {a: 50%}}}"))) as cache:
        capacity = cache.tier("memory").room().capacity_blocks
        await cache.store(ka, blocks(6, 1), ctx=a)
        await cache.flush()
        await flood(cache, "b", rounds=12)  # 48 one-off blocks through the tier
        assert all(await in_tier(cache, ka))
        held = gate(cache).book.held
        assert held["a"] == 6 and held["b"] == capacity - 6
        row = cache.stats().tenants["a"]["quotas"]["memory"]
    assert row == {
        "held_bytes": 6 * BLOCK,
        "quota_bytes": capacity // 2 * BLOCK,
        "declined_blocks": 0,
    }


async def test_without_quotas_the_flood_empties_the_tier_of_a() -> None:
    a = ReqContext(tenant="a")
    ka = keys(6, "a")
    async with TieredCache(parse_config(chain("{}"))) as cache:
        await cache.store(ka, blocks(6, 1), ctx=a)
        await cache.flush()
        await flood(cache, "b", rounds=12)
        assert not any(await in_tier(cache, ka))


async def test_a_capped_tenant_cycles_its_own_blocks() -> None:
    """c is capped at a fifth of the tier: its later stores replace its older blocks,
    and d's blocks stay."""
    quotas = "{memory: {borrow: false, default: 20%}}"
    async with TieredCache(parse_config(chain(quotas))) as cache:
        cap = gate(cache).book.cap("c")
        assert cap == cache.tier("memory").room().capacity_blocks // 5
        kd = keys(3, "d")
        await cache.store(kd, blocks(3), ctx=ReqContext(tenant="d"))
        await cache.flush()
        await flood(cache, "c", rounds=2 * cap, n=1)
        assert gate(cache).book.held == {"c": cap, "d": 3}
        assert all(await in_tier(cache, kd))
        newest = [k for i in range(cap, 2 * cap) for k in keys(1, f"c{i}")]
        assert all(await in_tier(cache, newest))
        assert not any(await in_tier(cache, keys(1, "c0")))
        tenants = cache.stats().tenants
    assert tenants["c"]["declined_blocks"] == 0


async def test_what_has_no_room_is_declined_and_counted() -> None:
    """One cascade of more of c's blocks than its cap: none of c's own are there to
    give way, so the rest is declined for the tier (they stay in the primary)."""
    quotas = "{memory: {borrow: false, default: 20%}}"
    c = ReqContext(tenant="c")
    async with TieredCache(parse_config(chain(quotas, primary=32))) as cache:
        cap = gate(cache).book.cap("c")
        assert cap is not None
        kc = keys(cap + 2, "c")
        result = await cache.store(kc, blocks(cap + 2), ctx=c)
        await cache.flush()
        assert result.error is None and len(result.stored) == cap + 2
        assert await in_tier(cache, kc) == [True] * cap + [False] * 2
        assert all(k in cache.primary for k in kc)
        stats = cache.stats()
    assert stats.tenants["c"]["declined_blocks"] == 2
    assert stats.tenants["c"]["quotas"]["memory"]["declined_blocks"] == 2


async def test_tier_quotas_are_scraped_per_tier() -> None:
    from prometheus_client import generate_latest

    async with TieredCache(parse_config(chain("{memory: {tenants: {a: 50%}}}"))) as cache:
        await cache.store(keys(3, "a"), blocks(3), ctx=ReqContext(tenant="a"))
        await cache.flush()
        text = generate_latest(registry_for(cache)).decode()
    line = 'tierkv_tenant_quota_held_bytes{namespace="tier-quotas",tenant="a",tier="memory"}'
    assert f"{line} {3.0 * BLOCK}" in text
    assert 'tierkv_tenant_quota_bytes{namespace="tier-quotas",tenant="a",tier="memory"}' in text


async def test_a_tier_that_cannot_name_victims_counts_but_does_not_enforce(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    tier = f"{{type: redis, url: '{redis_url}'}}"
    quotas = "{redis: {borrow: false, default: 4KiB}}"
    caplog.set_level(logging.WARNING, "tierkv.quotas.tiers")
    async with TieredCache(parse_config(chain(quotas, tier=tier))) as cache:
        kc = keys(3, "c")
        await cache.store(kc, blocks(3), ctx=ReqContext(tenant="c"))
        await cache.flush()
        assert await in_tier(cache, kc) == [True] * 3  # a cap of one block: not enforced
        assert gate(cache).book.held == {"c": 3}
        row = cache.stats().tenants["c"]["quotas"]["redis"]
    assert row["held_bytes"] == 3 * BLOCK and row["quota_bytes"] is None
    assert "its quotas are counted, not enforced" in caplog.text


TENANTS = ["a", "b", "c"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    borrow=st.booleans(),
    stores=st.lists(st.tuples(st.sampled_from(TENANTS), st.integers(1, 5)), max_size=20),
)
def test_tier_quota_invariants(borrow: bool, stores: list[tuple[str, int]]) -> None:
    """Stores one at a time: a named tenant never loses blocks of its quota on the
    tier to another tenant; without borrowing nobody holds more than its cap there;
    the book's owners are exactly the tier's blocks; what the tier holds reads back."""
    import anyio

    quotas = f"{{memory: {{borrow: {str(borrow).lower()}, default: 20%, tenants: {{a: 40%}}}}}}"

    async def run() -> None:
        config = parse_config(chain(quotas, tier="{type: memory, capacity: 60KiB}", primary=4))
        async with TieredCache(config) as cache:
            book = gate(cache).book
            tier = cache.tier("memory")
            written: dict[OffloadKey, int] = {}
            for i, (tenant, n) in enumerate(stores):
                before = dict(book.held)
                ks = keys(n, f"{tenant}{i}")
                await cache.store(ks, blocks(n, i % 251), ctx=ReqContext(tenant=tenant))
                await cache.flush()
                written.update(dict.fromkeys(ks, i % 251))
                if tenant != "a":
                    assert book.held.get("a", 0) >= min(before.get("a", 0), book.limits["a"])
                if not borrow:
                    for name, count in book.held.items():
                        cap = book.cap(name)
                        assert cap is None or count <= cap, (name, count, cap)
                held = [k for k in written if (await tier.lookup([k], ReqContext()))[0]]
                assert set(held) == set(book.owner)
            for key in book.owner:
                out = blocks(1, 255)
                result = await cache.load([key], out, ReqContext(tenant="a"))
                if result.ok:
                    assert bool((out == written[key]).all())

    anyio.run(run)


async def test_tinylfu_weighs_new_blocks_inside_the_tenants_share() -> None:
    """A tier with `admission: tinylfu` and quotas: a tenant's new blocks are weighed
    against the blocks its quota would give way, so what the quota has no room for
    is declined by admission (counted as the tier's admission declines), not sent."""
    quotas = "{memory: {borrow: false, default: 20%}}"
    tier = "{type: memory, capacity: 80KiB, admission: tinylfu}"
    c = ReqContext(tenant="c")
    async with TieredCache(parse_config(chain(quotas, tier=tier, primary=32))) as cache:
        cap = gate(cache).book.cap("c")
        assert cap is not None
        kc = keys(cap + 2, "c")
        await cache.store(kc, blocks(cap + 2), ctx=c)
        await cache.flush()
        assert await in_tier(cache, kc) == [True] * cap + [False] * 2
        stats = cache.stats()
    assert stats.tiers["memory"]["declined"] == 2
    assert stats.tenants["c"]["declined_blocks"] == 0  # admission's, not the quota's
