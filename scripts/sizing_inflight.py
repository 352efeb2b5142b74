"""How `max_inflight_bytes` decides what reaches a tier when stores come in bursts.

A `TieredCache` with a primary that holds every block, over one nvme tier in a
temporary directory: `--stores` store calls of `--batch` blocks, issued as fast as
`store` returns, then `flush()`. Prints, per `max_inflight_bytes`, how many blocks the
tier got and how many cascades were dropped (the tier's `drops`). With `--primary
16MiB --stores 1 --batch 64` it is one streaming store four times larger than the
primary instead. The README's sizing guide quotes both:

    .venv/bin/python scripts/sizing_inflight.py --limits 4MiB,16MiB,64MiB,256MiB
    .venv/bin/python scripts/sizing_inflight.py --limits 2MiB,4MiB,8MiB,256MiB \
        --primary 16MiB --stores 1 --batch 64
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile

import torch

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.keys import make_offload_key


async def one_run(limit: str, args: argparse.Namespace, path: str) -> dict[str, int]:
    config = parse_config(
        {
            "namespace": f"sizing-inflight-{limit}",
            "layout": {"block_bytes": args.block, "groups": [{"block_size": 16}]},
            "primary": {"capacity": args.primary, "pin_memory": False},
            "tiers": [
                {
                    "type": "nvme",
                    "path": path,
                    "capacity": "2GiB",
                    "fsync": "never",
                    "max_inflight_bytes": limit,
                }
            ],
        },
        source="sizing_inflight",
    )
    async with TieredCache(config) as cache:
        data = torch.randint(0, 256, (args.batch, cache.block_bytes), dtype=torch.uint8)
        for s in range(args.stores):
            keys = [
                make_offload_key(bytes([s, b % 256, b // 256]) * 8, 0) for b in range(args.batch)
            ]
            result = await cache.store(keys, data)
            assert result.ok, result.error
        await cache.flush()
        tier = next(iter(cache.stats().tiers.values()))
        return {"stored": tier["blocks_stored"], "dropped": tier["drops"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limits", default="4MiB,16MiB,64MiB,256MiB")
    parser.add_argument("--block", default="1MiB", help="block_bytes (1MiB)")
    parser.add_argument("--primary", default="512MiB", help="primary capacity (512MiB)")
    parser.add_argument("--stores", type=int, default=32, help="store calls (32)")
    parser.add_argument("--batch", type=int, default=8, help="blocks per store (8)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per limit (3)")
    args = parser.parse_args()
    total = args.stores * args.batch
    print(
        f"{total} blocks of {args.block} in {args.stores} stores of {args.batch}, "
        f"primary {args.primary}"
    )
    for limit in args.limits.split(","):
        runs = []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory(prefix="tierkv-sizing-") as tmp:
                runs.append(asyncio.run(one_run(limit, args, tmp)))
        got = sorted(r["stored"] for r in runs)
        dropped = sorted(r["dropped"] for r in runs)
        print(
            f"max_inflight_bytes {limit:>7}: tier got {got[0]}-{got[-1]} of {total}, "
            f"dropped {dropped[0]}-{dropped[-1]}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
