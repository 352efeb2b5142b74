"""The reference `memory` tier passes the conformance suite, plus its own rules."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tierkv.contract.framing import header_bytes
from tierkv.contract.jobs import JobMetadata
from tierkv.contract.keys import OffloadKey
from tierkv.memory_tier import MemoryTier, MemoryTierConfig
from tierkv.primary import PrimaryTier, PrimaryView
from tierkv.testing import TierConformanceSuite, fill_slots, random_keys
from tierkv.tier import SecondaryTierManager

pytestmark = pytest.mark.anyio


class TestMemoryTierConformance(TierConformanceSuite):
    def make_tier(
        self, primary: PrimaryView, *, capacity_blocks: int | None, **fields: Any
    ) -> SecondaryTierManager:
        frame = primary.block_bytes + header_bytes(b"k" * 20)
        capacity = (capacity_blocks or 1024) * frame
        config = MemoryTierConfig(type="memory", capacity=capacity, **fields)
        return MemoryTier(config, primary)

    async def corrupt(self, tier: SecondaryTierManager, key: OffloadKey) -> None:
        assert isinstance(tier, MemoryTier)
        frame = bytearray(tier._frames[key])
        frame[-1] ^= 0xFF
        tier._frames[key] = bytes(frame)

    async def plant(self, tier: SecondaryTierManager, key: OffloadKey, frame: bytes) -> None:
        assert isinstance(tier, MemoryTier) and key in tier._frames
        tier._frames[key] = frame


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _tier(capacity: int) -> tuple[PrimaryTier, MemoryTier]:
    primary = PrimaryTier(8, 1024, pin_memory=False, namespace="mem")
    return primary, MemoryTier(MemoryTierConfig(type="memory", capacity=capacity), primary.view)


async def test_block_larger_than_capacity_fails_that_key_only() -> None:
    _, tier = _tier(capacity=100)  # smaller than one framed 1 KiB block
    keys = random_keys(1, random.Random(0))
    result = await tier.store(JobMetadata(1, tuple(keys), (0,)))
    assert result.failed_keys == tuple(keys)
    assert "exceeds the memory tier capacity" in (result.error or "")
    assert len(tier) == 0


async def test_capacity_counts_framed_bytes_and_evicts_least_recent() -> None:
    frame = 1024 + header_bytes(b"k" * 20)
    primary, tier = _tier(capacity=3 * frame)
    rng = random.Random(1)
    keys = random_keys(4, rng)
    fill_slots(primary.view, range(4), rng)
    for i, key in enumerate(keys[:3]):
        assert (await tier.store(JobMetadata(i, (key,), (i,)))).ok
    # a load makes keys[0] recent, so keys[1] is the one the fourth store evicts
    assert (await tier.load(JobMetadata(10, (keys[0],), (5,)))).ok
    assert (await tier.store(JobMetadata(11, (keys[3],), (3,)))).ok
    assert await tier.lookup(keys, None) == [True, False, True, True]  # type: ignore[arg-type]
    assert tier.used_bytes == 3 * frame


async def test_closed_tier_refuses_work() -> None:
    from tierkv.contract.errors import TierUnavailable

    _, tier = _tier(capacity=1 << 20)
    await tier.close()
    with pytest.raises(TierUnavailable, match="closed"):
        await tier.store(JobMetadata(1, tuple(random_keys(1)), (0,)))


def test_report_removed_reaches_the_listener_only_when_set() -> None:
    from tierkv.contract.slab import PrimaryView
    from tierkv.memory_tier import MemoryTier, MemoryTierConfig

    tier = MemoryTier(MemoryTierConfig(type="memory"), PrimaryView(bytearray(16), 8, "ns"))
    tier.report_removed([b"k" * 8])  # no listener yet: nothing to tell, nothing raised
    heard: list[tuple[bytes, ...]] = []
    tier.set_removal_listener(heard.append)
    tier.report_removed([b"a" * 8, b"b" * 8])
    tier.report_removed([])
    assert heard == [(b"a" * 8, b"b" * 8)]
