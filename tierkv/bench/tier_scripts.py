"""Helpers for a tier package's own benchmark script (`tiers/*/bench_*.py`): the tier
side of a per-tier benchmark (`TierJobBench`) and best-of timing (`timed`, `best_of`)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

from tierkv.contract.jobs import JobMetadata
from tierkv.contract.keys import make_offload_key
from tierkv.contract.tier import SecondaryTierManager


class TierJobBench:
    """The tier side of a per-tier benchmark: one store job and one load job covering
    every slot of the tier's primary, so the tier's own batching is what is measured."""

    def __init__(self, tier: SecondaryTierManager) -> None:
        self.tier = tier
        n = tier.primary.num_blocks
        self.keys = tuple(make_offload_key(i.to_bytes(32, "big"), 0) for i in range(n))
        self.job = JobMetadata(1, self.keys, tuple(range(n)))

    async def open(self) -> None:
        await self.tier.open()

    async def store(self) -> None:
        result = await self.tier.store(self.job)
        assert result.ok, result.error

    async def load(self) -> None:
        result = await self.tier.load(self.job)
        assert result.ok, result.error

    async def close(self) -> None:
        await self.tier.remove(self.keys)
        await self.tier.close()


async def timed(fn: Callable[[], Awaitable[None]]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one `await fn()`."""
    cpu, start = time.process_time(), time.perf_counter()
    await fn()
    return time.perf_counter() - start, time.process_time() - cpu


async def best_of(
    repeat: int, phases: Sequence[tuple[str, Callable[[], Awaitable[None]]]]
) -> dict[str, float]:
    """Run `phases` in order `repeat` times (raw and tier alternating, so a noisy
    neighbour hurts both alike); the best wall seconds of each as `name` and the best
    CPU seconds as `name_cpu`."""
    best: dict[str, float] = {}
    for _ in range(repeat):
        for name, fn in phases:
            wall, cpu = await timed(fn)
            best[name] = min(best.get(name, wall), wall)
            best[f"{name}_cpu"] = min(best.get(f"{name}_cpu", cpu), cpu)
    return best
