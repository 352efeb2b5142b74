"""How long the nvme tier's `open` takes to rebuild its index after a restart: a slab
tier of --blocks blocks is filled once, closed, then opened again --rounds times per
engine, warm (the slab files' header pages in the page cache) and cold (the files
dropped from the page cache first, as after a reboot: `POSIX_FADV_DONTNEED` on each
slab file, so only this run's pages leave the cache).

    .venv/bin/python benchmarks/nvme_reopen.py [--blocks 65536] [--block-kib 16] \
        [--path /var/tmp] [--engines native,python] [--rounds 3]

Prints seconds per open and µs per block (the rebuild reads one header page per slot:
on a cold disk that read is most of it), and checks that every block is found again.
Use a directory on a real disk; on tmpfs "cold" is warm.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import anyio
from tierkv_nvme import NvmeTier, NvmeTierConfig

from tierkv.contract.jobs import JobMetadata
from tierkv.primary import PrimaryTier
from tierkv.testing import random_keys

BATCH = 128


def drop_from_cache(path: Path) -> None:
    """The slab files' pages (under `path`, in the namespace's directory) out of the
    page cache (synced first)."""
    os.sync()
    for file in path.rglob("slots-*.kvslab"):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def config(args: argparse.Namespace, path: Path, engine: str, block: int) -> NvmeTierConfig:
    return NvmeTierConfig(
        type="nvme",
        path=path,
        capacity=args.blocks * (block + 8192),
        io_engine=engine,
        fsync="never",
        layout="slab",
    )


async def fill(args: argparse.Namespace, path: Path, primary: PrimaryTier, block: int) -> None:
    tier = NvmeTier(config(args, path, "auto", block), primary.view)
    await tier.open()
    keys = random_keys(args.blocks)
    try:
        for at in range(0, args.blocks, BATCH):
            chunk = tuple(keys[at : at + BATCH])
            result = await tier.store(JobMetadata(at + 1, chunk, tuple(range(len(chunk)))))
            assert result.ok, result.error
    finally:
        await tier.close()


async def reopen(
    args: argparse.Namespace, path: Path, primary: PrimaryTier, engine: str, block: int
) -> float:
    tier = NvmeTier(config(args, path, engine, block), primary.view)
    started = time.perf_counter()
    await tier.open()
    took = time.perf_counter() - started
    try:
        found = tier.describe()["blocks"]
        assert found == args.blocks, f"{engine}: {found} of {args.blocks} blocks found"
    finally:
        await tier.close()
    return took


async def main(args: argparse.Namespace) -> None:
    block = args.block_kib << 10
    path = Path(args.path) / "tierkv-nvme-reopen"
    shutil.rmtree(path, ignore_errors=True)
    primary = PrimaryTier(BATCH, block, pin_memory=False, namespace="nvme-reopen")
    primary.view._bytes[:] = os.urandom(256) * (BATCH * block // 256)
    try:
        await fill(args, path, primary, block)
        print(
            f"nvme tier open (slab index rebuild), {args.blocks} blocks of {args.block_kib} KiB "
            f"under {args.path}"
        )
        print("engine    round  warm s  warm us/blk  cold s  cold us/blk")
        for r in range(args.rounds):
            for engine in args.engines.split(","):
                warm = await reopen(args, path, primary, engine, block)
                drop_from_cache(path)
                cold = await reopen(args, path, primary, engine, block)
                n = args.blocks
                print(
                    f"{engine:8s}  {r + 1:5d}  {warm:6.2f}  {warm / n * 1e6:11.1f}"
                    f"  {cold:6.2f}  {cold / n * 1e6:11.1f}",
                    flush=True,
                )
    finally:
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=65536)
    parser.add_argument("--block-kib", type=int, default=16)
    parser.add_argument("--path", default="/var/tmp")
    parser.add_argument("--engines", default="native,python")
    parser.add_argument("--rounds", type=int, default=3)
    anyio.run(main, parser.parse_args())
