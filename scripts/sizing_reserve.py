"""What `promotion_reserve` does when many requests promote at once.

A `TieredCache` with a small primary (`--primary-blocks` blocks) over one nvme tier in
a temporary directory. `--requests` requests of `--blocks` blocks each are stored (they
stream through the primary to the tier), then all of them are looked up and loaded
concurrently. Prints, per reserve, the blocks served and the blocks shed as misses
(`promotions_shed`: another load held the whole reserve). The README's sizing guide
quotes it:

    .venv/bin/python scripts/sizing_reserve.py --reserves 0.25,0.5,1.0
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile

import torch

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.keys import make_offload_key


async def one_run(reserve: float, args: argparse.Namespace, path: str) -> dict[str, int]:
    config = parse_config(
        {
            "namespace": "sizing-reserve",
            "layout": {"block_bytes": args.block, "groups": [{"block_size": 16}]},
            "primary": {"capacity": args.primary_blocks * _size(args.block), "pin_memory": False},
            "promotion_reserve": reserve,
            "tiers": [{"type": "nvme", "path": path, "capacity": "4GiB", "fsync": "never"}],
        },
        source="sizing_reserve",
    )
    requests = [
        [make_offload_key(bytes([r, b]) * 16, 0) for b in range(args.blocks)]
        for r in range(args.requests)
    ]
    async with TieredCache(config) as cache:
        data = torch.randint(0, 256, (args.blocks, cache.block_bytes), dtype=torch.uint8)
        for keys in requests:
            assert (await cache.store(keys, data)).ok
        await cache.flush()

        async def serve(keys: list[bytes]) -> tuple[int, int]:
            hit = await cache.lookup([keys])
            out = torch.empty(len(hit.keys_to_load), cache.block_bytes, dtype=torch.uint8)
            result = await cache.load(hit.keys_to_load, out)
            return len(result.ok_keys), len(result.failed_keys)

        results = await asyncio.gather(*(serve(keys) for keys in requests))
        shed = cache.stats().primary["promotions_shed"]
    return {
        "served": sum(ok for ok, _ in results),
        "failed": sum(failed for _, failed in results),
        "shed": shed,
    }


def _size(text: str) -> int:
    from pydantic import ByteSize, TypeAdapter

    return int(TypeAdapter(ByteSize).validate_python(text))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reserves", default="0.25,0.5,1.0")
    parser.add_argument("--block", default="256KiB", help="block_bytes (256KiB)")
    parser.add_argument("--primary-blocks", type=int, default=32, help="primary blocks (32)")
    parser.add_argument("--requests", type=int, default=8, help="concurrent requests (8)")
    parser.add_argument("--blocks", type=int, default=24, help="blocks per request (24)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per reserve (3)")
    args = parser.parse_args()
    total = args.requests * args.blocks
    print(
        f"{args.requests} concurrent loads of {args.blocks} blocks of {args.block} from nvme "
        f"through a {args.primary_blocks}-block primary ({total} blocks in all)"
    )
    for reserve in (float(r) for r in args.reserves.split(",")):
        runs = []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory(prefix="tierkv-sizing-") as tmp:
                runs.append(asyncio.run(one_run(reserve, args, tmp)))
        served = sorted(r["served"] for r in runs)
        shed = sorted(r["shed"] for r in runs)
        print(
            f"promotion_reserve {reserve:4}: served {served[0]}-{served[-1]} of {total}, "
            f"shed {shed[0]}-{shed[-1]}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
