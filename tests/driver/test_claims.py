"""`ClaimLedger` and `GuardedTier.protect`/`unprotect`: every claim a lookup takes ends
exactly once (let go, or counted lease_expired), whoever ends it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from tierkv.contract.claims import ClaimTable
from tierkv.contract.jobs import JobMetadata, JobResult
from tierkv.contract.keys import OffloadKey
from tierkv.contract.tier import NO_ROOM
from tierkv.driver import GuardedTier
from tierkv.driver.claims import ClaimLedger
from tierkv.memory_tier import MemoryTier, MemoryTierConfig
from tierkv.primary import PrimaryView


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def guarded(clock: Clock, index: int = 0, **fields: Any) -> GuardedTier:
    view = PrimaryView(bytearray(4 * 1024), 1024, "ledger")
    tier = MemoryTier(MemoryTierConfig(type="memory", **fields), view)
    tier.claims = ClaimTable(clock)
    return GuardedTier(tier, index=index, name=f"memory-{index}")


def ledger(*lease: float) -> tuple[ClaimLedger, list[GuardedTier], Clock]:
    clock = Clock()
    tiers = [guarded(clock, i, claim_lease=s) for i, s in enumerate(lease)]
    return ClaimLedger(tiers, clock), tiers, clock


A, B, C = b"a" * 20, b"b" * 20, b"c" * 20


def live(handle: GuardedTier) -> int:
    return handle.tier.claims.sweep()


def test_a_lookup_keeps_the_claims_its_hit_reads_and_lets_go_the_rest() -> None:
    claims, (t0, t1), _ = ledger(10, 10)
    taken = [claims.take(t0, [A, B]), claims.take(t1, [B, C])]
    # B is read from tier 0 (the highest holding it); C lies past the hit
    claims.keep("r", [t for t in taken if t], {A: 0, B: 0})
    assert claims.held("r") == {0: {A, B}}
    assert (live(t0), live(t1)) == (2, 0)
    assert t0.stats.protected == 2 and t1.stats.protected == 2
    assert (t0.stats.claims_held, t1.stats.claims_held) == (2, 0)
    assert claims.let_go("r", [A]) == 1
    assert claims.let_go("r") == 1
    assert claims.let_go("r") == 0  # exactly once
    assert live(t0) == 0 and t0.stats.claims_held == 0 and t0.stats.lease_expired == 0
    assert len(claims) == 0


def test_the_next_lookup_of_a_request_replaces_its_claims() -> None:
    claims, (t0,), _ = ledger(10)
    for _ in range(3):
        taken = claims.take(t0, [A, B])
        assert taken is not None
        claims.keep("r", [taken], {A: 0, B: 0})
        assert live(t0) == 2  # renewed, never stacked, never unprotected in between
    assert t0.stats.protected == 6 and t0.stats.claims_held == 2


def test_a_claim_past_its_lease_is_counted_not_let_go() -> None:
    claims, (t0,), clock = ledger(1.0)
    taken = claims.take(t0, [A])
    assert taken is not None
    claims.keep("r", [taken], {A: 0})
    clock.now += 1.0
    assert claims.let_go("r") == 1
    assert t0.stats.lease_expired == 1 and t0.stats.claims_held == 0
    assert t0.tier.claims.sweep() == 0
    assert t0.tier.claims.expired == 1  # the tier dropped it itself, once


def test_the_sweep_counts_owners_whose_claims_all_ran_out() -> None:
    claims, (t0, t1), clock = ledger(1.0, 3.0)
    for owner in ("r1", "r2"):
        taken = [claims.take(t0, [A]), claims.take(t1, [B])]
        claims.keep(owner, [t for t in taken if t], {A: 0, B: 1})
    clock.now += 2.0
    claims.sweep()
    assert len(claims) == 2  # tier 1's claims still live
    clock.now += 1.0
    claims.sweep()
    assert len(claims) == 0
    assert t0.stats.lease_expired == 2 and t1.stats.lease_expired == 2
    assert t0.stats.claims_held == 0 and t1.stats.claims_held == 0


def test_drop_and_let_go_all_end_everything() -> None:
    claims, (t0,), _ = ledger(10)
    first = claims.take(t0, [A, B])
    assert first is not None
    claims.drop([first])  # a lookup that failed before its hit was known
    assert live(t0) == 0
    taken = claims.take(t0, [C])
    assert taken is not None
    claims.keep("r", [taken], {C: 0})
    claims.let_go_all()
    assert live(t0) == 0 and len(claims) == 0 and t0.stats.claims_held == 0


def test_tiers_that_take_no_claims_are_sent_none() -> None:
    class Plain(MemoryTier):
        protects_claims = False

    clock = Clock()
    view = PrimaryView(bytearray(4 * 1024), 1024, "ledger")
    plain = GuardedTier(Plain(MemoryTierConfig(type="memory"), view))
    off = guarded(clock, claim_lease=0)
    claims = ClaimLedger([plain, off], clock)
    assert plain.claim_lease == 0 and off.claim_lease == 0
    assert claims.take(plain, [A]) is None and claims.take(off, [A]) is None
    assert plain.stats.protected == 0 and off.stats.protected == 0
    assert claims.let_go(None) == 0


def test_a_tier_whose_protect_raises_is_logged_and_unclaimed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken(MemoryTier):
        def protect(self, keys: Sequence[OffloadKey], lease: float) -> None:
            raise RuntimeError("no claims today")

    view = PrimaryView(bytearray(4 * 1024), 1024, "ledger")
    handle = GuardedTier(Broken(MemoryTierConfig(type="memory"), view))
    claims = ClaimLedger([handle])
    assert claims.take(handle, [A]) is None
    assert "no claims today" in caplog.text
    assert handle.stats.protected == 0 and handle.stats.claims_held == 0


@pytest.mark.anyio
async def test_a_store_refused_for_room_does_not_count_against_the_breaker() -> None:
    """A tier full of blocks it may not evict is full, not down: a store that stored
    nothing for `NO_ROOM` leaves the breaker closed; any other reason still counts."""
    class Full(MemoryTier):
        reason = f"{NO_ROOM}: every block is claimed"

        async def store(self, job: JobMetadata) -> JobResult:
            return JobResult.failure(job, self.reason)

    view = PrimaryView(bytearray(4 * 1024), 1024, "ledger")
    tier = Full(MemoryTierConfig(type="memory", failure_threshold=1), view)
    handle = GuardedTier(tier)
    await handle.open()
    job = JobMetadata(1, (A,), (0,))
    await handle.run_job("store", job)
    assert handle.state == "closed" and handle.stats.errors == 0
    tier.reason = "disk on fire"
    await handle.run_job("store", job)
    assert handle.state == "open" and handle.stats.errors == 1
