"""Per-tenant accounting: what each tenant of one cache looked up, stored and loaded,
what it holds in the primary, and the bound on how many tenants reports name."""

from __future__ import annotations

import logging

import pytest
import torch

from tierkv.cache import TieredCache
from tierkv.cache.tenants import TenantLedger
from tierkv.config import parse_config
from tierkv.contract.errors import ConfigError
from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.contract.tenants import DEFAULT_TENANT, OTHER_TENANTS, salt_tenant

pytestmark = pytest.mark.anyio

BLOCK = 4096


def chain(capacity_blocks: int = 8, tiers: str = "[]", extra: str = "") -> str:
    return f"""
namespace: tenants
layout: {{block_bytes: 4KiB, groups: [{{block_size: 16}}]}}
primary: {{capacity: {capacity_blocks * 4}KiB, pin_memory: false}}
tiers: {tiers}
{extra}
"""


def keys(n: int, salt: str) -> list[OffloadKey]:
    hashes = hash_token_blocks(list(range(16 * n)), 16, namespace=f"tenants|{salt}")
    return [make_offload_key(h, 0) for h in hashes]


def blocks(n: int) -> torch.Tensor:
    return torch.zeros(n, BLOCK, dtype=torch.uint8)


async def test_each_tenant_counts_its_own_calls() -> None:
    a, b = ReqContext("ra", tenant="acme"), ReqContext("rb", tenant="globex")
    ka, kb = keys(4, "a"), keys(2, "b")
    async with TieredCache(parse_config(chain())) as cache:
        await cache.store(ka[:3], blocks(3), ctx=a)
        await cache.store(kb, blocks(2), ctx=b)
        hit = await cache.lookup([ka], a)  # 3 of 4 blocks: 3 hits, 1 miss
        await cache.load(hit.keys_to_load, blocks(3), a)
        await cache.lookup([kb], b)
        await cache.load(kb[:1] + ka[3:], blocks(2), b)  # one absent: failed
        tenants = cache.stats().tenants
    assert tenants["acme"] == {
        "lookups": 1,
        "hits": 3,
        "misses": 1,
        "stored_blocks": 3,
        "stored_bytes": 3 * BLOCK,
        "rejected_blocks": 0,
        "loaded_blocks": 3,
        "loaded_bytes": 3 * BLOCK,
        "load_failed_blocks": 0,
        "primary_blocks": 3,
        "primary_bytes": 3 * BLOCK,
        "evicted_blocks": 0,
        "declined_blocks": 0,
    }
    g = tenants["globex"]
    assert (g["lookups"], g["hits"], g["misses"]) == (1, 2, 0)
    assert (g["stored_blocks"], g["loaded_blocks"], g["load_failed_blocks"]) == (2, 1, 1)
    assert g["primary_bytes"] == 2 * BLOCK
    assert set(tenants) == {"acme", "globex"}  # no untenanted call: no default row


async def test_calls_without_a_tenant_are_the_default_tenant() -> None:
    ks = keys(3, "d")
    async with TieredCache(parse_config(chain())) as cache:
        await cache.store(ks, blocks(3))  # no ctx at all
        await cache.lookup([ks])
        await cache.load(ks, blocks(3), ReqContext("r1"))  # a ctx with no tenant
        await cache.store(keys(1, "e"), blocks(1), ctx=ReqContext(tenant=DEFAULT_TENANT))
        tenants = cache.stats().tenants
    assert set(tenants) == {DEFAULT_TENANT}
    row = tenants[DEFAULT_TENANT]
    assert (row["stored_blocks"], row["hits"], row["loaded_blocks"]) == (4, 3, 3)
    assert row["primary_blocks"] == 4


async def test_primary_bytes_follow_eviction_to_their_owner() -> None:
    """A 4-block primary: B's stores evict A's blocks, and A's share falls."""
    a, b = ReqContext(tenant="a"), ReqContext(tenant="b")
    async with TieredCache(parse_config(chain(capacity_blocks=4))) as cache:
        await cache.store(keys(3, "a"), blocks(3), ctx=a)
        assert cache.stats().tenants["a"]["primary_blocks"] == 3
        await cache.store(keys(3, "b"), blocks(3), ctx=b)
        tenants = cache.stats().tenants
        resident = len(cache.primary)
    assert tenants["b"]["primary_blocks"] == 3
    assert tenants["a"]["primary_blocks"] == 1
    assert resident == 4


async def test_a_promotion_belongs_to_the_tenant_that_loaded_it() -> None:
    a, b = ReqContext(tenant="a"), ReqContext(tenant="b")
    ka = keys(2, "shared")
    memory = "[{type: memory, capacity: 1MiB}]"
    async with TieredCache(parse_config(chain(capacity_blocks=2, tiers=memory))) as cache:
        await cache.store(ka, blocks(2), ctx=a)
        await cache.flush()
        await cache.store(keys(2, "b"), blocks(2), ctx=b)  # evicts a's from the primary
        await cache.flush()
        assert cache.stats().tenants["a"]["primary_blocks"] == 0
        hit = await cache.lookup([ka], b)  # b reads the same prefix: it owns the copy
        loaded = await cache.load(hit.keys_to_load, blocks(2), b)
        tenants = cache.stats().tenants
    assert loaded.ok
    assert tenants["b"]["primary_blocks"] == 2
    assert tenants["b"]["hits"] == 2


async def test_the_cascade_carries_the_stores_tenant_to_the_tier() -> None:
    seen: list[str | None] = []
    memory = "[{type: memory, capacity: 1MiB}]"
    async with TieredCache(parse_config(chain(tiers=memory))) as cache:
        tier = cache.tier("memory")
        store = tier.store

        async def spy(job):  # type: ignore[no-untyped-def]
            seen.append(job.ctx.tenant)
            return await store(job)

        tier.store = spy  # type: ignore[method-assign]
        await cache.store(keys(2, "t"), blocks(2), ctx=ReqContext(tenant=salt_tenant("s3cret")))
        await cache.flush()
    assert seen == [salt_tenant("s3cret")]


def test_fifty_tenants_with_five_named_are_five_labels_and_other() -> None:
    ledger = TenantLedger(BLOCK, report_top=5)
    for i in range(50):
        ledger.stored(f"t{i}", stored=i + 1, rejected=0)
    report = ledger.report(resident=0)
    assert list(report)[:5] == ["t49", "t48", "t47", "t46", "t45"]
    assert set(report) == {"t49", "t48", "t47", "t46", "t45", OTHER_TENANTS}
    assert report[OTHER_TENANTS]["stored_blocks"] == sum(range(1, 46))
    total = sum(row["stored_blocks"] for row in report.values())
    assert total == sum(range(1, 51))  # nothing lost by the cap


def test_a_tenant_named_other_is_summed_with_the_rest() -> None:
    ledger = TenantLedger(BLOCK, report_top=5)
    ledger.stored(OTHER_TENANTS, stored=100, rejected=0)
    ledger.stored("small", stored=1, rejected=0)
    report = ledger.report(resident=0)
    assert set(report) == {"small", OTHER_TENANTS}
    assert report[OTHER_TENANTS]["stored_blocks"] == 100


def test_memory_is_bounded_past_the_tracked_tenants() -> None:
    """Past `tracked` tenants, the idle half is folded into `other`: counts kept,
    never lost; a tenant holding primary blocks is never folded."""
    ledger = TenantLedger(BLOCK, report_top=3, tracked=8)
    ledger.placed("holder", [b"k" * 20])
    for i in range(100):
        ledger.stored(f"t{i}", stored=1, rejected=0)
    assert len(ledger) <= 8
    report = ledger.report(resident=1)
    assert sum(row["stored_blocks"] for row in report.values()) == 100
    assert sum(row["primary_blocks"] for row in report.values()) == 1
    ledger.evicted([b"k" * 20])
    assert ledger.counts("holder").primary_blocks == 0


def test_eviction_of_blocks_no_tenant_owns_costs_nothing() -> None:
    ledger = TenantLedger(BLOCK)
    ledger.placed(None, [b"a" * 20, b"b" * 20])  # the default: not tracked per key
    ledger.evicted([b"a" * 20])
    assert ledger.report(resident=1)[DEFAULT_TENANT]["primary_blocks"] == 1


@pytest.mark.parametrize("top", [0, -1, 1001, "ten"])
def test_report_top_is_validated(top: object) -> None:
    with pytest.raises(ConfigError, match=r"tenants\.report_top"):
        parse_config(chain(extra=f"tenants: {{report_top: {top}}}"))


def test_report_top_sets_the_ledgers_bound() -> None:
    config = parse_config(chain(extra="tenants: {report_top: 3}"))
    assert config.tenants.report_top == 3
    assert TieredCache(config).core.tenants.report_top == 3


async def test_no_raw_salt_in_stats_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    salt = "raw-salt-5f1c7a"
    ctx = ReqContext("r", tenant=salt_tenant(salt))
    caplog.set_level(logging.DEBUG)
    async with TieredCache(parse_config(chain())) as cache:
        await cache.store(keys(2, "x"), blocks(2), ctx=ctx)
        hit = await cache.lookup([keys(2, "x")], ctx)
        await cache.load(hit.keys_to_load, blocks(2), ctx)
        stats = cache.stats()
    assert salt not in repr(stats.as_dict())
    assert all(salt not in r.getMessage() for r in caplog.records)
    assert set(stats.tenants) == {salt_tenant(salt)}


def test_when_every_tracked_tenant_holds_blocks_new_ones_are_other() -> None:
    """Nothing can be folded: new tenants are summed as `other` at once, and the
    ledger looks for idle tenants again only after `tracked / 2` of them."""
    ledger = TenantLedger(BLOCK, report_top=2, tracked=4)
    for i in range(4):
        ledger.placed(f"h{i}", [bytes([i]) * 20])
    assert ledger.counts("new-1") is ledger.counts("new-2") is ledger.other
    ledger.evicted([bytes([0]) * 20])  # h0 idle now, folded at the next look
    assert ledger.counts("new-3") is ledger.other  # still skipping
    assert ledger.counts("new-4") is not ledger.other
    assert len(ledger) == 4
