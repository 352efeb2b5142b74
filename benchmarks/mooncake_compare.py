"""The mooncake tier's loads against Mooncake's own batched call with the same batching.

    .venv/bin/python benchmarks/mooncake_compare.py [--block-kib 1024] [--blocks 128]
        [--rounds 3] [--passes 8]
    .venv/bin/python benchmarks/mooncake_compare.py --block-kib 8192 --blocks 32

Starts a master and a segment holder on loopback (`tierkv_mooncake.testing`), stores
`--blocks` blocks through the tier, then after one warm-up pass of each, runs
`--rounds` rounds of `--passes` pairs: the tier's `load` of every block (one job:
`batch_blocks` per call, `concurrency` lanes, frames checked) and the raw path, the
tier's own client calling `batch_get_into_multi_buffers` on the same names into the
same header rows and slots, `batch_blocks` a call, `concurrency` threads, nothing
checked. The pairs alternate which goes first, and a round adds up its passes: on a
shared 2-core machine one load of 128 MiB (~0.1 s) swings by +-40 % with the other
processes, which several alternating passes average out (`--passes 1`: one load of
each a round, as before, but alternating which goes first). Prints GB/s and the ratio
tier/raw per round, then their range and median (issue 50's bar: >= 0.9 at 1 MiB and
8 MiB). `--engine-owned`: the pages are an engine's (`PrimaryView.engine_owned`, as
under SGLang or LMCache), so the tier's loads land in its staging arena and are copied
into the pages: what that costs against the same raw calls.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import anyio
from tierkv_mooncake import MooncakeTier, MooncakeTierConfig
from tierkv_mooncake.testing import MooncakeMaster, SegmentHolder

from tierkv.contract.jobs import JobMetadata
from tierkv.contract.slab import PrimaryView
from tierkv.testing import fill_slots, random_keys


def raw_loads(tier: MooncakeTier, keys: list[bytes], pool: ThreadPoolExecutor) -> float:
    """Seconds for the raw batched gets of `keys` (slot i for key i), batched as the
    tier batches."""
    client = tier._require()
    block = tier.primary.block_bytes
    batch = tier.config.batch_blocks
    calls = []
    for start in range(0, len(keys), batch):
        part = list(enumerate(keys))[start : start + batch]
        names = [tier._names.name(k) for _, k in part]
        pointers = [list(tier._layout(k, slot)) for slot, k in part]
        sizes = [[tier.framer.header_bytes(k), block] for _, k in part]
        calls.append((names, pointers, sizes))
    started = time.perf_counter()
    codes = list(pool.map(lambda c: client.get_into(*c), calls))
    took = time.perf_counter() - started
    bad = [code for batch_codes in codes for code in batch_codes if code < 0]
    assert not bad, f"raw gets failed: {bad[:3]}"
    return took


async def main(args: argparse.Namespace) -> None:
    block, n = args.block_kib << 10, args.blocks
    segment = max(256 << 20, 4 * n * block)
    with MooncakeMaster() as master, SegmentHolder(master, segment):
        view = PrimaryView(bytearray(n * block), block, "mooncake-compare")
        view.engine_owned = args.engine_owned
        config = MooncakeTierConfig.model_validate(
            {"master": master.master, "metadata_server": master.metadata_server,
             "job_timeout": "60s"}
        )
        tier = MooncakeTier(config, view)
        await tier.open()
        try:
            keys = random_keys(n)
            fill_slots(view, range(n), random.Random(0))
            result = await tier.store(JobMetadata(1, tuple(keys), tuple(range(n))))
            assert result.ok, result.error
            pool = ThreadPoolExecutor(config.concurrency)
            job = JobMetadata(2, tuple(keys), tuple(range(n)))

            async def tier_loads() -> float:
                started = time.perf_counter()
                done = await tier.load(job)
                assert done.ok, done.error
                return time.perf_counter() - started

            async def raw() -> float:
                return await anyio.to_thread.run_sync(raw_loads, tier, keys, pool)

            await tier_loads()  # warm-up of both
            await raw()
            print(f"{n} blocks of {args.block_kib} KiB, batch_blocks {config.batch_blocks}, "
                  f"concurrency {config.concurrency}, loopback TCP, {args.passes} alternating "
                  "passes of each a round"
                  + (", engine-owned pages (loads staged)" if args.engine_owned else ""))
            print("round  tier GB/s  raw GB/s  tier/raw")
            moved = n * block * args.passes
            ratios = []
            for r in range(args.rounds):
                t = w = 0.0
                for p in range(args.passes):
                    if (r * args.passes + p) % 2 == 0:
                        t += await tier_loads()
                        w += await raw()
                    else:
                        w += await raw()
                        t += await tier_loads()
                ratios.append(w / t)
                print(f"{r + 1:5d}  {moved / t / 1e9:9.2f}  {moved / w / 1e9:8.2f}  "
                      f"{w / t:8.2f}")
            print(f"tier/raw {min(ratios):.2f}-{max(ratios):.2f}, "
                  f"median {statistics.median(ratios):.2f}")
            pool.shutdown()
        finally:
            await tier.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-kib", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=8,
                        help="loads of each path per round, alternating which goes first")
    parser.add_argument("--engine-owned", action="store_true",
                        help="pages an engine owns: the tier's loads go through its staging")
    anyio.run(main, parser.parse_args())
