"""Per-tenant quotas on the primary (`tenants.quotas.primary`): a named tenant keeps
its quota whatever others store, a capped tenant evicts its own blocks or is
declined, and free room is borrowed only when the tier says so."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.errors import ConfigError
from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.contract.tenants import DEFAULT_TENANT

pytestmark = pytest.mark.anyio

BLOCK = 4096


def chain(quotas: str, capacity_blocks: int = 8, tiers: str = "[]", eviction: str = "lru") -> str:
    return f"""
namespace: quotas
layout: {{block_bytes: 4KiB, groups: [{{block_size: 16}}]}}
primary: {{capacity: {capacity_blocks * 4}KiB, pin_memory: false, eviction: {eviction}}}
tiers: {tiers}
tenants: {{quotas: {quotas}}}
"""


def keys(n: int, salt: str) -> list[OffloadKey]:
    hashes = hash_token_blocks(list(range(16 * n)), 16, namespace=f"quotas|{salt}")
    return [make_offload_key(h, 0) for h in hashes]


def blocks(n: int, fill: int = 0) -> torch.Tensor:
    return torch.full((n, BLOCK), fill, dtype=torch.uint8)


def held(cache: TieredCache) -> dict[str, int]:
    book = cache.primary.quotas
    assert book is not None
    return dict(book.held)


async def test_a_named_tenant_keeps_its_quota_under_a_flood() -> None:
    a, b = ReqContext(tenant="a"), ReqContext(tenant="b")
    ka = keys(4, "a")
    async with TieredCache(parse_config(chain("{primary: {tenants: {a: 50%}}}"))) as cache:
        await cache.store(ka, blocks(4), ctx=a)
        for i in range(10):  # b floods one-off prompts: 40 blocks through 8 slots
            result = await cache.store(keys(4, f"b{i}"), blocks(4), ctx=b)
            assert result.error is None
        assert all(k in cache.primary for k in ka)
        assert held(cache) == {"a": 4, "b": 4}
        assert len((await cache.lookup([ka], a)).keys_to_load) == 4
        tenants = cache.stats().tenants
    assert tenants["a"]["evicted_blocks"] == 0
    assert tenants["b"]["evicted_blocks"] == 36


async def test_without_quotas_the_same_flood_evicts_everything() -> None:
    """The baseline the quota is for: plain LRU gives a's blocks to the flood."""
    a, b = ReqContext(tenant="a"), ReqContext(tenant="b")
    ka = keys(4, "a")
    async with TieredCache(parse_config(chain("{}"))) as cache:
        await cache.store(ka, blocks(4), ctx=a)
        for i in range(10):
            await cache.store(keys(4, f"b{i}"), blocks(4), ctx=b)
        assert not any(k in cache.primary for k in ka)


async def test_a_borrower_gives_back_its_excess_first() -> None:
    """a may fill free room past its 50% (borrow: true, the default); b's stores take
    a's excess back, oldest first, and then only b's own blocks."""
    a, b = ReqContext(tenant="a"), ReqContext(tenant="b")
    ka = keys(8, "a")
    quotas = "{primary: {tenants: {a: 50%}}}"
    async with TieredCache(parse_config(chain(quotas))) as cache:
        await cache.store(ka, blocks(8), ctx=a)
        assert held(cache) == {"a": 8}
        await cache.store(keys(3, "b0"), blocks(3), ctx=b)
        assert held(cache) == {"a": 5, "b": 3}
        assert [k in cache.primary for k in ka] == [False] * 3 + [True] * 5
        await cache.store(keys(6, "b1"), blocks(6), ctx=b)
        assert held(cache) == {"a": 4, "b": 4}
        assert all(k in cache.primary for k in ka[4:])


async def test_a_hard_cap_declines_the_rest_and_counts_it() -> None:
    """borrow: false: a tenant at its cap whose own blocks cannot be evicted (no lower
    tier took them) is declined, with a reason, and nobody else loses a block."""
    a, b = ReqContext(tenant="a"), ReqContext(tenant="b")
    quotas = "{primary: {borrow: false, default: 25%}}"
    async with TieredCache(parse_config(chain(quotas))) as cache:
        kb = keys(2, "b")
        await cache.store(kb, blocks(2), ctx=b)
        result = await cache.store(keys(5, "a"), blocks(5), ctx=a)
        assert len(result.stored) == 2
        assert len(result.rejected) == 3
        assert result.error is not None and "tenant 'a' holds its quota" in result.error
        assert "8KiB" in result.error
        assert held(cache) == {"a": 2, "b": 2}
        assert all(k in cache.primary for k in kb)
        stats = cache.stats()
        book = cache.primary.quotas
    assert stats.tenants["a"]["declined_blocks"] == 3
    assert stats.tenants["b"]["declined_blocks"] == 0
    assert book is not None and book.declined == {"a": 3}


async def test_a_capped_tenant_evicts_its_own_blocks() -> None:
    """With a lower tier that takes its blocks, a tenant at its cap cycles its own
    blocks through its share; another tenant's blocks stay."""
    a, b = ReqContext(tenant="a"), ReqContext(tenant="b")
    quotas = "{primary: {borrow: false, tenants: {a: 25%}}}"
    memory = "[{type: memory, capacity: 1MiB}]"
    async with TieredCache(parse_config(chain(quotas, tiers=memory))) as cache:
        kb = keys(3, "b")
        await cache.store(kb, blocks(3), ctx=b)
        for i in range(4):
            result = await cache.store(keys(2, f"a{i}"), blocks(2, i), ctx=a)
            assert result.error is None, result.error
            await cache.flush()
        assert held(cache) == {"a": 2, "b": 3}
        assert all(k in cache.primary for k in kb)
        # a's older blocks went down to the memory tier and still load
        hit = await cache.lookup([keys(2, "a0")], a)
        assert len(hit.keys_to_load) == 2
        out = blocks(2, 9)
        loaded = await cache.load(hit.keys_to_load, out, a)
        assert loaded.ok and bool((out == 0).all())


async def test_a_promotion_takes_no_guaranteed_block() -> None:
    """b's load promotes its blocks back into b's part: a's guaranteed blocks stay."""
    a, b = ReqContext(tenant="a"), ReqContext(tenant="b")
    quotas = "{primary: {tenants: {a: 50%}}}"
    memory = "[{type: memory, capacity: 1MiB}]"
    async with TieredCache(parse_config(chain(quotas, tiers=memory))) as cache:
        kb = keys(4, "b")
        await cache.store(kb, blocks(4, 7), ctx=b)
        await cache.flush()
        ka = keys(4, "a")
        await cache.store(ka, blocks(4), ctx=a)
        await cache.store(keys(4, "b1"), blocks(4), ctx=b)  # evicts b's first four
        await cache.flush()
        assert not any(k in cache.primary for k in kb)
        hit = await cache.lookup([kb], b)
        out = blocks(4)
        loaded = await cache.load(hit.keys_to_load, out, b)
        assert loaded.ok and bool((out == 7).all())
        assert all(k in cache.primary for k in ka)
        assert held(cache) == {"a": 4, "b": 4}


async def test_requests_without_a_tenant_are_the_default_tenants() -> None:
    quotas = f"{{primary: {{borrow: false, tenants: {{{DEFAULT_TENANT}: 25%}}}}}}"
    async with TieredCache(parse_config(chain(quotas))) as cache:
        result = await cache.store(keys(4, "d"), blocks(4))  # no ctx
        assert len(result.stored) == 2 and len(result.rejected) == 2
        assert held(cache) == {DEFAULT_TENANT: 2}


def test_named_quotas_past_the_tier_are_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"\(a: 60%, b: 20KiB\) add up to more than the tier holds"
    ):
        parse_config(chain("{primary: {tenants: {a: 60%, b: 20KiB}}}"))


@pytest.mark.parametrize(
    ("quotas", "message"),
    [
        (
            "{nvme: {default: 10%}}",
            "tenants.quotas: 'nvme' names no tier of the chain; use one of 'primary'",
        ),
        (
            "{primary: {default: 1KiB}}",
            r"primary.default: 1KiB is 1KiB, less than one block \(4KiB\)",
        ),
        ("{primary: {tenants: {a: 120%}}}", "a share must be above 0% and at most 100%"),
        ("{primary: {tenants: {a: 2Gb}}}", "sizes are in bytes"),
        ("{primary: {tenants: {a: lots}}}", "is not a quota"),
        ("{primary: {tenants: {other: 10%}}}", "is reserved"),
        ("{primary: {shares: {a: 10%}}}", "shares"),
    ],
)
def test_bad_quotas_are_clear_errors(quotas: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(chain(quotas))


def test_without_quotas_the_primary_keeps_no_book() -> None:
    cache = TieredCache(parse_config(chain("{}")))
    assert cache.primary.quotas is None


TENANTS = ["a", "b", "c", "d"]
QUOTAS = "{primary: {borrow: %s, default: 25%%, tenants: {a: 25%%, b: 50%%}}}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    borrow=st.booleans(),
    eviction=st.sampled_from(["lru", "arc"]),
    stores=st.lists(
        st.tuples(st.sampled_from(TENANTS), st.integers(1, 6)), min_size=1, max_size=25
    ),
)
def test_quota_invariants(borrow: bool, eviction: str, stores: list[tuple[str, int]]) -> None:
    """Whatever the stores: a named tenant never loses blocks of its quota to
    another tenant; without borrowing nobody holds more than its cap; the book's
    counts are the primary's blocks; every block reads back what was stored."""
    import anyio

    async def run() -> None:
        quotas = QUOTAS % str(borrow).lower()
        config = parse_config(chain(quotas, capacity_blocks=12, eviction=eviction))
        async with TieredCache(config) as cache:
            book = cache.primary.quotas
            assert book is not None
            written: dict[OffloadKey, int] = {}
            for i, (tenant, n) in enumerate(stores):
                before = dict(book.held)
                ks = keys(n, f"{tenant}{i}")
                await cache.store(ks, blocks(n, i % 251), ctx=ReqContext(tenant=tenant))
                written.update(dict.fromkeys(ks, i % 251))
                for name, cap in book.limits.items():
                    if name != tenant:
                        kept = min(before.get(name, 0), cap)
                        assert book.held.get(name, 0) >= kept, (name, before, book.held)
                if not borrow:
                    for name, count in book.held.items():
                        cap = book.cap(name)
                        assert cap is None or count <= cap
                assert sum(book.held.values()) == len(cache.primary)
                assert set(book.owner) == set(cache.primary.keys_in_slots())
            for key in cache.primary.keys_in_slots():
                out = blocks(1, 255)
                loaded = await cache.load([key], out, ReqContext(tenant="a"))
                assert loaded.ok and bool((out == written[key]).all())

    anyio.run(run)
