"""Under SGLang's calls, a tier that failed comes back once its fault clears.

The bug this guards: after any fault that failed a few jobs in a row, the tier's
breaker opened and never closed again in that process (a lookup took the half-open
probe only to ask whether the tier served, then was refused, and nothing ever
reported on that probe). Each real fault here (`tier_fault`: a full disk, an
immutable directory, a SIGKILLed redis) is driven through open and half-open with
SGLang's calls (exists, get, set) running all along, then cleared: within
`recovery_after` plus one probe new pages store and load again, byte-identical.
While a disk cannot write, the pages it already holds keep being served.
"""

from __future__ import annotations

import time
from typing import Any

PAGES = 8


def chain_tier(backend: Any) -> Any:
    return backend.kv.components[0].chain.tiers[0]


def test_a_tier_serves_again_after_its_fault_clears(rig: Any, tier_fault: Any) -> None:
    pool = rig.pool(pages=4 * PAGES)
    backend = rig.backend(pool, [tier_fault.section])
    tier = chain_tier(backend)
    before = list(range(PAGES))
    rig.fill(pool, before, "before")
    stored = rig.page_hashes(PAGES, f"{tier_fault.name}-before")
    assert backend.batch_set_v1(stored, pool.indices(before)) == [True] * PAGES

    tier_fault.inject()
    recovery = float(tier.config.recovery_after)
    spare = list(range(PAGES, 2 * PAGES))
    rounds = 0
    seen: set[str] = set()
    ends = time.monotonic() + 3 * recovery + 1.0  # open, half-open, open again...
    while time.monotonic() < ends:  # SGLang's threads keep calling throughout
        rounds += 1
        new = rig.page_hashes(2, f"during{rounds}")
        assert backend.batch_set_v1(new, pool.indices(spare[:2])) == [False, False]
        held = backend.batch_exists(stored)
        got = backend.batch_get_v1(stored, pool.indices(spare))
        if tier_fault.keeps_reads:  # a disk that cannot write still serves
            assert held == PAGES and got == [True] * PAGES
            assert [pool.page_bytes(s) for s in spare] == [pool.page_bytes(b) for b in before]
        seen.add(tier.breaker("store").state.value)
        time.sleep(0.05)
    assert "open" in seen, f"the write breaker never opened (saw {seen})"
    if tier_fault.keeps_reads:
        assert tier.refresh_stats().serving == "read_only"

    tier_fault.clear()
    cleared = time.monotonic()
    after = list(range(2 * PAGES, 3 * PAGES))
    rig.fill(pool, after, "after")
    fresh = rig.page_hashes(PAGES, f"{tier_fault.name}-after")
    bound = recovery + backend.kv.components[0].chain.job_deadline + 1.0
    while True:  # as SGLang's threads call: exists (its prefetch) before each set
        backend.batch_exists(fresh)
        if backend.batch_set_v1(fresh, pool.indices(after)) == [True] * PAGES:
            break
        assert time.monotonic() - cleared < bound, (
            f"{tier_fault.name}: new pages still not stored {bound:.1f}s after the fault "
            f"cleared (breakers {tier.refresh_stats().read_breaker}/"
            f"{tier.refresh_stats().write_breaker})"
        )
        time.sleep(0.05)
    assert backend.batch_exists(fresh) == PAGES
    target = list(range(3 * PAGES, 4 * PAGES))
    assert backend.batch_get_v1(fresh, pool.indices(target)) == [True] * PAGES
    assert [pool.page_bytes(t) for t in target] == [pool.page_bytes(a) for a in after]
    assert tier.state == "closed" and tier.serving == "read_write"
    if tier_fault.keeps_reads:
        assert backend.batch_get_v1(stored, pool.indices(spare)) == [True] * PAGES
        assert [pool.page_bytes(s) for s in spare] == [pool.page_bytes(b) for b in before]


def test_a_tier_whose_directory_was_removed_counts_nothing_and_stores_again(rig: Any) -> None:
    """The nvme directory removed under a running server: the next exists counts none
    of the vanished pages (it counted 128 of 384 before), and the tier makes its
    directory again and stores into it."""
    import shutil

    pool = rig.pool(pages=3 * PAGES)
    backend = rig.backend(pool, [rig.nvme(job_timeout="1s")])
    rig.fill(pool, list(range(PAGES)), "gone")
    stored = rig.page_hashes(PAGES, "gone")
    assert backend.batch_set_v1(stored, pool.indices(list(range(PAGES)))) == [True] * PAGES
    shutil.rmtree(rig.tmp_path / "nvme")
    assert backend.batch_exists(stored) == 0
    again = list(range(PAGES, 2 * PAGES))
    rig.fill(pool, again, "again")
    assert backend.batch_set_v1(stored, pool.indices(again)) == [True] * PAGES
    target = list(range(2 * PAGES, 3 * PAGES))
    assert backend.batch_get_v1(stored, pool.indices(target)) == [True] * PAGES
    assert [pool.page_bytes(t) for t in target] == [pool.page_bytes(a) for a in again]
    assert chain_tier(backend).serving == "read_write"
