"""The cache-wide counters: one dataclass the parts increment, that `stats()` reports
under the same names (and in the same order as before it was a dataclass), and that
the metrics and the trace replay read by field."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from tierkv.cache import TieredCache
from tierkv.cache.counters import CacheCounters
from tierkv.config import parse_config
from tierkv.contract.keys import hash_token_blocks, make_offload_key

pytestmark = pytest.mark.anyio

CHAIN = """
namespace: counters
layout: {block_bytes: 4KiB, groups: [{block_size: 16}]}
primary: {capacity: 16KiB, pin_memory: false}
tiers: []
"""

# the keys stats().primary had when the counters were a dict (7 made by the core, then
# the 4 the prefetcher added): dashboards and the trace replay read these names
BEFORE = [
    "store_rejected",
    "store_waits",
    "write_back_dropped",
    "promotions_shed",
    "promotion_waits",
    "load_fallbacks",
    "store_skipped",
    "prefetched_blocks",
    "prefetch_used",
    "prefetch_cancelled",
    "prefetch_shed",
]


def test_the_fields_are_the_counters_stats_reported_before() -> None:
    counters = CacheCounters()
    assert [f.name for f in fields(counters)] == BEFORE
    assert counters.as_dict() == dict.fromkeys(BEFORE, 0)
    counters.store_waits += 2
    assert counters.as_dict()["store_waits"] == 2


def test_every_counter_has_a_metric_name_and_help() -> None:
    from tierkv.metrics import CACHE_COUNTERS

    named = CacheCounters.metrics()
    assert list(named) == BEFORE
    for field, (metric, doc) in named.items():
        assert CACHE_COUNTERS[field] == (metric, doc)
        assert metric and not metric.startswith("tierkv_") and doc[0].isupper()


def test_the_replay_reads_prefetch_counters_that_exist() -> None:
    from tierkv.trace.replay import PREFETCH_COUNTERS

    assert set(PREFETCH_COUNTERS) <= {f.name for f in fields(CacheCounters)}


async def test_stats_report_the_counters_by_name_with_their_values() -> None:
    keys = [
        make_offload_key(h, 0)
        for h in hash_token_blocks(list(range(16 * 6)), 16, namespace="counters")
    ]
    async with TieredCache(parse_config(CHAIN)) as cache:
        result = await cache.store(keys, torch.zeros(6, 4096, dtype=torch.uint8))
        primary = cache.stats().primary
        counters = cache.core.counters
    assert len(result.rejected) == 2  # 4 blocks fit, no tier to stream the rest to
    assert counters.store_rejected == 2
    assert {k: primary[k] for k in BEFORE} == counters.as_dict()
    # the counters sit together in stats().primary, in field order
    names = list(primary)
    assert names[names.index(BEFORE[0]) :][: len(BEFORE)] == BEFORE
