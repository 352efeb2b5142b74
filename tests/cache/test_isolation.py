"""Tenant isolation (`tenants.isolate`, issue 52): the same token blocks stored by two
tenants are two blocks, in the primary and in every tier, and neither tenant's lookup
finds the other's; the default tenant keeps its keys; results and events name the
caller's keys; and with the switch off the keys reaching the tiers are the caller's.

Real tiers: nvme in a temporary directory, the memory tier and its `faulty` variant
(which logs the keys of every call).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tierkv.cache.isolation as isolation
from tierkv.cache import TieredCache
from tierkv.cache.isolation import EventNames, TenantPrefetch, tenant_keys
from tierkv.config import parse_config
from tierkv.contract.events import OffloadingEvent
from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.primary import MEDIUM as PRIMARY
from tierkv.testing import FaultyTier

pytestmark = pytest.mark.anyio

BLOCK = 1024
A, B = ReqContext("ra", tenant="acme"), ReqContext("rb", tenant="globex")


def keys(n: int, tag: str = "shared") -> list[OffloadKey]:
    hashes = hash_token_blocks(list(range(16 * n)), 16, namespace=tag)
    return [make_offload_key(h, 0) for h in hashes]


def filled(n: int, value: int) -> torch.Tensor:
    return torch.full((n, BLOCK), value, dtype=torch.uint8)


def out(n: int) -> torch.Tensor:
    return torch.zeros(n, BLOCK, dtype=torch.uint8)


def nvme(tmp_path: Path) -> dict[str, Any]:
    return {"type": "nvme", "path": str(tmp_path / "nvme"), "capacity": "1MiB", "fsync": "never"}


def chain(tiers: list[dict[str, Any]], primary_blocks: int = 16, isolate: bool = True) -> Any:
    return parse_config(
        {
            "namespace": "isolation",
            "layout": {"block_bytes": BLOCK, "groups": [{"block_size": 16}]},
            "primary": {"capacity": primary_blocks * BLOCK, "pin_memory": False},
            "tiers": tiers,
            "tenants": {"isolate": isolate},
        }
    )


async def push_out(cache: TieredCache, tag: str = "filler") -> None:
    """Fill the primary with new blocks of the default tenant's: what was there is
    evicted."""
    n = cache.primary.num_blocks
    assert (await cache.store(keys(n, tag), filled(n, 99))).stored
    await cache.flush()


# -- the derivation ----------------------------------------------------------------------
def test_a_tenant_key_keeps_the_length_and_the_group_and_is_the_tenants_own() -> None:
    ks = [make_offload_key(bytes([i]) * n, g) for i, (n, g) in enumerate([(16, 0), (32, 3)])]
    ks.append(make_offload_key(b"\x07" * 100, 1))  # longer than BLAKE2b's digest
    acme, again, globex = (
        tenant_keys("acme", ks),
        tenant_keys("acme", ks),
        tenant_keys("globex", ks),
    )
    assert acme == again  # stable: a shared tier keeps a tenant's blocks across servers
    for key, mine, theirs in zip(ks, acme, globex):
        assert len(mine) == len(key) and mine[-4:] == key[-4:]
        assert len({key, mine, theirs}) == 3
    assert tenant_keys("acme", ks[1:2] * 3) == acme[1:2] * 3  # one length: the fast path
    assert tenant_keys("acme", [b"abc", "x", 7]) == [b"abc", "x", 7]  # refused by the call


def test_event_names_are_bounded_and_keep_the_recently_used() -> None:
    names = EventNames(limit=16)
    ks = keys(40, "names")
    ours = tenant_keys("acme", ks)
    names.remember(ours[:1], ks[:1])
    for i in range(1, 40):
        names.remember(ours[i : i + 1], ks[i : i + 1])
        names.remember(ours[:1], ks[:1])  # the first is used all the time
    assert len(names) <= 16
    named = names.name([OffloadingEvent((ours[0], ours[39], ks[5]), "cpu", removed=True)])
    assert named[0].keys == (ks[0], ks[39], ks[5])  # default keys pass as they are


# -- two tenants, one prefix ---------------------------------------------------------------
async def test_two_tenants_storing_the_same_keys_hold_two_blocks(tmp_path: Path) -> None:
    ks = keys(4)
    async with TieredCache(chain([nvme(tmp_path)])) as cache:
        assert (await cache.store(ks, filled(4, 1), ctx=A)).stored == tuple(ks)
        assert (await cache.store(ks, filled(4, 2), ctx=B)).stored == tuple(ks)
        await cache.flush()
        assert len(cache.primary) == 8
        mine, theirs = tenant_keys("acme", ks), tenant_keys("globex", ks)
        assert all(k in cache.primary for k in mine + theirs)
        assert not any(k in cache.primary for k in ks)
        disk = cache.tier("nvme")
        assert await disk.lookup(mine + theirs, ReqContext()) == [True] * 8
        assert await disk.lookup(ks, ReqContext()) == [False] * 4
        for ctx, value in ((A, 1), (B, 2)):  # each reads its own bytes back
            into = out(4)
            assert (await cache.load(ks, into, ctx)).ok
            assert bool((into == value).all())


async def test_neither_tenant_finds_the_others_blocks_in_any_tier(tmp_path: Path) -> None:
    ks = keys(4)
    async with TieredCache(chain([nvme(tmp_path)], primary_blocks=8)) as cache:
        await cache.store(ks, filled(4, 1), ctx=A)
        await cache.flush()
        for ctx in (B, ReqContext("rd"), ReqContext("re", tenant="default")):
            assert (await cache.lookup([ks], ctx)).hit_tokens == 0  # the primary's
        await push_out(cache)
        assert not any(k in cache.primary for k in tenant_keys("acme", ks))
        assert (await cache.lookup([ks], B)).hit_tokens == 0  # nor nvme's
        failed = await cache.load(ks, out(4), B)
        assert failed.failed_keys == tuple(ks)
        hit = await cache.lookup([ks], A)
        assert hit.hit_tokens == 64 and set(hit.locations.values()) == {"nvme"}
        into = out(4)
        assert (await cache.load(hit.keys_to_load, into, A)).ok
        assert bool((into == 1).all())


async def test_the_default_tenant_keeps_its_keys() -> None:
    """With isolation on, calls without a tenant (None, "", "default") are one tenant
    under the caller's own keys: what a cache with no tenants stored is found."""
    ks = keys(3)
    async with TieredCache(chain([{"type": "memory", "capacity": "1MiB"}])) as cache:
        await cache.store(ks, filled(3, 5))
        await cache.flush()
        assert all(k in cache.primary for k in ks)
        assert await cache.tier("memory").lookup(ks, ReqContext()) == [True] * 3
        for ctx in (None, ReqContext(tenant=""), ReqContext(tenant="default")):
            assert (await cache.lookup([ks], ctx)).keys_to_load == tuple(ks)
        assert (await cache.lookup([ks], A)).hit_tokens == 0
        events = cache.take_events()
    assert {k for e in events for k in e.keys} == set(ks)


# -- what goes back is in the caller's keys ------------------------------------------------
async def test_results_are_in_the_callers_keys(tmp_path: Path) -> None:
    ks = keys(4)
    async with TieredCache(chain([nvme(tmp_path)], primary_blocks=8)) as cache:
        first = await cache.store(ks[:2], filled(2, 1), ctx=A)
        again = await cache.store(ks, filled(4, 1), ctx=A)
        assert first.stored == tuple(ks[:2])
        assert (again.already_present, again.stored) == (tuple(ks[:2]), tuple(ks[2:]))
        await cache.flush()
        await push_out(cache)
        await cache.store(ks[:1], filled(1, 1), ctx=A)  # one in the primary, three on disk
        hit = await cache.lookup([ks], A)
        assert hit.group_keys == (tuple(ks),) and hit.keys_to_load == tuple(ks)
        assert dict(hit.locations) == {ks[0]: PRIMARY, **dict.fromkeys(ks[1:], "nvme")}
        stranger = keys(1, "never-stored")[0]
        loaded = await cache.load([*hit.keys_to_load, stranger], out(5), A)
        assert loaded.ok_keys == tuple(ks) and loaded.failed_keys == (stranger,)
        assert set(loaded.errors) == {stranger}
        assert dict(loaded.sources) == {ks[0]: PRIMARY, **dict.fromkeys(ks[1:], "nvme")}
        assert cache.usable_tokens(hit, loaded) == 64


async def test_events_name_the_callers_keys(tmp_path: Path) -> None:
    ks = keys(4)
    async with TieredCache(chain([nvme(tmp_path)], primary_blocks=8)) as cache:
        await cache.store(ks, filled(4, 1), ctx=A)
        await cache.store(ks, filled(4, 2), ctx=B)
        await cache.flush()
        events = cache.take_events()
        await push_out(cache)  # evicts both tenants' copies from the primary
        events += cache.take_events()

    def count(medium: str, removed: bool) -> Counter[OffloadKey]:
        """The events' keys of `medium`, the filler's left out."""
        of = [e for e in events if (e.medium, e.removed) == (medium, removed)]
        return Counter(k for e in of for k in e.keys if k not in filler)

    filler = set(keys(8, "filler"))

    both = Counter(ks * 2)  # each tenant's copy, named by the caller's key
    assert count(PRIMARY, False) == count("nvme", False) == count(PRIMARY, True) == both


async def test_a_prefetch_reports_in_the_callers_keys(tmp_path: Path) -> None:
    ks = keys(4)
    async with TieredCache(chain([nvme(tmp_path)], primary_blocks=16)) as cache:
        await cache.store(ks, filled(4, 3), ctx=A)
        await cache.flush()
        await push_out(cache)
        p = cache.prefetch([ks], A)
        assert isinstance(p, TenantPrefetch) and p.request_id == "ra"
        await p.wait()
        assert p.done and p.promoted == ks and p.held == set(ks)
        assert (p.shed, p.failed) == ([], {})
        assert "promoted=4" in repr(p)
        with pytest.raises(AttributeError, match="read-only"):
            p.promoted = []
        p.cancel()
        assert p.held == set()
        assert cache.prefetch([ks], B).request_id == "rb"  # nothing of globex's to find
        await push_out(cache, "filler2")
        hit = await cache.lookup([ks], A)
        assert set(hit.locations.values()) == {"nvme"}
        from_hit = cache.prefetch(hit, A)  # from a LookupResult in the caller's keys
        await from_hit.wait()
        assert from_hit.promoted == ks
        into = out(4)
        assert (await cache.load(hit.keys_to_load, into, A)).ok
        assert bool((into == 3).all())


async def test_bad_arguments_are_refused_as_for_any_tenant() -> None:
    ks = keys(1)
    async with TieredCache(chain([])) as cache:
        for ctx in (None, A):
            with pytest.raises(ValueError, match=r"keys\[1\] must be bytes"):
                await cache.store([ks[0], [1]], filled(2, 0), ctx=ctx)  # type: ignore[list-item]
            with pytest.raises(ValueError, match=r"keys_per_group\[0\]\[0\] is 3 bytes"):
                await cache.lookup([[b"abc"]], ctx)
            with pytest.raises(ValueError, match="lookup got keys for 2 groups"):
                await cache.lookup([ks, ks], ctx)
        assert len(cache.primary) == 0


# -- off: nothing changes, nothing is paid -------------------------------------------------
async def test_off_the_tiers_get_the_callers_keys_and_nothing_is_derived(
    faulty_tier_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: Any) -> Any:
        raise AssertionError("a key was derived")

    monkeypatch.setattr(isolation, "tenant_keys", never)
    ks = keys(3)
    tier = {"type": faulty_tier_type, "capacity": "1MiB"}
    async with TieredCache(chain([tier], isolate=False)) as cache:
        await cache.store(ks, filled(3, 1), ctx=A)
        await cache.flush()
        faulty = cache.tier(faulty_tier_type)
        assert isinstance(faulty, FaultyTier)
        assert faulty.stored_keys() == set(ks) and all(k in cache.primary for k in ks)
        hit = await cache.lookup([ks], B)  # off: tenants share what their keys share
        assert hit.keys_to_load == tuple(ks)
        assert (await cache.load(hit.keys_to_load, out(3), B)).ok
    async with TieredCache(chain([tier])) as cache:  # on, but the default tenant
        await cache.store(ks, filled(3, 1))
        await cache.flush()
        faulty = cache.tier(faulty_tier_type)
        assert isinstance(faulty, FaultyTier) and faulty.stored_keys() == set(ks)


# -- the property ------------------------------------------------------------------------
TENANTS = (None, "", "default", "acme", "globex")
CLASS = {None: 0, "": 0, "default": 0, "acme": 1, "globex": 2}  # the first three: one tenant
NKEYS = 5
KEYS = keys(NKEYS, "property")
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("store"),
            st.sampled_from(TENANTS),
            st.lists(st.integers(0, NKEYS - 1), min_size=1, max_size=3, unique=True),
            st.integers(0, 3),
        ),
        st.tuples(st.just("read"), st.sampled_from(TENANTS), st.integers(0, NKEYS - 1)),
        st.tuples(st.just("flush")),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_a_tenant_reads_back_only_what_it_stored(ops: list[tuple[Any, ...]]) -> None:
    """Random tenants storing random bytes under a few shared keys, through a 3-block
    primary and a 4-block memory tier (so blocks are evicted and promoted): a read
    returns bytes the reading tenant stored under that key, or misses; never bytes
    another tenant stored (each tenant's bytes differ from every other's)."""
    anyio.run(_replay, ops)


async def _replay(ops: list[tuple[Any, ...]]) -> None:
    tier = {"type": "memory", "capacity": 4 * BLOCK}
    stored: dict[tuple[int, int], set[int]] = {}  # (tenant class, key) -> values stored
    async with TieredCache(chain([tier], primary_blocks=3)) as cache:
        for op in ops:
            if op[0] == "store":
                _, tenant, at, version = op
                value = 1 + CLASS[tenant] * 10 + version  # a tenant's values are its own
                ctx = ReqContext(tenant=tenant)
                result = await cache.store([KEYS[i] for i in at], filled(len(at), value), ctx=ctx)
                for i in at:
                    if KEYS[i] in result.stored:
                        stored.setdefault((CLASS[tenant], i), set()).add(value)
            elif op[0] == "read":
                _, tenant, i = op
                ctx = ReqContext(tenant=tenant)
                into = out(1)
                loaded = await cache.load([KEYS[i]], into, ctx)
                if loaded.ok_keys:
                    values = set(into[0].unique().tolist())
                    assert values <= stored.get((CLASS[tenant], i), set()), (tenant, i, values)
                    assert len(values) == 1
            else:
                await cache.flush()
