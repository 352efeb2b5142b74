"""How long the event loop stalls while a large write-back backlog drains.

    .venv/bin/python scripts/bench_writeback_drain.py --dirty 500000

A primary of `--dirty` + 10 % blocks of `--block` bytes (64 B by default, so half a
million blocks cost ~35 MB) over a `memory` tier with `write_policy: write_back` and
`write_back_max_dirty: 1.0`: `--dirty` blocks are stored (all dirty, nothing written
back: no pressure). Then the dirty bound is lowered to 1,000 blocks and the background
loop drains the backlog in batches of 64. A ticker task measures the event loop's lag
(how late `sleep(0)` returns) while it drains: the longest synchronous stretch is what
every other request on the loop waits. Prints per-batch lag p50/p99/max, the number of
batches and the drain's wall time; `--limit` seconds stops a drain that is too slow
(the old code copied the whole dirty set per batch).

Runs against whichever `tierkv` is first on the path, so the same script measures two
checkouts (`PYTHONPATH=/other/checkout:... python scripts/bench_writeback_drain.py`).
"""

from __future__ import annotations

import argparse
import json
import time

import anyio
import torch

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.keys import make_offload_key
from tierkv.stats import percentile

BATCH_STORE = 4096  # keys per store call while filling


async def run(args: argparse.Namespace) -> dict[str, float]:
    blocks = args.dirty + args.dirty // 10
    config = parse_config(
        {
            "namespace": "drain",
            "layout": {"block_bytes": args.block, "groups": [{"block_size": 16}]},
            "primary": {"capacity": blocks * args.block, "pin_memory": False},
            "tiers": [
                {
                    "type": "memory",
                    "capacity": (args.dirty + 1) * (args.block + 256),
                    "write_policy": "write_back",
                }
            ],
            "write_back_max_dirty": 1.0,
            "write_back_headroom": 0,
        }
    )
    keys = [make_offload_key(i.to_bytes(16, "big") * 2, 0) for i in range(args.dirty)]
    data = torch.zeros(BATCH_STORE, args.block, dtype=torch.uint8)
    async with TieredCache(config) as cache:
        t0 = time.perf_counter()
        for a in range(0, args.dirty, BATCH_STORE):
            part = keys[a : a + BATCH_STORE]
            result = await cache.store(part, data[: len(part)])
            assert result.ok, result.error
        fill = time.perf_counter() - t0
        index = cache.core.index
        assert index.dirty_count == args.dirty, index.dirty_count
        lags: list[float] = []
        done = False

        async def ticker() -> None:
            while not done:
                t = time.perf_counter()
                await anyio.sleep(0)
                lags.append(time.perf_counter() - t)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await anyio.sleep(0.05)
            lags.clear()
            wb = cache.writeback
            wb.bound = 1000
            started = time.perf_counter()
            wb.wake()
            deadline = started + args.limit
            while index.dirty_count > wb.bound and time.perf_counter() < deadline:
                await anyio.sleep(0.01)
            drain = time.perf_counter() - started
            done = True
        drained = args.dirty - index.dirty_count
        batches = -(-drained // 64)
        # the lags above a millisecond are the loop's stalls (a batch's bookkeeping)
        stalls = sorted(x for x in lags if x > 0.001) or [0.0]
        report = {
            "dirty": args.dirty,
            "fill_s": round(fill, 2),
            "drained": drained,
            "batches": batches,
            "drain_s": round(drain, 2),
            "lag_p50_ms": round(percentile(lags, 0.5) * 1000, 3),
            "lag_p99_ms": round(percentile(lags, 0.99) * 1000, 3),
            "lag_max_ms": round(max(lags) * 1000, 3),
            "stalls_over_1ms": len([x for x in lags if x > 0.001]),
            "stall_p50_ms": round(percentile(stalls, 0.5) * 1000, 3),
            "finished": index.dirty_count <= wb.bound,
        }
        wb.bound = args.dirty  # close() need not write back the rest
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dirty", type=int, default=500_000)
    parser.add_argument("--block", type=int, default=64, help="block_bytes (64)")
    parser.add_argument("--limit", type=float, default=120.0, help="seconds to drain at most")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = anyio.run(run, args)
    if args.json:
        print(json.dumps(report))
        return
    for key, value in report.items():
        print(f"{key:>16}: {value}")


if __name__ == "__main__":
    main()
