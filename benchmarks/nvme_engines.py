"""The nvme tier alone (no cache around it), Python path against the compiled core:
store then load N blocks in jobs of --batch blocks, --concurrency jobs at once, the
tier's files under --path (default /dev/shm: no disk limit), engines interleaved.

    .venv/bin/python benchmarks/nvme_engines.py [--block-kib 64] [--blocks 4096] [--rounds 2]

Prints GB/s and CPU µs per block (the process's user + system time over the blocks
moved: event loop, worker threads and the core's own threads) per engine and round.
Compare with the same files in C: `cc -O2 -pthread -o /tmp/rawio ../shared/tools/rawio.c`,
`/tmp/rawio write|read /dev/shm/rawio N B 1`.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import time
from pathlib import Path

import anyio
from tierkv_nvme import NvmeTier, NvmeTierConfig

from tierkv.contract.jobs import JobMetadata
from tierkv.primary import PrimaryTier
from tierkv.testing import random_keys


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def one_round(engine: str, args: argparse.Namespace) -> tuple[float, float, float, float]:
    block, n, batch, jobs = args.block_kib << 10, args.blocks, args.batch, args.concurrency
    primary = PrimaryTier(batch * jobs, block, pin_memory=False, namespace="nvme-engines")
    path = Path(args.path) / f"tierkv-nvme-engines-{engine}"
    shutil.rmtree(path, ignore_errors=True)
    config = NvmeTierConfig(
        type="nvme", path=path, capacity=4 * n * block, io_engine=engine, fsync="never"
    )
    tier = NvmeTier(config, primary.view)
    await tier.open()
    keys = random_keys(n)
    ids = iter(range(1, 10**9))

    async def run(verb: str) -> tuple[float, float]:
        async def lane(c: int) -> None:
            slots = tuple(range(c * batch, (c + 1) * batch))
            for i in range(c * batch, n, jobs * batch):
                job = JobMetadata(next(ids), tuple(keys[i : i + batch]), slots)
                result = await (tier.store(job) if verb == "store" else tier.load(job))
                assert result.ok, result.error

        cpu, wall = cpu_seconds(), time.perf_counter()
        async with anyio.create_task_group() as tg:
            for c in range(jobs):
                tg.start_soon(lane, c)
        wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
        return n * block / wall / 1e9, cpu / n * 1e6

    try:
        store = await run("store")
        load = await run("load")
    finally:
        await tier.close()
        shutil.rmtree(path, ignore_errors=True)
    return (*store, *load)


async def main(args: argparse.Namespace) -> None:
    print(f"nvme tier alone: {args.blocks} blocks of {args.block_kib} KiB, jobs of "
          f"{args.batch}, {args.concurrency} at once, under {args.path}")
    print("engine  round  store GB/s  store CPU us/blk  load GB/s  load CPU us/blk")
    for r in range(args.rounds):
        for engine in ("python", "native"):
            sg, sc, lg, lc = await one_round(engine, args)
            print(f"{engine:7s} {r + 1:5d}  {sg:10.2f}  {sc:16.0f}  {lg:9.2f}  {lc:15.0f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--path", default="/dev/shm")
    anyio.run(main, parser.parse_args())
