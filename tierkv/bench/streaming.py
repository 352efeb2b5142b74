"""Streaming through a small primary: one request much larger than the primary,
stored with one `store` call and loaded with one `load` call through the chain's
nvme tier, against the raw disk one file per block (the ratios) and one big file
(for reference); and the promotion against each of its stages alone."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from tierkv.bench.chain import bench_chain, bench_keys, empty_primary, written_through
from tierkv.bench.options import BenchFailure, BenchOptions
from tierkv.bench.raw import RawMedium
from tierkv.bench.raw_files import NativeReference, RawBlockFiles, RawFile
from tierkv.blocks import HostBlocks
from tierkv.cache import TieredCache
from tierkv.config import CacheConfig
from tierkv.contract.jobs import JobMetadata
from tierkv.contract.keys import OffloadKey
from tierkv.contract.units import format_size


async def bench_streaming(
    chain: CacheConfig,
    options: BenchOptions,
    progress: Callable[[str], None],
    *,
    media: Collection[str] | None = None,
) -> dict[str, Any] | None:
    """One request much larger than the primary (`streaming_blocks` blocks through a
    primary of `streaming_primary_blocks`), stored with one `store` call and loaded with
    one `load` call through the chain's nvme tier, against raw `pwrite`/`pread` of the
    same bytes at the tier's concurrency, one file per block as the tier stores them
    (`RawBlockFiles`: the ratios) and one big file (`RawFile`: for reference); wall
    time and CPU per block of each; and the promotion's wall time against each of
    its stages alone (stage 1: the tier's load jobs into primary slots, window by
    window; stage 2: the copies from the slots to the destination). The first nvme
    tier named in `media` (every medium when None) is used; None when there is none."""
    tier = next(
        (
            t
            for name, t in zip(chain.tier_names(), chain.tiers)
            if t.type == "nvme" and (media is None or name in media)
        ),
        None,
    )
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
    run = _StreamingRun(
        torch.randint(0, 256, (n, block), dtype=torch.uint8, generator=gen),
        raw=RawBlockFiles(tier, block),  # the baseline of the ratios: a file per block
        one_file=RawFile(tier, block),  # for reference: the same bytes in one big file
        native=NativeReference(tier, block, min(2, _cpus())),  # the same files in C
    )
    await run.raw.open()
    await run.one_file.open()
    try:
        for rep in range(options.repeat):
            for label, medium in (("raw", run.raw), ("one_file", run.one_file)):
                progress(f"streaming: repetition {rep + 1}/{options.repeat}, {label}")
                await run.raw_pass(label, medium)
            if run.native.available:
                progress(f"streaming: repetition {rep + 1}/{options.repeat}, native reference")
                await run.native_pass()
            progress(f"streaming: repetition {rep + 1}/{options.repeat}, tierkv")
            keys = bench_keys(n, f"s{rep}-{run_tag}")
            async with TieredCache(config) as cache:
                await run.tierkv_pass(cache, keys)
                await run.stages_alone(cache, keys)
    finally:
        await run.raw.close()
        await run.one_file.close()
    return run.report(slots * block)


_MEASURED = (
    "store",
    "load",
    "raw_store",
    "raw_load",
    "one_file_store",
    "one_file_load",
    "native_store",
    "native_load",
    "stage1",
    "stage2",
)
"""What the streaming phase times, in the report's order; every one but the stages
also in CPU time."""


@dataclass
class _StreamingRun:
    """One streaming phase: the request's bytes, the buffer each load reads back into
    (checked against them, then zeroed), the two raw media, and the wall and CPU
    seconds of every repetition so far."""

    data: torch.Tensor
    raw: RawBlockFiles
    one_file: RawFile
    native: NativeReference
    times: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in _MEASURED})
    cpu: dict[str, list[float]] = field(
        default_factory=lambda: {k: [] for k in _MEASURED if not k.startswith("stage")}
    )
    windows: int = 0  # the promotion's windows in the last repetition
    out: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.out = torch.zeros_like(self.data)

    @property
    def blocks(self) -> int:
        return self.data.shape[0]

    @property
    def block_bytes(self) -> int:
        return self.data.shape[1]

    @contextmanager
    def timed(self, key: str) -> Iterator[None]:
        """Record the wall and CPU seconds of the block under `key` (not when it raises)."""
        t0, c0 = time.perf_counter(), time.process_time()
        yield
        self.times[key].append(time.perf_counter() - t0)
        self.cpu[key].append(time.process_time() - c0)

    async def raw_pass(self, label: str, medium: RawMedium) -> None:
        """Store the request to a raw medium and load it back, each timed."""
        n = self.blocks
        with self.timed(f"{label}_store"):
            await medium.store(self.data, (0, n))
        await medium.before_load(None)
        with self.timed(f"{label}_load"):
            await medium.load(self.out, (0, n))
        if not torch.equal(self.out, self.data):
            raise BenchFailure(f"streaming ({label}): blocks read back differ")
        self.out.zero_()
        await medium.cleanup(n)

    async def native_pass(self) -> None:
        """The native reference: the same number of files of the same size, plain C."""
        (ws, wc), (rs, rc) = await self.native.run(self.blocks)
        self.times["native_store"].append(ws)
        self.cpu["native_store"].append(wc)
        self.times["native_load"].append(rs)
        self.cpu["native_load"].append(rc)

    async def tierkv_pass(self, cache: TieredCache, keys: list[OffloadKey]) -> None:
        """Store the request with one `store` call (and the flush that writes it
        through), empty the primary, and load it back with one `load` call, each timed."""
        cache.primary.view.tensor.zero_()
        name = cache.tier_names[0]
        with self.timed("store"):
            stored = await cache.store(keys, self.data)
            await cache.flush()
        if not stored.ok:
            raise BenchFailure(f"streaming: {len(stored.rejected)} blocks rejected")
        empty_primary(cache)
        await self.raw.before_load(cache.tier(name))
        with self.timed("load"):
            loaded = await cache.load(keys, self.out)
        if not loaded.ok or not torch.equal(self.out, self.data):
            raise BenchFailure(
                f"streaming: {len(loaded.failed_keys)} blocks failed to load"
                if not loaded.ok
                else "streaming: blocks loaded back differ"
            )
        self.out.zero_()

    async def stages_alone(self, cache: TieredCache, keys: list[OffloadKey]) -> None:
        """Each stage of the promotion alone, over the same windows the promotion used:
        the tier's load jobs into primary slots (stage 1), then the copies from the
        slots to the destination (stage 2); then the tier forgets the keys."""
        n = self.blocks
        window = max(1, cache.primary.promotion_share // 2)
        self.windows = -(-n // window)
        empty_primary(cache)
        name = cache.tier_names[0]
        await self.raw.before_load(cache.tier(name))
        nvme = cache.tier(name)
        dest = HostBlocks(self.out, self.block_bytes, writable=True)
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
            await dest.copy_from_slots(cache.primary.view, list(range(a, a + len(ks))), rows)
            stage2 += time.perf_counter() - t0
        if not torch.equal(self.out, self.data):
            raise BenchFailure("streaming: stages alone read back different blocks")
        self.out.zero_()
        self.times["stage1"].append(stage1)
        self.times["stage2"].append(stage2)
        await nvme.remove(keys)

    def report(self, primary_bytes: int) -> dict[str, Any]:
        """The medians (and spreads) of every measurement, rates and ratios."""
        n = self.blocks
        times, cpu = self.times, self.cpu
        med = {k: statistics.median(v) for k, v in times.items() if v}
        nbytes = n * self.block_bytes
        native: dict[str, Any] = {"native_baseline": self.native.description}
        if "native_store" in med:
            native |= {
                "native_store_MBps": nbytes / med["native_store"] / 1e6,
                "native_load_MBps": nbytes / med["native_load"] / 1e6,
                "native_store_ratio": med["native_store"] / med["store"],
                "native_load_ratio": med["native_load"] / med["load"],
            }
        else:
            native["native_missing"] = self.native.reason
        return {
            **native,
            "request_bytes": nbytes,
            "primary_bytes": primary_bytes,
            "blocks": n,
            "windows": self.windows,
            "baseline": self.raw.description,
            "one_file_baseline": self.one_file.description,
            **{f"{k}_seconds": v for k, v in med.items()},
            **{f"{k}_spread_seconds": [min(v), max(v)] for k, v in times.items() if v},
            # CPU seconds of this process (all threads) per block: steadier than wall
            # time on a shared machine, and what a busy server pays
            **{
                f"{k}_cpu_us_per_block": statistics.median(v) / n * 1e6
                for k, v in cpu.items()
                if v
            },
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


def _cpus() -> int:
    """CPUs this process may run on (the reference's threads: at most 2 by default)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1

