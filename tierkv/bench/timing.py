"""Driving batches and timing them: `drive` keeps `concurrency` batch calls in flight,
`Timing` is one phase of one repetition, `summarize` the median over repetitions."""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from tierkv.stats import percentile

Batch = tuple[int, int]  # [start, end) block indices


def split_batches(n: int, size: int) -> list[Batch]:
    return [(i, min(n, i + size)) for i in range(0, n, size)]


async def drive(
    batches: Sequence[Batch], concurrency: int, op: Callable[[int, int], Awaitable[None]]
) -> tuple[float, list[float]]:
    """Run `op` over `batches` with `concurrency` in flight; (seconds, per-batch seconds)."""
    latencies: list[float] = []
    pending: Iterator[Batch] = iter(batches)

    async def worker() -> None:
        for start, end in pending:
            t0 = time.perf_counter()
            await op(start, end)
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(min(concurrency, len(batches))):
            tg.start_soon(worker)
    return time.perf_counter() - t0, latencies


@dataclass(frozen=True)
class Timing:
    """One phase of one repetition: wall seconds and per-batch latency percentiles."""

    seconds: float
    p50: float
    p99: float

    @classmethod
    def of(cls, seconds: float, latencies: Sequence[float]) -> Timing:
        return cls(seconds, percentile(latencies, 0.5), percentile(latencies, 0.99))


def summarize(nbytes: int, timings: Sequence[Timing]) -> dict[str, Any]:
    """Median MB/s with its spread, and median latency percentiles, over repetitions."""
    mbps = [nbytes / t.seconds / 1e6 for t in timings]
    return {
        "MBps": statistics.median(mbps),
        "spread": [min(mbps), max(mbps)],
        "p50_ms": statistics.median(t.p50 for t in timings) * 1e3,
        "p99_ms": statistics.median(t.p99 for t in timings) * 1e3,
    }
