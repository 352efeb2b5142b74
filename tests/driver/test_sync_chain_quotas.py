"""`SyncChain(quotas=...)`: the tiers it names hold every store of the chain to its
tenant's share (`GuardedTier.set_quotas`); the others are left as they are."""

from __future__ import annotations

import pytest

from tierkv.contract.keys import OffloadKey, make_offload_key
from tierkv.contract.slab import PrimaryView
from tierkv.driver.sync_chain import SyncChain
from tierkv.memory_tier import MemoryTierConfig
from tierkv.quotas.config import TierQuotas

BLOCK = 256


def keys(n: int, salt: str) -> list[OffloadKey]:
    return [make_offload_key(f"{salt}{i:04d}".encode(), 0) for i in range(n)]


def memory(name: str, blocks: int = 16) -> MemoryTierConfig:
    # room for `blocks` framed blocks of BLOCK bytes (a frame adds a header)
    return MemoryTierConfig(type="memory", name=name, capacity=blocks * (BLOCK + 192))


def test_a_named_tenant_keeps_its_share_while_another_floods() -> None:
    slab = PrimaryView(bytearray(BLOCK * 8), BLOCK, "quotas")
    quotas = {"small": TierQuotas.model_validate({"tenants": {"acme": "50%"}})}
    chain = SyncChain([memory("small"), memory("big", 64)], ["small", "big"], slab, quotas=quotas)
    try:
        small, big = chain.tiers
        assert small.quotas is not None and big.quotas is None
        mine = keys(4, "acme")
        assert chain.store(mine, [0, 1, 2, 3], tenant="acme") == set(mine)
        capacity = small.tier.room().capacity_blocks  # of this key length's frames
        for round_ in range(2 * capacity):
            flood = keys(2, f"flood{round_}")
            assert chain.store(flood, [4, 5], tenant="flooder") == set(flood)  # big took them
        book = small.quotas.book
        assert book.held == {"acme": 4, "flooder": capacity - 4}
        assert book.cap("acme") == book.capacity_blocks // 2
        assert small.tier.room().free_blocks == 0
        assert chain.present(mine) == [True] * 4
        flags = chain._loop.run(small.lookup(mine, chain._ctx, None), timeout=10.0)
        assert flags == [True] * 4  # in the tier with the quota itself, not only in big
    finally:
        chain.close()


def test_a_store_past_a_hard_cap_is_declined_for_that_tier() -> None:
    slab = PrimaryView(bytearray(BLOCK * 8), BLOCK, "quotas")
    quotas = {"memory": TierQuotas.model_validate({"borrow": False, "default": f"{2 * BLOCK}"})}
    chain = SyncChain([memory("memory")], ["memory"], slab, quotas=quotas)
    try:
        ks = keys(4, "capped")
        assert chain.store(ks, [0, 1, 2, 3], tenant="capped") == set(ks[:2])
        (tier,) = chain.tiers
        assert tier.quotas is not None
        assert tier.quotas.book.held == {"capped": 2}
        assert tier.quotas.book.declined == {"capped": 2}
        assert tier.refresh_stats().errors == 0  # a decline is not held against the tier
        assert chain.present(ks) == [True, True, False, False]
    finally:
        chain.close()


def test_quotas_for_a_tier_the_chain_lacks_are_refused() -> None:
    slab = PrimaryView(bytearray(BLOCK * 8), BLOCK, "quotas")
    with pytest.raises(ValueError, match="'nvme', which names no tier of the chain"):
        SyncChain([memory("memory")], ["memory"], slab, quotas={"nvme": TierQuotas()})
