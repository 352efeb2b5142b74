"""The conformance tests of claims (`protect` / `unprotect`), part of
`TierConformanceSuite`.

A tier that declares `protects_claims` must keep claimed blocks from its own eviction
until they are let go or their lease runs out, and refuse a store ("no room", failed
key) rather than evict a claimed block. Every tier, capable or not, must take
`protect` and `unprotect` of any keys (held, unknown, repeated) without error or a
change to what it holds. The tests that need eviction are skipped for a tier with
`supports_capacity = False`. Those that need claims pass at once for a tier without
`protects_claims` (not skipped: a tier need not protect claims, and the suite passes
whole, with nothing skipped, for a complete tier that does not: the README's plugin).
"""

from __future__ import annotations

import os

import anyio
import pytest

from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.contract.slab import PrimaryView
from tierkv.contract.tier import SecondaryTierManager
from tierkv.testing.suite_base import SuiteHooks, new_keys

_CTX = ReqContext(request_id="claims-conformance")


class ClaimConformance(SuiteHooks):
    """Mixed into `TierConformanceSuite`, whose hooks and helpers it uses."""

    def _keeps_claims(self, tier: SecondaryTierManager) -> bool:
        """Whether the claim tests apply: the tier protects claims (else there is
        nothing to prove beyond `test_protect_and_unprotect_change_no_answer`) and
        evicts (else there is no eviction to keep them from: skipped)."""
        if not self.supports_capacity:
            pytest.skip(f"{type(self).__name__} declares no capacity bound")
        return tier.protects_claims

    async def _loads(
        self, tier: SecondaryTierManager, view: PrimaryView, stored: dict[OffloadKey, bytes]
    ) -> None:
        keys = list(stored)
        slots = list(range(16, 16 + len(keys)))
        result = await tier.load(self.job(keys, slots))
        assert result.ok, result.error
        for key, slot in zip(keys, slots):
            assert bytes(view.block(slot)) == stored[key]

    # -- the tests --------------------------------------------------------------------
    async def test_protect_and_unprotect_change_no_answer(self) -> None:
        """Any tier (the default hooks do nothing) takes claims of held, unknown and
        repeated keys, and their release, without error or change."""
        view = self.view()
        async with self.opened(view) as tier:
            stored = await self._fill(tier, view, 3)
            keys = [*stored, *new_keys(1)]
            tier.protect(keys, 5.0)
            tier.protect(keys[:1], 5.0)
            assert await tier.lookup(keys, _CTX) == [True, True, True, False]
            tier.unprotect(keys)
            tier.unprotect(keys)
            tier.unprotect([])
            await self._loads(tier, view, stored)

    async def test_claimed_blocks_outlive_the_eviction_stores_cause(self) -> None:
        view = self.view()
        async with self.opened(view, capacity_blocks=4) as tier:
            if not self._keeps_claims(tier):
                return
            reported: list[OffloadKey] = []
            tier.set_removal_listener(reported.extend)
            old = await self._fill(tier, view, 4)
            claimed = dict(list(old.items())[:2])  # the two least recently used
            tier.protect(list(claimed), 30.0)
            await self._fill(tier, view, 2, first=4)
            assert reported, "nothing was evicted: capacity_blocks=4 is not honoured"
            assert not set(reported) & set(claimed), "a claimed block was evicted"
            await self._loads(tier, view, claimed)

    async def test_let_go_blocks_are_evictable_again(self) -> None:
        view = self.view()
        async with self.opened(view, capacity_blocks=4) as tier:
            if not self._keeps_claims(tier):
                return
            reported: list[OffloadKey] = []
            tier.set_removal_listener(reported.extend)
            old = list(await self._fill(tier, view, 4))
            tier.protect(old[:1], 30.0)
            tier.protect(old[:1], 30.0)  # two requests claim it
            tier.unprotect(old[:1])
            await self._fill(tier, view, 1, first=4)
            assert old[0] not in reported, "one claim on it is still live"
            tier.unprotect(old[:1])
            await self._fill(tier, view, 4, first=5)
            assert old[0] in reported, "a let-go block is evicted like any other"

    async def test_a_claim_lapses_when_its_lease_runs_out(self) -> None:
        view = self.view()
        async with self.opened(view, capacity_blocks=4) as tier:
            if not self._keeps_claims(tier):
                return
            reported: list[OffloadKey] = []
            tier.set_removal_listener(reported.extend)
            old = list(await self._fill(tier, view, 4))
            tier.protect(old[:1], 0.05)
            await anyio.sleep(0.1)
            await self._fill(tier, view, 4, first=4)
            assert old[0] in reported, "a claim past its lease must not hold the block"

    async def test_room_only_claimed_blocks_could_make_is_refused(self) -> None:
        """A store that would have to evict a claimed block fails its key instead:
        the claimed blocks stay and load, nothing is reported removed."""
        view = self.view()
        async with self.opened(view, capacity_blocks=4) as tier:
            if not self._keeps_claims(tier):
                return
            reported: list[OffloadKey] = []
            tier.set_removal_listener(reported.extend)
            held = {}
            for i in range(8):  # fill it up, whatever its exact room
                block = await self._fill(tier, view, 1, first=i)
                held.update(block)
            held = {k: v for k, v in held.items() if k not in reported}
            tier.protect(list(held), 30.0)
            [new] = new_keys(1)
            view.block(0)[:] = os.urandom(view.block_bytes)
            result = await tier.store(self.job([new], [0]))
            assert result.failed_keys == (new,), "a store must not evict a claimed block"
            assert result.error
            assert not set(reported) & set(held)
            await self._loads(tier, view, held)
