"""The run driver: every tier asked for opened first (an unreachable Redis fails the
run before anything is measured), then every medium, the streaming phase (when an
nvme tier is among the media asked for), the orchestrator's cost and the integrity
section, in one report. The report holds
measurements only: the project's own bounds (`targets.check_targets`) are not part of
what a user is shown."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from tierkv.bench.chain import check_reachable
from tierkv.bench.integrity import bench_integrity
from tierkv.bench.medium import bench_medium, raw_baseline_for
from tierkv.bench.options import BenchOptions, UnknownMedium
from tierkv.bench.orchestrator import bench_orchestrator
from tierkv.bench.raw import RawMemcpy
from tierkv.bench.streaming import bench_streaming
from tierkv.config import CacheConfig
from tierkv.contract.units import format_size
from tierkv.primary import MEDIUM as PRIMARY_MEDIUM


async def run_bench(
    chain: CacheConfig,
    options: BenchOptions,
    *,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure every medium of `chain` (or those named in `options.media`)."""
    say = progress or (lambda message: None)
    names = [PRIMARY_MEDIUM, *chain.tier_names()]
    wanted = list(options.media) if options.media else names
    unknown = [m for m in wanted if m not in names]
    if unknown:
        raise UnknownMedium(
            f"no medium named {', '.join(unknown)} in the chain; media: {', '.join(names)}"
        )
    await check_reachable(chain, wanted, say)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # block movers run with one torch thread (see LESSONS.md)
    try:
        return await _run_bench(chain, options, names, wanted, say)
    finally:
        torch.set_num_threads(threads)


async def _run_bench(
    chain: CacheConfig,
    options: BenchOptions,
    names: list[str],
    wanted: list[str],
    say: Callable[[str], None],
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(options.seed)
    n = options.num_blocks
    say(f"generating {format_size(n * options.block_bytes)} of random blocks")
    data = torch.randint(0, 256, (n, options.block_bytes), dtype=torch.uint8, generator=gen)
    started = time.perf_counter()
    results = []
    for medium, tier in zip(names, [None, *chain.tiers]):
        if medium not in wanted:
            continue
        raw = (
            RawMemcpy(n, options.block_bytes)
            if tier is None
            else raw_baseline_for(tier, options.block_bytes)
        )
        results.append(await bench_medium(chain, medium, tier, raw, data, options, say))
    streaming = await bench_streaming(chain, options, say, media=wanted)
    orchestrator = (
        await bench_orchestrator(chain, options, say) if options.orchestrator_keys else None
    )
    report = {
        "block_bytes": options.block_bytes,
        "total_bytes": n * options.block_bytes,
        "blocks": n,
        "batch": options.batch,
        "concurrency": options.concurrency,
        "repeat": options.repeat,
        "torch_threads": torch.get_num_threads(),  # during the bench
        "media": results,
        "streaming": streaming,
        "orchestrator": orchestrator,
        "integrity": bench_integrity(options.block_bytes),
        "elapsed_seconds": time.perf_counter() - started,
    }
    return report
