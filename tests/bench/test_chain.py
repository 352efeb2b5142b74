"""The chain a measurement runs on: `empty_primary` makes loads come from below."""

from __future__ import annotations

import pytest
import torch

from tierkv.bench import empty_primary
from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.keys import make_offload_key

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
