"""A page `batch_exists` reported is still there when SGLang's prefetch reads it:
each exists call claims its hits in their tier until the load of those pages ends,
or the tier's `claim_lease` runs out (`tierkv.integrations.sglang.claims`)."""

from __future__ import annotations

import time
from typing import Any

import pytest

PAGES = 4


def memory(pages: int, **fields: Any) -> dict[str, Any]:
    """A memory tier holding exactly `pages` stand-in pages (two 8 KiB regions each,
    framed a few dozen bytes larger)."""
    return {"type": "memory", "capacity": 2 * pages * 8300, **fields}


def tier_claims(backend: Any) -> Any:
    (component,) = backend.kv.components
    (tier,) = component.chain.tiers
    return tier.tier.claims


def settled(backend: Any, held: int, timeout: float = 5.0) -> bool:
    """The tier's claims come to `held` (let go on the loop thread, soon)."""
    claims = tier_claims(backend)
    deadline = time.monotonic() + timeout
    while len(claims) != held:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("lease", ["10s", 0], ids=["claimed", "lease 0: no claims"])
def test_pages_exists_reported_survive_stores_until_their_get(rig: Any, lease: Any) -> None:
    pool = rig.pool(pages=4 * PAGES)
    backend = rig.backend(pool, [memory(2 * PAGES, claim_lease=lease)])
    old, newer, newest = (rig.page_hashes(PAGES, salt) for salt in ("old", "newer", "newest"))
    rig.fill(pool, list(range(3 * PAGES)), "v")
    for i, hashes in enumerate((old, newer)):  # the tier is full after these
        pages = list(range(i * PAGES, (i + 1) * PAGES))
        assert backend.batch_set_v1(hashes, pool.indices(pages)) == [True] * PAGES
    assert backend.batch_exists(old) == PAGES
    pages = list(range(2 * PAGES, 3 * PAGES))
    backend.batch_set_v1(newest, pool.indices(pages))  # must evict PAGES pages
    target = list(range(3 * PAGES, 4 * PAGES))
    got = backend.batch_get_v1(old, pool.indices(target))
    if lease:
        assert got == [True] * PAGES, "a claimed page was evicted before its get"
        for src, dst in zip(range(PAGES), target):
            assert pool.page_bytes(dst) == pool.page_bytes(src)
        assert backend.batch_exists(newer) == 0, "the unclaimed pages went instead"
        assert settled(backend, 0), "the get let its claims go"
        assert len(backend.kv._claims) == 0
    else:
        assert got != [True] * PAGES


def test_pages_past_the_hit_are_let_go_at_once(rig: Any) -> None:
    """SGLang fetches only the leading pages `batch_exists` counts: claims on pages
    found after the first missing one end right away, not with the lease."""
    pool = rig.pool(pages=2 * PAGES)
    backend = rig.backend(pool, [memory(4 * PAGES)])
    hashes = rig.page_hashes(PAGES)
    kept = [0, 1, 3]  # page 2 missing: the hit is 2 pages
    backend.batch_set_v1([hashes[i] for i in kept], pool.indices(kept))
    assert backend.batch_exists(hashes) == 2
    assert settled(backend, 2 * backend.kv.key_parts), "the two pages found stay claimed"
    backend.batch_get_v1(hashes[:2], pool.indices([4, 5]))
    assert settled(backend, 0)
