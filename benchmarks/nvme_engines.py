"""The nvme tier alone (no cache around it), Python path against the compiled core,
beside the native reference in the same run: store then load N blocks in jobs of
--batch blocks, --concurrency jobs at once, the tier's files under --path (default
/dev/shm: no disk limit), engines and reference interleaved, round by round.

    .venv/bin/python benchmarks/nvme_engines.py [--block-kib 16,64,1024] [--rounds 3] \
        [--engines python,native,native-slab,native-slab-direct,native-slab-mac] [--cold]

Prints GB/s and CPU µs per block (the process's user + system time over the blocks
moved: event loop, worker threads and the core's own threads) per engine and round,
the event loop's own CPU µs per block (store/load: the tier's Python, which one thread
runs for every core thread, so what bounds it on a many-core machine), and the
reference's (`tierkv_nvme.reference`: the same number of block files written
and read by plain C, open + pwrite|pread + close each, --ref-threads threads), with
the native engine's ratio to it.

Engines: `python` and `native` (`io_engine`), a `-slab` suffix for `layout: slab` (else
`files`), then `-direct` for `direct: true` (O_DIRECT), `-mac` for frames signed with a
keyed MAC (`mac_key_env`, a random secret). `--threads N` runs the tier on N threads in
all (`io_concurrency: N`, N jobs at once, each core call on one thread) and the
reference on N: the scaling a many-core machine shows (`--threads 1` against 8).
`--cold` (on a disk, not tmpfs) adds, after the stores, `sync` timed with them
(synced GB/s: a buffered store's bytes are on the disk only then; the kernel's flusher
threads' CPU is not the process's),
and after the warm loads a second load of the same blocks with the tier's files
dropped from the page cache first (`POSIX_FADV_DONTNEED` on each: only this run's
files leave the cache, not a neighbour's as `drop_caches` would).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import time
from pathlib import Path

import anyio
from tierkv_nvme import NvmeTier, NvmeTierConfig, native
from tierkv_nvme.reference import run_reference

from tierkv.contract.jobs import JobMetadata
from tierkv.primary import PrimaryTier
from tierkv.testing import random_keys


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def drop_from_cache(path: Path) -> None:
    """The tier's block or slab files out of the page cache (synced first)."""
    os.sync()
    for file in path.rglob("*"):
        if file.is_file() and file.name.endswith((".blk", ".kvslab")):
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


_MAC_ENV = "TIERKV_BENCH_NVME_MAC"
os.environ.setdefault(_MAC_ENV, os.urandom(32).hex())


async def one_round(
    engine: str, args: argparse.Namespace, block_kib: int, n: int
) -> tuple[tuple[float, ...], tuple[float, float]]:
    """(store GB/s, CPU, load GB/s, CPU[, synced, cold GB/s, cold CPU]), and the event
    loop's CPU µs per block (store, load)."""
    block, batch, jobs = block_kib << 10, args.batch, args.threads or args.concurrency
    primary = PrimaryTier(batch * jobs, block, pin_memory=False, namespace="nvme-engines")
    # KV data, as a server's slab holds: untouched memory would cost the first store a
    # page fault per 4 KiB read (1 MiB blocks: ~2.5x the CPU), which no server pays
    primary.view._bytes[:] = os.urandom(256) * (primary.view.num_blocks * block // 256)
    path = Path(args.path) / f"tierkv-nvme-engines-{engine}"
    shutil.rmtree(path, ignore_errors=True)
    io_engine, *rest = engine.split("-")  # "native-slab-direct": slab, O_DIRECT
    config = NvmeTierConfig(
        type="nvme",
        path=path,
        capacity=4 * n * (block + 8192),
        io_engine=io_engine,
        fsync="never",
        layout="slab" if "slab" in rest else "files",
        direct="direct" in rest,
        mac_key_env=_MAC_ENV if "mac" in rest else None,
        **({"io_concurrency": args.threads} if args.threads else {}),
    )
    tier = NvmeTier(config, primary.view)
    await tier.open()
    keys = random_keys(n)
    ids = iter(range(1, 10**9))

    async def run(verb: str) -> tuple[float, float, float]:
        async def lane(c: int) -> None:
            slots = tuple(range(c * batch, (c + 1) * batch))
            for i in range(c * batch, n, jobs * batch):
                job = JobMetadata(next(ids), tuple(keys[i : i + batch]), slots)
                result = await (tier.store(job) if verb == "store" else tier.load(job))
                assert result.ok, result.error

        cpu, wall, loop = cpu_seconds(), time.perf_counter(), time.thread_time()
        async with anyio.create_task_group() as tg:
            for c in range(jobs):
                tg.start_soon(lane, c)
        wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
        return n * block / wall / 1e9, cpu / n * 1e6, (time.thread_time() - loop) / n * 1e6

    try:
        wall = time.perf_counter()
        *store, store_loop = await run("store")
        if args.cold:
            os.sync()  # a buffered store's bytes reach the disk here
            synced = n * block / (time.perf_counter() - wall) / 1e9
        *load, load_loop = await run("load")
        if args.cold:
            drop_from_cache(path)
            *cold, _ = await run("load")
    finally:
        await tier.close()
        shutil.rmtree(path, ignore_errors=True)
    loops = (store_loop, load_loop)
    return ((*store, *load, synced, *cold) if args.cold else (*store, *load)), loops


def reference(args: argparse.Namespace, block_kib: int, blocks: int) -> tuple[float, ...]:
    write, read = run_reference(
        Path(args.path) / "tierkv-nvme-engines-reference", blocks, block_kib << 10, args.ref_threads
    )
    return write.gb_per_s, write.cpu_us_per_block, read.gb_per_s, read.cpu_us_per_block


async def main(args: argparse.Namespace) -> None:
    engines = [e for e in args.engines.split(",") if e]
    if args.threads:  # N threads in all: one per core call
        native.MAX_DEFAULT_THREADS = 1
        args.concurrency = args.threads
        args.ref_threads = args.ref_threads or args.threads
    print(
        f"nvme tier alone: jobs of {args.batch}, {args.concurrency} at once, under {args.path}; "
        f"reference: plain C, {args.ref_threads} threads"
    )
    print(
        "block  engine             round  store GB/s  store CPU us/blk  load GB/s  load CPU us/blk"
        + ("  synced GB/s  cold load GB/s  cold CPU us/blk" if args.cold else "")
        + "  store/ref  load/ref  loop us/blk st/ld"
    )
    for block_kib in (int(k) for k in str(args.block_kib).split(",")):
        n = args.blocks or max(args.batch * args.concurrency, min(8192, (512 << 10) // block_kib))
        args.blocks_now = n
        for r in range(args.rounds):
            ref = reference(args, block_kib, n)
            rows: list[tuple[str, tuple[float, ...], tuple[float, float] | None]] = [
                ("reference", ref, None)
            ]
            for engine in engines:
                rows.append((engine, *await one_round(engine, args, block_kib, n)))
            for name, (sg, sc, lg, lc, *cold), loops in rows:
                ratio = "" if loops is None else (
                    f"  {sg / ref[0]:9.2f}  {lg / ref[2]:8.2f}  {loops[0]:8.2f}/{loops[1]:.2f}"
                )  # fmt: skip
                after = "" if not args.cold else (
                    f"  {'':11s}  {'':14s}  {'':15s}" if not cold
                    else f"  {cold[0]:11.2f}  {cold[1]:14.2f}  {cold[2]:15.1f}"
                )  # fmt: skip
                print(
                    f"{block_kib:4d}K  {name:18s} {r + 1:5d}  {sg:10.2f}  {sc:16.1f}  {lg:9.2f}"
                    f"  {lc:15.1f}{after}{ratio}",
                    flush=True,
                )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-kib", default="64", help="block sizes in KiB, comma separated")
    parser.add_argument(
        "--blocks", type=int, default=0, help="blocks per round (0: 8192 or 512 MiB)"
    )
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--engines",
        default="python,native",
        help="of python, native, python-slab, native-slab (the slab layout), "
        "native-slab-direct (the slab with O_DIRECT); -mac after any: signed frames",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="also time sync after the stores and a load with the files dropped from the "
        "page cache (a disk, not tmpfs)",
    )
    parser.add_argument("--ref-threads", type=int, default=0, help="(default 2, or --threads)")
    parser.add_argument(
        "--threads", type=int, default=0, help="the tier's threads in all (0: its defaults)"
    )
    parser.add_argument("--path", default="/dev/shm")
    parsed = parser.parse_args()
    parsed.ref_threads = parsed.ref_threads or (0 if parsed.threads else 2)
    anyio.run(main, parsed)
