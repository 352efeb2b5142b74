"""Store then load N MiB of blocks through the redis tier and through plain redis-py,
in the same run, against the same server; print MB/s of both and the ratio.

    python tiers/redis/bench_redis.py                       # starts its own redis-server
    python tiers/redis/bench_redis.py --url redis://127.0.0.1:6379/0
    python tiers/redis/bench_redis.py --sweep               # pipeline depth x concurrency

The raw client sends the slab rows as they are (no frame, no checksum) with the same
concurrency and pipeline depth as the tier; each figure is the best of --repeat runs,
since the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import redis.asyncio as aioredis
from tierkv_redis import RedisTier, RedisTierConfig
from tierkv_redis.testing import RedisServer

from tierkv.bench import TierJobBench, best_of
from tierkv.primary import PrimaryTier

MiB = 1 << 20


class RawClient:
    """Plain redis-py: slab rows as values, no frame, same concurrency and depth."""

    def __init__(self, url: str, primary: PrimaryTier, concurrency: int, depth: int) -> None:
        self.client = aioredis.Redis.from_url(url, max_connections=concurrency)
        self.primary = primary
        self.depth = depth
        n = primary.num_blocks
        self.names = [f"rawbench:{i}" for i in range(n)]
        self.gate = asyncio.Semaphore(concurrency)
        self.batches = [range(lo, min(n, lo + depth)) for lo in range(0, n, depth)]

    async def _put(self, batch: range) -> None:
        async with self.gate:
            if self.depth == 1:
                await self.client.set(self.names[batch[0]], self.primary.view.block(batch[0]))
                return
            pipe = self.client.pipeline(transaction=False)
            for i in batch:
                pipe.set(self.names[i], self.primary.view.block(i))
            await pipe.execute()

    async def _get(self, batch: range) -> None:
        async with self.gate:
            if self.depth == 1:
                await self.client.get(self.names[batch[0]])
                return
            pipe = self.client.pipeline(transaction=False)
            for i in batch:
                pipe.get(self.names[i])
            await pipe.execute()

    async def store(self) -> None:
        await asyncio.gather(*(self._put(b) for b in self.batches))

    async def load(self) -> None:
        await asyncio.gather(*(self._get(b) for b in self.batches))

    async def close(self) -> None:
        await self.client.delete(*self.names)
        await self.client.aclose()


def tier_client(url: str, primary: PrimaryTier, concurrency: int, depth: int) -> TierJobBench:
    """The same blocks through RedisTier: one store job and one load job of all of them."""
    config = RedisTierConfig(url=url, max_connections=concurrency, pipeline_size=depth)
    return TierJobBench(RedisTier(config, primary.view))


async def measure(
    url: str, primary: PrimaryTier, concurrency: int, depth: int, repeat: int
) -> dict[str, float]:
    """Best seconds of each of raw/tier store/load; raw and tier alternate, so a
    noisy neighbour hurts both alike."""
    raw = RawClient(url, primary, concurrency, depth)
    tier = tier_client(url, primary, concurrency, depth)
    await tier.open()
    try:
        best = await best_of(
            repeat,
            [
                ("raw_store", raw.store),
                ("tier_store", tier.store),
                ("raw_load", raw.load),
                ("tier_load", tier.load),
            ],
        )
    finally:
        await raw.close()
        await tier.close()
    return best


def cpu_line(best: dict[str, float]) -> str:
    return (
        f"{best['raw_store_cpu']:.3f}/{best['tier_store_cpu']:.3f}, "
        f"{best['raw_load_cpu']:.3f}/{best['tier_load_cpu']:.3f}"
    )


async def run(args: argparse.Namespace, url: str) -> None:
    block = int(args.block_mib * MiB)
    n = max(1, int(args.total_mib * MiB) // block)
    primary = PrimaryTier(n, block, pin_memory=False, namespace="bench")
    for slot in range(n):
        primary.view.block(slot)[:] = os.urandom(block)
    mb = n * block / 1e6
    combos = (
        [(c, d) for d in (1, 4, 16) for c in (4, 8, 16)]
        if args.sweep
        else [(args.concurrency, args.pipeline)]
    )
    print(f"{n} blocks of {block / MiB:g} MiB = {mb:.0f} MB, best of {args.repeat}; {url}")
    print(f"{'conc':>4} {'depth':>5} | {'raw store':>9} {'tier store':>10} {'ratio':>5} | "
          f"{'raw load':>8} {'tier load':>9} {'ratio':>5} (MB/s) | "
          "client CPU s raw/tier: store, load")  # fmt: skip
    for concurrency, depth in combos:
        best = await measure(url, primary, concurrency, depth, args.repeat)
        raw_s, tier_s = best["raw_store"], best["tier_store"]
        raw_l, tier_l = best["raw_load"], best["tier_load"]
        print(
            f"{concurrency:>4} {depth:>5} | {mb / raw_s:>9.0f} {mb / tier_s:>10.0f} "
            f"{raw_s / tier_s:>5.2f} | {mb / raw_l:>8.0f} {mb / tier_l:>9.0f} "
            f"{raw_l / tier_l:>5.2f}        | {cpu_line(best)}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="an existing Redis (default: start a private one)")
    parser.add_argument("--total-mib", type=float, default=256)
    parser.add_argument("--block-mib", type=float, default=1)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--pipeline", type=int, default=1, help="commands per pipeline")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sweep", action="store_true", help="try depth 1/4/16 x conc 4/8/16")
    args = parser.parse_args()
    if args.url:
        asyncio.run(run(args, args.url))
        return 0
    with RedisServer() as server:
        asyncio.run(run(args, server.url))
    return 0


if __name__ == "__main__":
    sys.exit(main())
