"""The nvme tier alone, one line per run, for before/after pairs across two trees.

Store then load N blocks (8,192, or 512 MiB of large ones) in jobs of 128 blocks (8 of
8 MiB), 4 jobs at once, the slab filled with data first, `fsync: never`, `io_engine:
auto`; under /dev/shm the loads read the page cache, elsewhere the files are synced
and dropped from it first (cold loads). Each tree's default layout (slab since
2026-11-29, a file per block before). It imports only what every tree since the
nvme tier's jobs API has, so the same file measures an older checkout:

    for tree in /path/to/old /path/to/new; do
        PYTHONPATH=$tree:$tree/tiers/nvme python benchmarks/nvme_tier_ab.py 64 /dev/shm $tree
    done

Arguments: block KiB, directory, a label. Prints GB/s and CPU µs per block (the
process's user + system time over the blocks).
"""

import asyncio
import os
import resource
import shutil
import sys
import time
from pathlib import Path

from tierkv_nvme import NvmeTier, NvmeTierConfig

from tierkv.contract.jobs import JobMetadata
from tierkv.primary import PrimaryTier
from tierkv.testing import random_keys


def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


async def main(kib, where, label):
    block = kib << 10
    batch = 128 if kib < 4096 else 8
    jobs = 4
    n = max(batch * jobs, min(8192, (512 << 10) // kib))
    primary = PrimaryTier(batch * jobs, block, pin_memory=False, namespace="ab")
    primary.view._bytes[:] = os.urandom(256) * (batch * jobs * block // 256)
    path = Path(where) / f"tierab-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    tier = NvmeTier(
        NvmeTierConfig(
            type="nvme", path=path, capacity=4 * n * block, io_engine="auto", fsync="never"
        ),
        primary.view,
    )
    await tier.open()
    keys = random_keys(n)
    ids = iter(range(1, 10**9))

    async def run(verb):
        async def lane(c):
            slots = tuple(range(c * batch, (c + 1) * batch))
            for i in range(c * batch, n, jobs * batch):
                j = JobMetadata(next(ids), tuple(keys[i : i + batch]), slots)
                r = await (tier.store(j) if verb == "store" else tier.load(j))
                assert r.ok, r.error

        c, w = cpu(), time.perf_counter()
        await asyncio.gather(*(lane(c) for c in range(jobs)))
        w = time.perf_counter() - w
        c = cpu() - c
        return n * block / w / 1e9, c / n * 1e6

    s = await run("store")
    if not where.startswith("/dev/shm"):  # cold loads from the disk
        os.sync()
        for p in path.rglob("*"):  # block files or slab files
            if not p.is_file() or not p.name.endswith((".blk", ".kvslab")):
                continue
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    ld = await run("load")
    await tier.close()
    shutil.rmtree(path, ignore_errors=True)
    print(
        f"{label:6s} {where:9s} {kib:5d}K  store {s[0]:5.2f} GB/s {s[1]:7.1f} us/blk  "
        f"load {ld[0]:5.2f} GB/s {ld[1]:7.1f} us/blk",
        flush=True,
    )


asyncio.run(main(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
