"""How long the remote tiers keep the event loop busy: the longest stall per job.

    .venv/bin/python tiers/bench_loop_stall.py [--blocks 64] [--block-mib 2] [--repeats 3]
        [--tiers redis,s3] [--freeze-gc]

Runs a store and a load job of `--blocks` blocks against a real redis-server and moto's
S3 server (both on loopback, started here) while a watcher task measures the gaps
between its turns on the loop: a gap is how long any other request of the server would
have waited to run. Prints the longest gap per job (the worst over `--repeats`) and the
job's wall time. What stalls the loop is CPU work done on the loop thread (framing,
checksums, joins, the client's parsing), so the numbers compare code, not media.

The first line, `idle`, is the same watcher while the loop only sleeps: the machine's
own floor (other processes, the scheduler). On a shared, oversubscribed machine the
wall-time stall says little below it; the loop-thread CPU per turn still does. A
collection of Python's cyclic garbage collector holds the GIL for as long as it runs
(up to ~0.2 s here with botocore's models in memory), whichever thread triggered it;
servers freeze long-lived objects after start-up (`gc.freeze()`, as vLLM does) to keep
it short; `--freeze-gc` does the same once the tier is open and the slab filled.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import time
from collections.abc import Awaitable, Callable

from tierkv_redis import RedisTier, RedisTierConfig
from tierkv_redis.testing import RedisServer
from tierkv_s3 import S3Tier, S3TierConfig
from tierkv_s3.testing import MotoServer

from tierkv.contract.jobs import JobMetadata, JobResult
from tierkv.contract.keys import make_offload_key
from tierkv.contract.slab import PrimaryView
from tierkv.tier import SecondaryTierManager


async def longest_stall(
    run: Callable[[], Awaitable[JobResult]],
) -> tuple[float, float, float, float, bool]:
    """(longest loop stall in s, most loop-thread CPU between two turns in s, all the
    loop thread's CPU in s, wall time in s, ok) while `run()` runs.

    The stall is wall time: it includes the loop thread waiting for a CPU or for the
    GIL (other processes on a busy machine, worker threads). The CPU figure is the
    work done on the loop thread itself between two turns of the watcher: what code
    left on the loop costs, without the machine's noise."""
    done = False
    worst = 0.0
    worst_cpu = 0.0

    async def watch() -> None:
        nonlocal worst, worst_cpu
        last = time.perf_counter()
        last_cpu = time.thread_time()
        while not done:
            await asyncio.sleep(0)
            now = time.perf_counter()
            now_cpu = time.thread_time()
            worst = max(worst, now - last)
            worst_cpu = max(worst_cpu, now_cpu - last_cpu)
            last, last_cpu = now, now_cpu

    watcher = asyncio.ensure_future(watch())
    await asyncio.sleep(0)
    start = time.perf_counter()
    start_cpu = time.thread_time()
    result = await run()
    wall = time.perf_counter() - start
    loop_cpu = time.thread_time() - start_cpu
    done = True
    await watcher
    return worst, worst_cpu, loop_cpu, wall, result.ok


async def measure(
    label: str,
    tier: SecondaryTierManager,
    view: PrimaryView,
    blocks: int,
    repeats: int,
    freeze_gc: bool = False,
) -> None:
    rng = random.Random(0)
    await tier.open()
    try:
        for slot in range(blocks):
            view.block(slot)[:] = rng.randbytes(view.block_bytes)
        if freeze_gc:  # what a server does once it is up
            gc.collect()
            gc.freeze()
        stalls: dict[str, list[float]] = {"store": [], "load": []}
        cpus: dict[str, list[float]] = {"store": [], "load": []}
        totals: dict[str, list[float]] = {"store": [], "load": []}
        walls: dict[str, list[float]] = {"store": [], "load": []}
        for rep in range(repeats):
            keys = tuple(make_offload_key(rng.randbytes(16), 0) for _ in range(blocks))
            store = JobMetadata(2 * rep, keys, tuple(range(blocks)))
            load = JobMetadata(2 * rep + 1, keys, tuple(range(blocks, 2 * blocks)))
            for verb, job, call in (("store", store, tier.store), ("load", load, tier.load)):
                stall, cpu, total, wall, ok = await longest_stall(lambda c=call, j=job: c(j))  # type: ignore[misc]
                if not ok:
                    raise SystemExit(f"{label} {verb} failed")
                stalls[verb].append(stall)
                cpus[verb].append(cpu)
                totals[verb].append(total)
                walls[verb].append(wall)
        for verb in ("store", "load"):
            print(
                f"{label:6s} {verb:5s} {blocks} x {view.block_bytes >> 20} MiB: longest stall "
                f"median {statistics.median(stalls[verb]) * 1e3:6.2f} ms "
                f"(worst {max(stalls[verb]) * 1e3:6.2f}), loop-thread CPU per turn median "
                f"{statistics.median(cpus[verb]) * 1e3:6.2f} ms "
                f"(worst {max(cpus[verb]) * 1e3:6.2f}), loop-thread CPU in all "
                f"{statistics.median(totals[verb]) * 1e3:5.0f} ms, job "
                f"{statistics.median(walls[verb]) * 1e3:.0f} ms"
            )
    finally:
        await tier.close()


class _Slept:
    ok = True


async def idle_floor(repeats: int, seconds: float = 0.5) -> None:
    """Print the watcher's longest gap while the loop only sleeps."""
    stalls, cpus = [], []
    for _ in range(repeats):

        async def sleep() -> JobResult:
            await asyncio.sleep(seconds)
            return _Slept()  # type: ignore[return-value]

        stall, cpu, _total, _wall, _ok = await longest_stall(sleep)
        stalls.append(stall)
        cpus.append(cpu)
    print(
        f"idle   {seconds:.1f} s asleep: longest stall median "
        f"{statistics.median(stalls) * 1e3:6.2f} ms (worst {max(stalls) * 1e3:6.2f}), "
        f"loop-thread CPU per turn median {statistics.median(cpus) * 1e3:6.2f} ms "
        f"(worst {max(cpus) * 1e3:6.2f})"
    )


async def main_async(
    blocks: int, block_mib: int, repeats: int, tiers: set[str], freeze_gc: bool = False
) -> None:
    await idle_floor(repeats)
    block = block_mib << 20
    view = PrimaryView(bytearray(2 * blocks * block), block, "loop-stall")
    if "redis" in tiers:
        with RedisServer() as redis:
            config = RedisTierConfig(url=redis.url)
            await measure("redis", RedisTier(config, view), view, blocks, repeats, freeze_gc)
    if "s3" not in tiers:
        return
    with MotoServer() as moto:
        moto.create_bucket("stall")
        s3_config = S3TierConfig.model_validate(
            {
                "url": "s3://stall/p",
                "endpoint_url": moto.endpoint_url,
                "access_key_id": "testing",
                "secret_access_key": "testing",
                "request_timeout": "60s",
                "job_timeout": "600s",
            }
        )
        await measure("s3", S3Tier(s3_config, view), view, blocks, repeats, freeze_gc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-mib", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiers", default="redis,s3", help="comma-separated: redis, s3")
    parser.add_argument(
        "--freeze-gc", action="store_true", help="gc.freeze() once a tier is open, as servers do"
    )
    args = parser.parse_args()
    tiers = set(args.tiers.split(","))
    if not tiers or not tiers <= {"redis", "s3"}:
        parser.error(f"--tiers takes redis and/or s3, got {args.tiers!r}")
    asyncio.run(main_async(args.blocks, args.block_mib, args.repeats, tiers, args.freeze_gc))


if __name__ == "__main__":
    main()
