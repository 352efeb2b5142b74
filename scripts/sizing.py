"""The measurements behind the sizing guide (docs/sizing.md) that `tierkv demo` and `tierkv
bench` do not make: what `promotion_reserve` and `max_inflight_bytes` decide.

    .venv/bin/python scripts/sizing.py reserve --primary-blocks 32
    .venv/bin/python scripts/sizing.py reserve --primary-blocks 128
    .venv/bin/python scripts/sizing.py inflight
    .venv/bin/python scripts/sizing.py inflight --limits 2MiB,4MiB,8MiB,256MiB \\
        --primary 16MiB --stores 1 --batch 64

`reserve`: a `TieredCache` with a small primary over one nvme tier (a temporary
directory). `--requests` requests of `--blocks` blocks are stored (they stream through
the primary to the tier), then all of them are looked up and loaded at once. Prints,
per `promotion_wait` and reserve, the blocks served, those shed as misses
(`promotions_shed`: no room for their promotion within `promotion_wait`) and the
slowest request's lookup + load time (what waiting costs in time to first token).

`inflight`: a primary (`--primary`) over one nvme tier; `--stores` store calls of
`--batch` blocks, each issued as soon as the last returned, then `flush()`. Prints, per
`max_inflight_bytes`, how many blocks the tier got and how many cascades were dropped
(the tier's `drops`). With `--stores 1 --batch 64 --primary 16MiB` it is one streaming
store four times larger than the primary.

Counts, not times (the slowest request aside); with `promotion_wait` 0 the reserve's
are exact, with a wait they depend on how fast the tier reads; the in-flight ones
depend on how fast the tier drains and vary from run to run. Each setting runs
`--repeat` times; the range over the runs is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch
from pydantic import ByteSize, TypeAdapter

from tierkv.cache import TieredCache
from tierkv.config import CacheConfig, parse_config
from tierkv.contract.keys import OffloadKey, make_offload_key


def _size(text: str) -> int:
    return int(TypeAdapter(ByteSize).validate_python(text))


def _chain(block: int, primary: int, tier: dict[str, Any], **settings: Any) -> CacheConfig:
    return parse_config(
        {
            "namespace": "sizing",
            "layout": {"block_bytes": block, "groups": [{"block_size": 16}]},
            "primary": {"capacity": primary, "pin_memory": False},
            "tiers": [{"type": "nvme", "capacity": "4GiB", "fsync": "never", **tier}],
            **settings,
        },
        source="scripts/sizing.py",
    )


def _keys(request: int, blocks: int) -> list[OffloadKey]:
    return [make_offload_key(bytes([request, b % 256, b // 256]) * 8, 0) for b in range(blocks)]


def _ranges(
    repeat: int, run: Callable[[str], Awaitable[dict[str, int]]]
) -> dict[str, tuple[int, int]]:
    """Run `run(directory)` `repeat` times, each in a fresh directory; the min and max
    of every count."""
    runs = []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory(prefix="tierkv-sizing-") as tmp:
            runs.append(asyncio.run(run(tmp)))
    return {k: (min(r[k] for r in runs), max(r[k] for r in runs)) for k in runs[0]}


def _span(lo_hi: tuple[int, int]) -> str:
    lo, hi = lo_hi
    return str(lo) if lo == hi else f"{lo}-{hi}"


async def _reserve_run(
    reserve: float, wait: str, args: argparse.Namespace, path: str
) -> dict[str, int]:
    config = _chain(
        args.block,
        args.primary_blocks * args.block,
        {"path": path},
        promotion_reserve=reserve,
        promotion_wait=wait,
    )
    requests = [_keys(r, args.blocks) for r in range(args.requests)]
    async with TieredCache(config) as cache:
        data = torch.randint(0, 256, (args.blocks, cache.block_bytes), dtype=torch.uint8)
        for keys in requests:
            assert (await cache.store(keys, data)).ok
        await cache.flush()

        slowest = 0.0

        async def serve(keys: list[OffloadKey]) -> int:
            nonlocal slowest
            started = time.perf_counter()
            hit = await cache.lookup([keys])
            out = torch.empty(len(hit.keys_to_load), cache.block_bytes, dtype=torch.uint8)
            served = len((await cache.load(hit.keys_to_load, out)).ok_keys)
            slowest = max(slowest, time.perf_counter() - started)
            return served

        served = await asyncio.gather(*(serve(keys) for keys in requests))
        return {
            "served": sum(served),
            "shed": cache.stats().primary["promotions_shed"],
            "slowest_ms": round(slowest * 1000),
        }


async def _inflight_run(limit: int, args: argparse.Namespace, path: str) -> dict[str, int]:
    config = _chain(args.block, args.primary, {"path": path, "max_inflight_bytes": limit})
    async with TieredCache(config) as cache:
        data = torch.randint(0, 256, (args.batch, cache.block_bytes), dtype=torch.uint8)
        for s in range(args.stores):
            result = await cache.store(_keys(s, args.batch), data)
            assert result.ok, result.error
        await cache.flush()
        tier = next(iter(cache.stats().tiers.values()))
        return {"stored": tier["blocks_stored"], "dropped": tier["drops"]}


def reserve(args: argparse.Namespace) -> None:
    total = args.requests * args.blocks
    print(
        f"{args.requests} concurrent loads of {args.blocks} blocks of {args.block} B from "
        f"nvme through a {args.primary_blocks}-block primary ({total} blocks in all)"
    )
    for wait in args.waits.split(","):
        for value in (float(r) for r in args.reserves.split(",")):
            got = _ranges(args.repeat, lambda tmp: _reserve_run(value, wait, args, tmp))  # noqa: B023
            print(
                f"promotion_wait {wait:>5}, promotion_reserve {value:4}: served "
                f"{_span(got['served'])} of {total}, shed {_span(got['shed'])}, slowest "
                f"request {_span(got['slowest_ms'])} ms"
            )


def inflight(args: argparse.Namespace) -> None:
    total = args.stores * args.batch
    print(
        f"{total} blocks of {args.block} B in {args.stores} stores of {args.batch}, "
        f"primary {args.primary} B"
    )
    for text in args.limits.split(","):
        limit = _size(text)
        got = _ranges(args.repeat, lambda tmp: _inflight_run(limit, args, tmp))  # noqa: B023
        print(
            f"max_inflight_bytes {text:>7}: tier got {_span(got['stored'])} of {total}, "
            f"dropped {_span(got['dropped'])}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    r = sub.add_parser("reserve", help="promotion_reserve under concurrent loads")
    r.add_argument("--reserves", default="0.25,0.5,1.0")
    r.add_argument("--waits", default="0,5ms,50ms", help="promotion_wait values (0,5ms,50ms)")
    r.add_argument("--block", type=_size, default="256KiB", help="block_bytes (256KiB)")
    r.add_argument("--primary-blocks", type=int, default=32, help="primary blocks (32)")
    r.add_argument("--requests", type=int, default=8, help="concurrent requests (8)")
    r.add_argument("--blocks", type=int, default=24, help="blocks per request (24)")
    r.set_defaults(func=reserve)
    f = sub.add_parser("inflight", help="max_inflight_bytes under bursts of stores")
    f.add_argument("--limits", default="4MiB,16MiB,64MiB,256MiB")
    f.add_argument("--block", type=_size, default="1MiB", help="block_bytes (1MiB)")
    f.add_argument("--primary", type=_size, default="512MiB", help="primary capacity (512MiB)")
    f.add_argument("--stores", type=int, default=32, help="store calls (32)")
    f.add_argument("--batch", type=int, default=8, help="blocks per store (8)")
    f.set_defaults(func=inflight)
    for p in (r, f):
        p.add_argument("--repeat", type=int, default=3, help="runs per setting (3)")
    args = parser.parse_args()
    args.func(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
