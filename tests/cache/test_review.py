"""Adversarial review of the cache core (issue 10 follow-up): each test is a defect a
server would meet, found by review, written before its fix."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.testing import FaultyTier

pytestmark = pytest.mark.anyio

BLOCK = 1024


def keys(n: int, tag: str = "k") -> list[OffloadKey]:
    return [
        make_offload_key(h, 0) for h in hash_token_blocks(list(range(16 * n)), 16, namespace=tag)
    ]


def data(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, BLOCK), dtype=torch.uint8, generator=g)


def chain(tiers: list[dict[str, Any]], blocks: int = 8, **top: Any) -> dict[str, Any]:
    return {
        "namespace": "review",
        "layout": {"block_bytes": BLOCK, "groups": [{"block_size": 16}]},
        "primary": {"capacity": blocks * BLOCK, "pin_memory": False},
        "tiers": tiers,
        **top,
    }


def assert_idle(cache: TieredCache) -> None:
    """Nothing pinned, nothing leaked: every slot is free or evictable."""
    p = cache.primary
    assert p.num_free + p.num_evictable == p.num_blocks
    assert all(p.readers(k) == 0 and p.is_ready(k) for k in list(p._blocks))
    assert cache.core.promoting == 0
    assert cache.core.index.promoting == 0


async def test_a_load_still_promoting_when_close_begins_ends_with_failed_keys(
    faulty_tier_type: str,
) -> None:
    """A load whose later windows start after close() began must not raise out of the
    cache nor leave flights (or the promotion count) behind for a reopened cache."""
    cache = TieredCache(parse_config(chain([{"type": "faulty"}], close_timeout=5)))
    await cache.open()
    tier = cache.tier("faulty")
    assert isinstance(tier, FaultyTier)
    ks, blocks = keys(16), data(16)
    assert (await cache.store(ks, blocks)).ok
    await cache.flush()
    assert (await cache.store(keys(8, "filler"), data(8, 1))).ok  # push ks out
    await cache.flush()
    assert not any(k in cache.primary for k in ks)
    tier.gate = anyio.Event()
    out = torch.zeros(16, BLOCK, dtype=torch.uint8)
    results: list[Any] = []

    async def load() -> None:
        try:
            results.append(await cache.load(ks, out))
        except Exception as exc:  # the defect: TierUnavailable out of a running load
            results.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(load)
        await anyio.wait_all_tasks_blocked()
        assert cache.core.promoting > 0  # the first windows wait on the tier
        tg.start_soon(cache.close)
        await anyio.wait_all_tasks_blocked()
        tier.gate.set()
    (result,) = results
    assert not isinstance(result, Exception), result
    ok = set(result.ok_keys)
    assert ok | set(result.failed_keys) == set(ks)
    for i, k in enumerate(ks):
        if k in ok:
            assert torch.equal(out[i], blocks[i])
    assert_idle(cache)
    await cache.open()  # a reopened cache must not wait on flights of the old one
    try:
        tier.gate = None
        assert all(cache.core.index.flight(k) is None for k in ks)
        with anyio.fail_after(5):
            again = await cache.load(ks, torch.zeros(16, BLOCK, dtype=torch.uint8))
        assert set(again.ok_keys) | set(again.failed_keys) == set(ks)
        assert_idle(cache)
    finally:
        await cache.close()
