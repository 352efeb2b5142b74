"""One medium of the chain measured on its own: tierkv's store then load against the
raw medium's (the baseline chosen per tier type: `RAW_BASELINES`), alternating sides
per repetition, every block checked."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from tierkv.bench.chain import bench_config, bench_keys, empty_primary
from tierkv.bench.options import BenchFailure, BenchOptions
from tierkv.bench.raw import RawMedium
from tierkv.bench.raw_files import RawFile
from tierkv.bench.raw_remote import RawMooncake, RawRedis, RawS3
from tierkv.bench.timing import Batch, Timing, drive, split_batches, summarize
from tierkv.cache import TieredCache
from tierkv.config import CacheConfig
from tierkv.contract.keys import OffloadKey
from tierkv.contract.tier import TierConfig

RAW_BASELINES: dict[str, Callable[[TierConfig, int], RawMedium]] = {
    "nvme": lambda tier, block_bytes: RawFile(tier, block_bytes),
    "redis": lambda tier, block_bytes: RawRedis(tier),
    "s3": lambda tier, block_bytes: RawS3(tier),
    "mooncake": lambda tier, block_bytes: RawMooncake(tier, block_bytes),
}
"""Raw client per tier type; a tier type not listed is measured without a ratio."""


def raw_baseline_for(tier: TierConfig, block_bytes: int) -> RawMedium | None:
    if tier.type == "redis" and getattr(tier, "cluster", False):
        return None  # a cluster needs the cluster client; no like-for-like baseline
    make = RAW_BASELINES.get(tier.type)
    return make(tier, block_bytes) if make else None


async def bench_medium(
    chain: CacheConfig,
    medium: str,
    tier: TierConfig | None,
    raw: RawMedium | None,
    data: torch.Tensor,
    options: BenchOptions,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    n = options.num_blocks
    batches = split_batches(n, options.batch)
    out = torch.zeros_like(data)
    timings: dict[tuple[str, str], list[Timing]] = {
        (side, phase): [] for side in ("tierkv", "raw") for phase in ("store", "load")
    }
    run_tag = f"{os.getpid()}-{time.time_ns()}"
    described: dict[str, Any] = {}  # the tier's `describe()`, from its first run
    if raw is not None:
        await raw.open()
    try:
        for rep in range(options.repeat):
            sides = ["tierkv", "raw"] if rep % 2 == 0 else ["raw", "tierkv"]
            for side in sides:
                if side == "raw" and raw is None:
                    continue
                progress(f"{medium}: repetition {rep + 1}/{options.repeat}, {side}")
                if side == "raw":
                    assert raw is not None
                    store, load = await _raw_rep(raw, data, out, batches, options)
                else:
                    config = bench_config(chain, tier, options, f"tierkv-bench-{run_tag}")
                    keys = bench_keys(n, f"{rep}-{run_tag}")
                    store, load = await _tierkv_rep(
                        config, medium, raw, keys, data, out, batches, options, described
                    )
                if not torch.equal(out, data):
                    raise BenchFailure(f"{medium} ({side}): blocks read back differ")
                out.zero_()
                timings[side, "store"].append(store)
                timings[side, "load"].append(load)
    finally:
        if raw is not None:
            await raw.close()

    nbytes = n * options.block_bytes
    engine = described.get("io_engine")
    if engine and described.get("core_queue"):  # the nvme slab's calls on the core's threads
        engine = f"{engine} (core queue)"
    if engine and described.get("direct"):  # the nvme slab's `direct: true`, in use
        engine = f"{engine}, O_DIRECT"
    result: dict[str, Any] = {
        "medium": medium,
        "type": "primary" if tier is None else tier.type,
        "baseline": raw.description if raw is not None else None,
        "io_engine": engine,  # what moved a file tier's bytes
    }
    for phase in ("store", "load"):
        mine = summarize(nbytes, timings["tierkv", phase])
        entry: dict[str, Any] = {"tierkv": mine, "raw": None, "ratio": None}
        if raw is not None:
            theirs = summarize(nbytes, timings["raw", phase])
            entry["raw"] = theirs
            entry["ratio"] = mine["MBps"] / theirs["MBps"]
        result[phase] = entry
    return result


async def _raw_rep(
    raw: RawMedium,
    data: torch.Tensor,
    out: torch.Tensor,
    batches: list[Batch],
    options: BenchOptions,
) -> tuple[Timing, Timing]:
    store = Timing.of(
        *await drive(batches, options.concurrency, lambda a, b: raw.store(data, (a, b)))
    )
    await raw.before_load(None)
    load = Timing.of(*await drive(batches, options.concurrency, lambda a, b: raw.load(out, (a, b))))
    await raw.cleanup(options.num_blocks)
    return store, load


async def _tierkv_rep(
    config: CacheConfig,
    medium: str,
    raw: RawMedium | None,
    keys: list[OffloadKey],
    data: torch.Tensor,
    out: torch.Tensor,
    batches: list[Batch],
    options: BenchOptions,
    described: dict[str, Any],
) -> tuple[Timing, Timing]:
    """Store then load every block through a freshly opened cache; the tier's
    `describe()` into `described`."""
    n = options.num_blocks
    async with TieredCache(config) as cache:
        cache.primary.view.tensor.zero_()  # fault the slab's pages in before timing
        tier_name = cache.tier_names[0] if cache.tier_names else None
        if tier_name is not None:
            described.update(cache.tier(tier_name).describe())
        rejected = 0

        async def store_batch(a: int, b: int) -> None:
            nonlocal rejected
            result = await cache.store(keys[a:b], data[a:b])
            rejected += len(result.rejected)

        t0 = time.perf_counter()
        _, latencies = await drive(batches, options.concurrency, store_batch)
        await cache.flush()
        store = Timing.of(time.perf_counter() - t0, latencies)
        if rejected:
            raise BenchFailure(f"{medium}: the primary rejected {rejected} blocks")
        if tier_name is not None:
            tstats = cache.stats().tiers[tier_name]
            if tstats["blocks_stored"] != n:
                raise BenchFailure(
                    f"{medium}: {tstats['blocks_stored']} of {n} blocks reached the tier "
                    f"({tstats['failed_keys']} failed, {tstats['drops']} dropped, "
                    f"{tstats['errors']} errors)"
                )
            # a store call returns once its blocks are in the primary: the latency
            # that matters is the tier's job (one per call), from the fresh cache's stats
            jobs = tstats["job_latency"]
            store = Timing(store.seconds, jobs["p50_ms"] / 1e3, jobs["p99_ms"] / 1e3)
            empty_primary(cache)
            if raw is not None:
                await raw.before_load(cache.tier(tier_name))
        failures: list[str] = []

        async def load_batch(a: int, b: int) -> None:
            result = await cache.load(keys[a:b], out[a:b])
            if not result.ok:
                failures.extend(result.errors.values())
            elif tier_name is not None and set(result.sources.values()) != {tier_name}:
                failures.append(f"served from {sorted(set(result.sources.values()))}")

        load = Timing.of(*await drive(batches, options.concurrency, load_batch))
        if failures:
            raise BenchFailure(f"{medium}: {len(failures)} blocks failed to load: {failures[0]}")
        if tier_name is not None:
            empty_primary(cache)
            await cache.tier(tier_name).remove(keys)
    return store, load
