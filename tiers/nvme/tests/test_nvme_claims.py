"""Claims on a real disk: under a `TieredCache`, a block lookup reported in the nvme
tier is still there when the request loads it, though a store's cascade filled the
tier in between (the race a trace replay found: "not in the nvme tier")."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tierkv_nvme import disk_footprint

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.framing import header_bytes
from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key

pytestmark = pytest.mark.anyio

BLOCK = 1024


def keys(n: int, tag: str) -> list[OffloadKey]:
    return [
        make_offload_key(h, 0) for h in hash_token_blocks(list(range(16 * n)), 16, namespace=tag)
    ]


def blocks(n: int, seed: int) -> list[bytes]:
    return [bytes([seed + i]) * BLOCK for i in range(n)]


def cache_over_nvme(path: Path, capacity_blocks: int, lease: float) -> TieredCache:
    """A 4-block primary over an nvme tier of `capacity_blocks` files on `path`."""
    path.mkdir(parents=True, exist_ok=True)
    fs_block = os.statvfs(path).f_frsize or 4096
    footprint = disk_footprint(header_bytes(keys(1, "x")[0]) + BLOCK, fs_block)
    tier = {
        "type": "nvme",
        "layout": "files",
        "path": str(path),
        "capacity": capacity_blocks * footprint,
        "fsync": "never",
        "claim_lease": lease,
    }
    return TieredCache(
        parse_config(
            {
                "namespace": "nvme-claims",
                "layout": {"block_bytes": BLOCK, "groups": [{"block_size": 16}]},
                "primary": {"capacity": 4 * BLOCK, "pin_memory": False},
                "tiers": [tier],
            }
        )
    )


@pytest.mark.parametrize("lease", [10.0, 0.0])
async def test_a_claimed_hit_on_disk_survives_a_store_that_fills_the_tier(
    tmp_path: Path, lease: float
) -> None:
    """lookup -> store (its cascade evicts the tier's least recently used: the claimed
    blocks) -> load: with claims every block loads from the files, byte for byte;
    with `claim_lease: 0` the same sequence loses them."""
    async with cache_over_nvme(tmp_path / "nvme", 6, lease) as cache:
        a, a_data = keys(2, "a"), blocks(2, 1)
        await cache.store(a, a_data)
        await cache.flush()
        await cache.store(keys(4, "c"), blocks(4, 10))  # the tier is full, `a` its oldest
        await cache.flush()
        ctx = ReqContext(request_id="r1")
        hit = await cache.lookup([a], ctx)
        assert dict(hit.locations) == dict.fromkeys(a, "nvme")
        await cache.store(keys(2, "b"), blocks(2, 20))
        await cache.flush()
        out = [bytearray(BLOCK) for _ in a]
        result = await cache.load(hit.keys_to_load, out, ctx)
        stats = cache.stats().tiers["nvme"]
        if lease:
            assert result.ok, result.errors
            assert [bytes(b) for b in out] == a_data
            assert (stats["protected"], stats["claims_held"], stats["lease_expired"]) == (2, 0, 0)
            assert stats["blocks_stored"] == 8  # the store evicted two unclaimed blocks
        else:
            assert set(result.failed_keys) == set(a)  # evicted: the hit is lost
