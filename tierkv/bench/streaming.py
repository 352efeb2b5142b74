"""Streaming through a small primary: one request much larger than the primary,
stored with one `store` call and loaded with one `load` call through the chain's
nvme tier, against the raw disk one file per block (the ratios) and one big file
(for reference); and the promotion against each of its stages alone."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from tierkv.bench.chain import bench_chain, bench_keys, empty_primary, written_through
from tierkv.bench.options import BenchFailure, BenchOptions
from tierkv.bench.raw_files import RawBlockFiles, RawFile
from tierkv.blocks import HostBlocks
from tierkv.cache import TieredCache
from tierkv.config import CacheConfig
from tierkv.contract.jobs import JobMetadata
from tierkv.contract.units import format_size


async def bench_streaming(
    chain: CacheConfig, options: BenchOptions, progress: Callable[[str], None]
) -> dict[str, Any] | None:
    """One request much larger than the primary (`streaming_blocks` blocks through a
    primary of `streaming_primary_blocks`), stored with one `store` call and loaded with
    one `load` call through the chain's nvme tier, against raw `pwrite`/`pread` of the
    same bytes at the tier's concurrency, one file per block as the tier stores them
    (`RawBlockFiles`: the ratios) and one big file (`RawFile`: for reference); wall
    time and CPU per block of each; and the promotion's wall time against each of
    its stages alone (stage 1: the tier's load jobs into primary slots, window by
    window; stage 2: the copies from the slots to the destination)."""
    tier = next((t for t in chain.tiers if t.type == "nvme"), None)
    n = options.streaming_blocks
    if tier is None or n == 0:
        return None
    block = options.block_bytes
    slots = options.streaming_primary_blocks
    run_tag = f"{os.getpid()}-{time.time_ns()}"
    config = bench_chain(
        chain,
        f"tierkv-bench-stream-{run_tag}",
        block,
        slots,
        [written_through(tier, slots * block)],
    )
    progress(f"streaming: {format_size(n * block)} through a {format_size(slots * block)} primary")
    gen = torch.Generator().manual_seed(options.seed + 1)
    data = torch.randint(0, 256, (n, block), dtype=torch.uint8, generator=gen)
    out = torch.zeros_like(data)
    raw = RawBlockFiles(tier, block)  # the baseline of the ratios: a file per block
    one_file = RawFile(tier, block)  # for reference: the same bytes in one big file
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "store",
            "load",
            "raw_store",
            "raw_load",
            "one_file_store",
            "one_file_load",
            "stage1",
            "stage2",
        )
    }
    cpu: dict[str, list[float]] = {k: [] for k in times if not k.startswith("stage")}
    windows = 0
    await raw.open()
    await one_file.open()
    try:
        for rep in range(options.repeat):
            for label, medium in (("raw", raw), ("one_file", one_file)):
                progress(f"streaming: repetition {rep + 1}/{options.repeat}, {label}")
                t0, c0 = time.perf_counter(), time.process_time()
                await medium.store(data, (0, n))
                times[f"{label}_store"].append(time.perf_counter() - t0)
                cpu[f"{label}_store"].append(time.process_time() - c0)
                await medium.before_load(None)
                t0, c0 = time.perf_counter(), time.process_time()
                await medium.load(out, (0, n))
                times[f"{label}_load"].append(time.perf_counter() - t0)
                cpu[f"{label}_load"].append(time.process_time() - c0)
                if not torch.equal(out, data):
                    raise BenchFailure(f"streaming ({label}): blocks read back differ")
                out.zero_()
                await medium.cleanup(n)
            progress(f"streaming: repetition {rep + 1}/{options.repeat}, tierkv")
            keys = bench_keys(n, f"s{rep}-{run_tag}")
            async with TieredCache(config) as cache:
                cache.primary.view.tensor.zero_()
                name = cache.tier_names[0]
                t0, c0 = time.perf_counter(), time.process_time()
                stored = await cache.store(keys, data)
                await cache.flush()
                times["store"].append(time.perf_counter() - t0)
                cpu["store"].append(time.process_time() - c0)
                if not stored.ok:
                    raise BenchFailure(f"streaming: {len(stored.rejected)} blocks rejected")
                empty_primary(cache)
                await raw.before_load(cache.tier(name))
                t0, c0 = time.perf_counter(), time.process_time()
                loaded = await cache.load(keys, out)
                times["load"].append(time.perf_counter() - t0)
                cpu["load"].append(time.process_time() - c0)
                if not loaded.ok or not torch.equal(out, data):
                    raise BenchFailure(
                        f"streaming: {len(loaded.failed_keys)} blocks failed to load"
                        if not loaded.ok
                        else "streaming: blocks loaded back differ"
                    )
                out.zero_()
                # each stage alone, over the same windows the promotion used
                window = max(1, cache.primary.promotion_share // 2)
                windows = -(-n // window)
                empty_primary(cache)
                await raw.before_load(cache.tier(name))
                nvme = cache.tier(name)
                dest = HostBlocks(out, block, writable=True)
                stage1 = stage2 = 0.0
                for a in range(0, n, window):
                    ks = tuple(keys[a : a + window])
                    rows = list(range(len(ks)))
                    t0 = time.perf_counter()
                    result = await nvme.load(JobMetadata(a + 1, ks, tuple(rows)))
                    stage1 += time.perf_counter() - t0
                    if not result.ok:
                        raise BenchFailure(f"streaming: stage 1 alone failed: {result.error}")
                    t0 = time.perf_counter()
                    await dest.copy_from_slots(
                        cache.primary.view, list(range(a, a + len(ks))), rows
                    )
                    stage2 += time.perf_counter() - t0
                if not torch.equal(out, data):
                    raise BenchFailure("streaming: stages alone read back different blocks")
                out.zero_()
                times["stage1"].append(stage1)
                times["stage2"].append(stage2)
                await nvme.remove(keys)
    finally:
        await raw.close()
        await one_file.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    nbytes = n * block
    return {
        "request_bytes": nbytes,
        "primary_bytes": slots * block,
        "blocks": n,
        "windows": windows,
        "baseline": raw.description,
        "one_file_baseline": one_file.description,
        **{f"{k}_seconds": v for k, v in med.items()},
        **{f"{k}_spread_seconds": [min(v), max(v)] for k, v in times.items()},
        # CPU seconds of this process (all threads) per block: steadier than wall time
        # on a shared machine, and what a busy server pays
        **{f"{k}_cpu_us_per_block": statistics.median(v) / n * 1e6 for k, v in cpu.items()},
        "store_MBps": nbytes / med["store"] / 1e6,
        "load_MBps": nbytes / med["load"] / 1e6,
        "raw_store_MBps": nbytes / med["raw_store"] / 1e6,
        "raw_load_MBps": nbytes / med["raw_load"] / 1e6,
        "one_file_store_MBps": nbytes / med["one_file_store"] / 1e6,
        "one_file_load_MBps": nbytes / med["one_file_load"] / 1e6,
        "store_ratio": med["raw_store"] / med["store"],
        "load_ratio": med["raw_load"] / med["load"],
        "one_file_store_ratio": med["one_file_store"] / med["store"],
        "one_file_load_ratio": med["one_file_load"] / med["load"],
        "promotion_vs_slower_stage": med["load"] / max(med["stage1"], med["stage2"]),
    }
