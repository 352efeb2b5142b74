"""The chain a measurement runs on: `empty_primary` makes loads come from below;
`bench_keys` look like an engine's block hashes."""

from __future__ import annotations

import pytest
import torch

from tierkv.bench import empty_primary
from tierkv.bench.chain import bench_keys
from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.keys import make_offload_key

pytestmark = pytest.mark.anyio


async def test_empty_primary_evicts_every_idle_block() -> None:
    config = parse_config(
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 32KiB, pin_memory: false}\n"
    )
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(6)]
    async with TieredCache(config) as cache:
        await cache.store(keys, torch.zeros(6, 4096, dtype=torch.uint8))
        assert empty_primary(cache) == 6
        assert len(cache.primary) == 0 and cache.primary.num_free == 8


def test_bench_keys_are_distinct_repeatable_and_spread_like_block_hashes() -> None:
    keys = bench_keys(4096, "0-1234-5678")
    assert len(set(keys)) == 4096
    assert bench_keys(4096, "0-1234-5678") == keys
    assert not set(keys) & set(bench_keys(4096, "1-1234-5678"))
    # an nvme tier files a block under its key's first byte: every one of the 256
    # directories gets some (a shared prefix once put a whole run into one)
    assert len({key[0] for key in keys}) == 256
