"""Store then load N bytes of blocks through the nvme tier, and the same bytes with plain
`os.pwrite`/`os.pread` in a thread pool of the same width, in one run.

    python tiers/nvme/bench_nvme.py                      # 1GiB of 1MiB blocks, width 8
    python tiers/nvme/bench_nvme.py --total 256MiB --fsync never --reps 5

Until `tierkv bench` exists this is how the tier's speed is shown: as a ratio to the
raw medium measured in the same run (never as a timed test). Per repetition and fsync
mode it runs, in turn:

- raw: every block `os.pwrite` into one new file at its offset (then
  `fdatasync` when fsync is on: the same per-block durability the tier gives), and
  `os.preadv` back into the same primary slots;
- files: the same with the tier's layout, one file per block (open, pwrite or
  preadv, fdatasync when fsync is on, close), without frame, temp name or rename;
- tier: `NvmeTier.store` / `NvmeTier.load` of the same slots in jobs of `--job-blocks`
  keys, all jobs submitted at once (the tier bounds its own concurrency);
- aiofiles (with `--aiofiles`): the tier's file steps written the way aiofiles offers
  them, one await per file call (open, write header, write payload, fsync, close,
  rename; open, readinto, readinto, close), to show what that costs.

The tier's fan-out directories are made before the clock starts (a tier that has run
a while has them all; `--cold-dirs` times their creation too, as for a brand-new tier:
on this VM creating a file or directory costs ~0.3 ms). Before each load phase the
files are flushed and dropped from the page cache (`posix_fadvise(DONTNEED)`, this
benchmark's files only), so loads read the disk.
Throughput is the median of the repetitions, in MB/s (10^6 bytes per second).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import torch
from pydantic import ByteSize, TypeAdapter
from tierkv_nvme import NvmeTier, NvmeTierConfig
from tierkv_nvme.layout import block_path, namespace_dir, temp_path

from tierkv import JobMetadata, PrimaryView, make_offload_key
from tierkv.contract.framing import encode_header, header_bytes, parse_header, verify_payload
from tierkv.primary import PrimaryTier

NAMESPACE = "bench-nvme"


class Timing:
    """Wall-clock and CPU seconds (user + system, all threads of this process) of one
    phase. CPU per block is the steadier number on a shared, noisy machine."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0
        self._start = (0.0, 0.0)

    @staticmethod
    def _cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    def __enter__(self) -> Timing:
        self._start = (time.perf_counter(), self._cpu())
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._start[0]
        self.cpu = self._cpu() - self._start[1]


def _drop_cache(paths: Sequence[Path]) -> None:
    """Flush and evict these files from the page cache (only these files)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.blk") if p.is_file()]


def _pool_map(width: int, func: Callable[[int], Any], n: int) -> Timing:
    with ThreadPoolExecutor(width) as pool, Timing() as timing:
        list(pool.map(func, range(n)))
    return timing


def run_raw(
    work: Path, view: PrimaryView, n: int, width: int, fsync: bool
) -> tuple[Timing, Timing]:
    block = view.block_bytes
    path = work / "raw.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:

        def write(i: int) -> None:
            os.pwrite(fd, view.block(i), i * block)
            if fsync:
                os.fdatasync(fd)

        def read(i: int) -> None:
            os.preadv(fd, [view.block(i)], i * block)

        write_s = _pool_map(width, write, n)
        _drop_cache([path])
        read_s = _pool_map(width, read, n)
    finally:
        os.close(fd)
        path.unlink()
    return write_s, read_s


def run_files(
    work: Path, view: PrimaryView, n: int, width: int, fsync: bool
) -> tuple[Timing, Timing]:
    """Plain file I/O with the tier's file layout: one file per block, no frame."""
    block_dir = work / "files"
    block_dir.mkdir()
    paths = [block_dir / f"{i}.blk" for i in range(n)]

    def write(i: int) -> None:
        fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(fd, view.block(i), 0)
            if fsync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def read(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            os.preadv(fd, [view.block(i)], 0)
        finally:
            os.close(fd)

    try:
        write_s = _pool_map(width, write, n)
        _drop_cache(paths)
        read_s = _pool_map(width, read, n)
    finally:
        shutil.rmtree(block_dir)
    return write_s, read_s


def _make_dirs(paths: Sequence[Path]) -> None:
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)


async def run_tier(
    work: Path, view: PrimaryView, n: int, width: int, fsync: bool, job_blocks: int, warm: bool
) -> tuple[Timing, Timing]:
    block = view.block_bytes
    config = NvmeTierConfig(
        type="nvme",
        path=work / "tier",
        capacity=ByteSize(2 * n * (block + 8192)),
        io_concurrency=width,
        fsync="always" if fsync else "never",
    )
    tier = NvmeTier(config, view)
    await tier.open()
    keys = [make_offload_key(os.urandom(16), 0) for _ in range(n)]
    jobs = [
        JobMetadata(i, tuple(keys[i : i + job_blocks]), tuple(range(i, min(n, i + job_blocks))))
        for i in range(0, n, job_blocks)
    ]

    async def run_all(op: Callable[[JobMetadata], Any]) -> Timing:
        failed: list[int] = []

        async def one(job: JobMetadata) -> None:
            result = await op(job)
            failed.extend([job.job_id] if not result.ok else [])

        with Timing() as timing:
            async with anyio.create_task_group() as tg:
                for job in jobs:
                    tg.start_soon(one, job)
        if failed:
            raise RuntimeError(f"tier jobs failed: {failed[:5]}")
        return timing

    if warm:
        await anyio.to_thread.run_sync(_make_dirs, [tier.path_of(k) for k in keys])
    try:
        write_s = await run_all(tier.store)
        await anyio.to_thread.run_sync(_drop_cache, _files(tier.directory))
        read_s = await run_all(tier.load)
    finally:
        await tier.close()
        shutil.rmtree(work / "tier")
    return write_s, read_s


async def run_aiofiles(
    work: Path, view: PrimaryView, n: int, width: int, fsync: bool, warm: bool
) -> tuple[Timing, Timing]:
    """The tier's file steps as one aiofiles await per file call (for comparison)."""
    import aiofiles
    import aiofiles.os

    root = namespace_dir(work / "aio", NAMESPACE)
    keys = [make_offload_key(os.urandom(16), 0) for _ in range(n)]
    pool = ThreadPoolExecutor(width)
    limit = asyncio.Semaphore(width)
    fdatasync = aiofiles.os.wrap(os.fdatasync)

    async def write(i: int) -> None:
        async with limit:
            path = block_path(root, keys[i])
            await aiofiles.os.makedirs(path.parent, exist_ok=True, executor=pool)
            payload = view.block(i)
            header = encode_header(keys[i], payload, NAMESPACE)
            tmp = temp_path(path)
            async with aiofiles.open(tmp, "wb", buffering=0, executor=pool) as f:
                for part in (memoryview(header), payload):
                    while part:
                        part = part[await f.write(part) :]
                if fsync:
                    await fdatasync(f.fileno(), executor=pool)
            await aiofiles.os.rename(tmp, path, executor=pool)

    async def read(i: int) -> None:
        async with limit:
            head = bytearray(header_bytes(keys[i]))
            dest = view.block(i)
            async with aiofiles.open(
                block_path(root, keys[i]), "rb", buffering=0, executor=pool
            ) as f:
                await f.readinto(head)
                await f.readinto(dest)
            verify_payload(parse_header(bytes(head), NAMESPACE), dest)

    async def run_all(op: Callable[[int], Any]) -> Timing:
        with Timing() as timing:
            await asyncio.gather(*(op(i) for i in range(n)))
        return timing

    if warm:
        await asyncio.to_thread(_make_dirs, [block_path(root, k) for k in keys])
    try:
        write_s = await run_all(write)
        await asyncio.to_thread(_drop_cache, _files(root))
        read_s = await run_all(read)
    finally:
        pool.shutdown()
        shutil.rmtree(work / "aio")
    return write_s, read_s


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="where to write (default: a temporary directory in /tmp)")
    parser.add_argument("--total", default="1GiB", help="bytes per phase (default 1GiB)")
    parser.add_argument("--block", default="1MiB", help="block size (default 1MiB)")
    parser.add_argument("--width", type=int, default=8, help="threads / io_concurrency")
    parser.add_argument("--job-blocks", type=int, default=32, help="keys per tier job")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (median is reported)")
    parser.add_argument("--fsync", default="never,always", help="modes: never, always or both")
    parser.add_argument("--aiofiles", action="store_true", help="also time the aiofiles variant")
    parser.add_argument(
        "--cold-dirs",
        action="store_true",
        help="time the creation of the fan-out directories too (a brand-new tier); by "
        "default they are made before the clock starts, as on a tier that has been "
        "running a while",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)

    sizes = TypeAdapter(ByteSize)
    block = int(sizes.validate_python(args.block))
    n = int(sizes.validate_python(args.total)) // block
    modes = [m.strip() for m in args.fsync.split(",")]
    warm = not args.cold_dirs
    torch.set_num_threads(1)
    primary = PrimaryTier(n, block, pin_memory=False, namespace=NAMESPACE)
    view = primary.view
    pattern = os.urandom(block)
    for i in range(n):  # distinct blocks without paying for 1 GiB of urandom
        view.block(i)[:] = pattern
        view.block(i)[:8] = i.to_bytes(8, "little")

    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-nvme-", dir=base))
    variants = ["raw", "files", "tier", *(["aiofiles"] if args.aiofiles else [])]
    times: dict[tuple[str, str, str], list[Timing]] = {}
    try:
        for _rep in range(args.reps):
            for mode in modes:
                fsync = mode == "always"
                for variant in variants:
                    if variant == "raw":
                        w, r = run_raw(work, view, n, args.width, fsync)
                    elif variant == "files":
                        w, r = run_files(work, view, n, args.width, fsync)
                    elif variant == "tier":
                        w, r = anyio.run(
                            run_tier, work, view, n, args.width, fsync, args.job_blocks, warm
                        )
                    else:
                        w, r = asyncio.run(run_aiofiles(work, view, n, args.width, fsync, warm))
                    times.setdefault((mode, variant, "store"), []).append(w)
                    times.setdefault((mode, variant, "load"), []).append(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    total = n * block
    mbps = {k: total / statistics.median(t.wall for t in v) / 1e6 for k, v in times.items()}
    cpu_us = {k: statistics.median(t.cpu for t in v) / n * 1e6 for k, v in times.items()}
    measured = [v for v in variants if v not in ("raw", "files")]
    rows = []
    for mode in modes:
        for op in ("store", "load"):
            row: dict[str, Any] = {"fsync": mode, "op": op}
            for variant in variants:
                row[variant] = round(mbps[(mode, variant, op)])
                row[f"{variant} cpu us/block"] = round(cpu_us[(mode, variant, op)])
            for variant in measured:
                for base_variant in ("raw", "files"):
                    row[f"{variant}/{base_variant}"] = round(row[variant] / row[base_variant], 2)
            row["runs"] = {
                v: [round(total / t.wall / 1e6) for t in times[(mode, v, op)]] for v in variants
            }
            rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    dirs = "created in the timed store" if args.cold_dirs else "made beforehand"
    print(
        f"nvme tier vs plain file I/O: {n} blocks of {block >> 10} KiB ({total / 2**30:.2f} GiB) "
        f"per phase, width {args.width}, {args.reps} reps, median MB/s, under {base}, "
        f"fan-out directories {dirs}"
    )
    print("  raw = os.pwrite/os.preadv into one file; files = the same, one file per block")
    ratios = [f"{v}/{b}" for v in measured for b in ("raw", "files")]
    columns = [*variants, *ratios]
    widths = [max(10, len(c) + 2) for c in columns]
    print(f"{'fsync':<7}{'op':<6}" + "".join(f"{c:>{w}}" for c, w in zip(columns, widths)))
    for row in rows:
        cells = [str(row[c]) for c in columns]
        print(
            f"{row['fsync']:<7}{row['op']:<6}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths))
        )
    print("CPU per block, microseconds (user + system, all threads), median:")
    print(f"{'fsync':<7}{'op':<6}" + "".join(f"{v:>10}" for v in variants))
    for row in rows:
        cells = [str(row[f"{v} cpu us/block"]) for v in variants]
        print(f"{row['fsync']:<7}{row['op']:<6}" + "".join(f"{c:>10}" for c in cells))
    for row in rows:
        print(f"  MB/s of each run, {row['fsync']}/{row['op']}: {row['runs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
