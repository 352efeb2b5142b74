"""The orchestrator's own cost: keys per second of store, lookup (hit and miss) and
load bookkeeping over a primary filled to the brim with tiny blocks, behind a tier
that never receives one, so no I/O and no copies run."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from tierkv.bench.admission import bench_admission
from tierkv.bench.bookkeeping import NoCopy, bench_bookkeeping
from tierkv.bench.chain import bench_chain, bench_keys
from tierkv.bench.options import BenchOptions
from tierkv.cache import TieredCache
from tierkv.config import CacheConfig
from tierkv.contract.keys import OffloadKey
from tierkv.memory_tier import MemoryTierConfig


async def bench_orchestrator(
    chain: CacheConfig, options: BenchOptions, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Keys per second of store, lookup (hit and miss) and load bookkeeping over a
    primary filled with `orchestrator_keys` keys, with no I/O and no copies.

    The fill is the store measurement (one sample per `repeat`-th of it); each
    repetition then times lookups of resident and of unknown keys, and loads, over a
    sample of the keys."""
    n = options.orchestrator_keys
    per_call = options.lookup_batch
    block_bytes = 64
    never_cascaded = MemoryTierConfig.model_validate(
        {"type": "memory", "write_policy": "write_through_selective", "min_hits": 2**31}
    )
    config = bench_chain(
        chain,
        f"tierkv-bench-orchestrator-{os.getpid()}",
        block_bytes,
        n,
        [never_cascaded],
        pin_memory=False,
    )
    progress(f"orchestrator: making {n:,} keys")
    keys = bench_keys(n, "orch")
    async with TieredCache(config) as cache:
        rates = {"store": await _fill(cache, keys, options, progress)}
        cache.take_events()
        rates.update(await _lookups_and_loads(cache, keys, options, progress))
        bookkeeping = await bench_bookkeeping(cache, keys, block_bytes, options, progress)
        resident = len(cache.primary)
    admission = bench_admission(options.repeat, progress=progress)
    return {
        "resident_keys": resident,
        "keys_per_call": per_call,
        **bookkeeping,
        "admission_us_per_block": admission,
        **{f"{name}_keys_per_s": statistics.median(values) for name, values in rates.items()},
        **{
            f"{name}_calls_per_s": statistics.median(values) / per_call
            for name, values in rates.items()
        },
    }


def _calls(
    pool: list[OffloadKey], start: int, end: int, per_call: int
) -> Iterator[list[OffloadKey]]:
    """`pool[start:end]` in calls of `per_call` keys."""
    for i in range(start, end, per_call):
        yield pool[i : min(end, i + per_call)]


async def _fill(
    cache: TieredCache,
    keys: list[OffloadKey],
    options: BenchOptions,
    progress: Callable[[str], None],
) -> list[float]:
    """Store every key, in `repeat` segments: the keys per second of each segment."""
    n = len(keys)
    rates = []
    segment = -(-n // options.repeat)
    for first in range(0, n, segment):
        progress(f"orchestrator: storing keys {first:,}..{min(n, first + segment):,}")
        t0 = time.perf_counter()
        done = 0
        for chunk in _calls(keys, first, first + segment, options.lookup_batch):
            await cache.store(chunk, NoCopy(len(chunk)))
            done += len(chunk)
        if done:
            rates.append(done / (time.perf_counter() - t0))
    return rates


async def _lookups_and_loads(
    cache: TieredCache,
    keys: list[OffloadKey],
    options: BenchOptions,
    progress: Callable[[str], None],
) -> dict[str, list[float]]:
    """Keys per second, once per repetition, of lookups of resident keys, of lookups
    of unknown keys (which ask the tier), and of loads, over a sample of the keys."""
    sample = min(len(keys), 1 << 16)  # keys per timed lookup/load pass
    unknown = bench_keys(sample, "miss")
    rates: dict[str, list[float]] = {"lookup_hit": [], "lookup_miss": [], "load": []}
    for rep in range(options.repeat):
        progress(f"orchestrator: lookups and loads, repetition {rep + 1}/{options.repeat}")
        for name, pool in (("lookup_hit", keys), ("lookup_miss", unknown), ("load", keys)):
            t0 = time.perf_counter()
            done = 0
            for chunk in _calls(pool, 0, sample, options.lookup_batch):
                if name == "load":
                    await cache.load(chunk, NoCopy(len(chunk)))
                else:
                    await cache.lookup([chunk])
                done += len(chunk)
            rates[name].append(done / (time.perf_counter() - t0))
    return rates
