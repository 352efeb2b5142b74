"""The conformance tests of eviction candidates (`room`, `eviction_candidates`), part
of `TierConformanceSuite`.

A tier that declares `names_eviction_candidates` must tell the truth ahead of its own
eviction: `room()` counts down as blocks are stored and reaches 0 when the tier is
full, and the first of `eviction_candidates()` is the block the next store that needs
room evicts (a claimed block is never named). `admission: tinylfu` weighs new blocks
against that block, so a tier that names another one is judged against the wrong
rival. The tests pass at once for a tier without the capability, and are skipped for
one with `supports_capacity = False`.
"""

from __future__ import annotations

from itertools import islice

import pytest

from tierkv.contract.keys import OffloadKey
from tierkv.contract.tier import SecondaryTierManager
from tierkv.testing.suite_base import SuiteHooks


class CandidateConformance(SuiteHooks):
    """Mixed into `TierConformanceSuite`, whose hooks and helpers it uses."""

    def _names_candidates(self, tier: SecondaryTierManager) -> bool:
        if not self.supports_capacity:
            pytest.skip(f"{type(self).__name__} declares no capacity bound")
        return tier.names_eviction_candidates

    # -- the tests --------------------------------------------------------------------
    async def test_room_counts_down_to_full(self) -> None:
        view = self.view()
        async with self.opened(view, capacity_blocks=4) as tier:
            if not self._names_candidates(tier):
                return
            assert list(tier.eviction_candidates()) == []
            await self._fill(tier, view, 1)  # the tier now knows its blocks' size
            one = tier.room()
            assert one.free_blocks == one.capacity_blocks - 1 >= 3  # sized for 4 blocks
            await self._fill(tier, view, 2, first=1)
            assert tier.room() == (one.free_blocks - 2, one.capacity_blocks)
            await self._fill(tier, view, one.free_blocks - 1, first=3)  # one too many
            assert tier.room().free_blocks == 0

    async def test_the_first_candidate_is_the_next_block_evicted(self) -> None:
        view = self.view()
        async with self.opened(view, capacity_blocks=4) as tier:
            if not self._names_candidates(tier):
                return
            reported: list[OffloadKey] = []
            tier.set_removal_listener(reported.extend)
            old = list(await self._fill(tier, view, 1))
            old += await self._fill(tier, view, tier.room().free_blocks, first=1)
            assert list(islice(tier.eviction_candidates(), 8)) == old  # oldest first
            tier.protect(old[:1], 30.0)  # a claimed block is never named, nor evicted
            named = next(tier.eviction_candidates())
            assert named == old[1]
            await self._fill(tier, view, 1, first=4)
            assert reported == [named]
            tier.unprotect(old[:1])
            assert next(tier.eviction_candidates()) == old[0]
