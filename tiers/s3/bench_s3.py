"""Store then load N MiB of blocks through the s3 tier and through plain s3fs calls
(`_pipe_file` / `_cat_file`) at the same concurrency, in the same run, against the
same endpoint; print MB/s of both and the ratio.

    python tiers/s3/bench_s3.py                    # starts its own moto server
    python tiers/s3/bench_s3.py --endpoint-url http://127.0.0.1:9000 --bucket kv

moto's server is CPU-bound Python (~200 MB/s for 1 MiB objects on two cores), so the
absolute figures say little about S3; the ratio says what the tier costs over the
client it wraps. Each figure is the best of --repeat runs; raw and tier alternate.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from s3fs import S3FileSystem  # type: ignore[import-untyped]
from tierkv_s3 import S3Tier, S3TierConfig
from tierkv_s3.testing import MotoServer

from tierkv.bench import TierJobBench, best_of
from tierkv.primary import PrimaryTier

MiB = 1 << 20


class RawClient:
    """Plain s3fs: slab rows as objects, no frame, same client settings and concurrency."""

    def __init__(self, endpoint: str, bucket: str, primary: PrimaryTier, concurrency: int) -> None:
        self.fs = S3FileSystem(
            asynchronous=True,
            skip_instance_cache=True,
            endpoint_url=endpoint,
            key="bench",
            secret="bench",
            max_concurrency=concurrency,
            config_kwargs={
                "max_pool_connections": concurrency,
                "request_checksum_calculation": "when_required",
                "response_checksum_validation": "when_required",
            },
        )
        self.primary = primary
        self.paths = [f"{bucket}/rawbench/{i}" for i in range(primary.num_blocks)]
        self.gate = asyncio.Semaphore(concurrency)
        self.client: Any = None

    async def open(self) -> None:
        self.client = await self.fs.set_session()

    async def _put(self, i: int) -> None:
        async with self.gate:
            # botocore takes bytes, not a memoryview: one copy, as the tier makes
            await self.fs._pipe_file(self.paths[i], bytes(self.primary.view.block(i)))

    async def _get(self, i: int) -> None:
        async with self.gate:
            await self.fs._cat_file(self.paths[i], max_concurrency=1)

    async def store(self) -> None:
        await asyncio.gather(*(self._put(i) for i in range(len(self.paths))))

    async def load(self) -> None:
        await asyncio.gather(*(self._get(i) for i in range(len(self.paths))))

    async def close(self) -> None:
        await self.fs._rm(self.paths)
        await self.client.close()


def tier_client(endpoint: str, bucket: str, primary: PrimaryTier, concurrency: int) -> TierJobBench:
    """The same blocks through S3Tier: one store job and one load job of all of them."""
    config = S3TierConfig(
        url=f"s3://{bucket}/tierbench",
        endpoint_url=endpoint,
        access_key_id="bench",
        secret_access_key="bench",
        max_concurrency=concurrency,
    )
    return TierJobBench(S3Tier(config, primary.view))


async def run(args: argparse.Namespace, endpoint: str) -> None:
    block = int(args.block_mib * MiB)
    n = max(1, int(args.total_mib * MiB) // block)
    primary = PrimaryTier(n, block, pin_memory=False, namespace="bench")
    for slot in range(n):
        primary.view.block(slot)[:] = os.urandom(block)
    mb = n * block / 1e6
    print(f"{n} blocks of {block / MiB:g} MiB = {mb:.0f} MB, best of {args.repeat}; {endpoint}")
    print(f"{'conc':>4} | {'raw store':>9} {'tier store':>10} {'ratio':>5} | "
          f"{'raw load':>8} {'tier load':>9} {'ratio':>5} (MB/s) | "
          "client CPU s raw/tier: store, load")  # fmt: skip
    for concurrency in args.concurrency:
        raw = RawClient(endpoint, args.bucket, primary, concurrency)
        tier = tier_client(endpoint, args.bucket, primary, concurrency)
        await raw.open()
        await tier.open()
        try:
            best = await best_of(
                args.repeat,
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
        rs, ts, rl, tl = best["raw_store"], best["tier_store"], best["raw_load"], best["tier_load"]
        print(
            f"{concurrency:>4} | {mb / rs:>9.0f} {mb / ts:>10.0f} {rs / ts:>5.2f} | "
            f"{mb / rl:>8.0f} {mb / tl:>9.0f} {rl / tl:>5.2f}        | "
            f"{best['raw_store_cpu']:.3f}/{best['tier_store_cpu']:.3f}, "
            f"{best['raw_load_cpu']:.3f}/{best['tier_load_cpu']:.3f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint-url", help="an existing S3 endpoint (default: start moto)")
    parser.add_argument("--bucket", default="tierkv-bench")
    parser.add_argument("--total-mib", type=float, default=256)
    parser.add_argument("--block-mib", type=float, default=1)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8])
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    if args.endpoint_url:
        asyncio.run(run(args, args.endpoint_url))
        return 0
    with MotoServer() as server:
        server.create_bucket(args.bucket)
        asyncio.run(run(args, server.endpoint_url))
    return 0


if __name__ == "__main__":
    sys.exit(main())
