"""`tierkv bench`: how fast tierkv moves blocks through each tier of a chain, as a
ratio to the raw medium measured in the same run, and what the orchestrator costs.

For each medium of the chain (the primary `cpu`, then every secondary tier on its
own, behind a primary of its own):

- tierkv: `--concurrency` `TieredCache.store` calls of `--batch` blocks in flight
  until `total` bytes are stored, then `flush()` (for a secondary tier: until every
  block reached it); then the primary is emptied and the same blocks are loaded back
  the same way (for a secondary tier: every block is promoted from it). The cache is
  opened fresh for every repetition; the tier's section of the chain is used as
  written, except `write_policy: write_through` and a `max_inflight_bytes` large
  enough that nothing is dropped.
- raw: the same bytes in the same batches through the medium's plain client with the
  tier's own concurrency (`io_concurrency`, `max_connections`, `max_concurrency`):
  torch `copy_` for the primary, `os.pwrite`/`os.pread` in a thread pool for `nvme`,
  concurrent redis-py SET/GET for `redis`, s3fs `_pipe_file`/`_cat_file` for `s3`.
  A tier of another type (a plugin) is measured without a ratio.

Throughput is MB/s (10^6 bytes per second); each figure is the median of the
repetitions, with the spread (min..max). Latency percentiles are per batch: for the
tierkv store to a secondary tier the tier's job latency (`stats()`), otherwise the
call as the caller sees it. Loads from disk read the disk: before each load phase
the files of both sides are dropped from the page cache (`posix_fadvise`).

The orchestrator's own cost: a primary of `--keys` tiny blocks filled to the brim,
with a `memory` tier behind it that never receives a block (selective write policy
with an unreachable hit count) so nothing but bookkeeping runs; then lookups of
resident and of unknown keys, and loads, `--lookup-batch` keys per call.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import torch
from pydantic import ByteSize

from tierkv.bench_integrity import bench_integrity, integrity_summary
from tierkv.blocks import HostBlocks
from tierkv.cache import TieredCache
from tierkv.config import CacheConfig
from tierkv.demo.report import Block, TextTable
from tierkv.jobs import JobMetadata
from tierkv.keys import OffloadKey, make_offload_key
from tierkv.layout import GroupSpec, KVLayout
from tierkv.memory_tier import MemoryTierConfig
from tierkv.primary import MEDIUM as PRIMARY_MEDIUM
from tierkv.primary import HostSlab, PrimaryConfig
from tierkv.stats import percentile
from tierkv.tier import SecondaryTierManager, TierConfig
from tierkv.units import format_size

BLOCK_TOKENS = 16  # tokens per block in the bench layout (any value works)


@dataclass(frozen=True)
class BenchOptions:
    block_bytes: int = 1 << 20
    total_bytes: int = 256 << 20
    batch: int = 8
    concurrency: int = 8
    repeat: int = 3
    media: tuple[str, ...] | None = None  # which media to measure; None: all
    orchestrator_keys: int = 1_000_000  # 0: skip the orchestrator measurement
    lookup_batch: int = 128
    seed: int = 0
    # the streaming phase (a chain with an nvme tier): one request of `streaming_bytes`
    # (default 4 x total_bytes: 1 GiB) through a primary of `streaming_primary_bytes`
    # (default total_bytes / 4: 64 MiB); 0 skips it
    streaming_bytes: int | None = None
    streaming_primary_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_bytes", "batch", "concurrency", "repeat", "lookup_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.total_bytes < self.block_bytes:
            raise ValueError(
                f"total {format_size(self.total_bytes)} is less than one block of "
                f"{format_size(self.block_bytes)}"
            )
        if self.orchestrator_keys and self.orchestrator_keys < self.lookup_batch:
            raise ValueError(
                f"orchestrator keys ({self.orchestrator_keys}) must be 0 (skip) or at least "
                f"one lookup batch ({self.lookup_batch})"
            )

    @property
    def num_blocks(self) -> int:
        return self.total_bytes // self.block_bytes

    @property
    def streaming_blocks(self) -> int:
        total = 4 * self.total_bytes if self.streaming_bytes is None else self.streaming_bytes
        return total // self.block_bytes

    @property
    def streaming_primary_blocks(self) -> int:
        size = (
            self.total_bytes // 4
            if self.streaming_primary_bytes is None
            else self.streaming_primary_bytes
        )
        return max(4, size // self.block_bytes)


# -- driving batches --------------------------------------------------------------------
Batch = tuple[int, int]  # [start, end) block indices


def _batches(n: int, size: int) -> list[Batch]:
    return [(i, min(n, i + size)) for i in range(0, n, size)]


async def _drive(
    batches: Sequence[Batch], concurrency: int, op: Callable[[int, int], Awaitable[None]]
) -> tuple[float, list[float]]:
    """Run `op` over `batches` with `concurrency` in flight; (seconds, per-batch seconds)."""
    latencies: list[float] = []
    pending: Iterator[Batch] = iter(batches)

    async def worker() -> None:
        for start, end in pending:
            t0 = time.perf_counter()
            await op(start, end)
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(min(concurrency, len(batches))):
            tg.start_soon(worker)
    return time.perf_counter() - t0, latencies


@dataclass(frozen=True)
class _Timing:
    """One phase of one repetition: wall seconds and per-batch latency percentiles."""

    seconds: float
    p50: float
    p99: float

    @classmethod
    def of(cls, seconds: float, latencies: Sequence[float]) -> _Timing:
        return cls(seconds, percentile(latencies, 0.5), percentile(latencies, 0.99))


def _summary(nbytes: int, timings: Sequence[_Timing]) -> dict[str, Any]:
    """Median MB/s with its spread, and median latency percentiles, over repetitions."""
    mbps = [nbytes / t.seconds / 1e6 for t in timings]
    return {
        "MBps": statistics.median(mbps),
        "spread": [min(mbps), max(mbps)],
        "p50_ms": statistics.median(t.p50 for t in timings) * 1e3,
        "p99_ms": statistics.median(t.p99 for t in timings) * 1e3,
    }


# -- raw baselines ------------------------------------------------------------------------
def _row(t: torch.Tensor, i: int) -> memoryview:
    return memoryview(t[i].numpy())  # type: ignore[arg-type]


class RawMedium:
    """The plain client of a medium, moving the same batches as tierkv: by default
    each block of a batch on its own, at most `width` blocks in flight across all
    batches (the tier's own concurrency setting). Subclasses implement `put` and
    `get` (or `store` and `load` for whole batches)."""

    description = ""

    def __init__(self, width: int) -> None:
        self.width = width
        self.gate = anyio.Semaphore(width)

    async def put(self, i: int, row: memoryview) -> None:
        raise NotImplementedError

    async def get(self, i: int, row: memoryview) -> None:
        raise NotImplementedError

    async def _each(
        self, batch: Batch, t: torch.Tensor, fn: Callable[[int, memoryview], Awaitable[None]]
    ) -> None:
        async def one(i: int) -> None:
            async with self.gate:
                await fn(i, _row(t, i))

        async with anyio.create_task_group() as tg:
            for i in range(*batch):
                tg.start_soon(one, i)

    async def store(self, data: torch.Tensor, batch: Batch) -> None:
        await self._each(batch, data, self.put)

    async def load(self, out: torch.Tensor, batch: Batch) -> None:
        await self._each(batch, out, self.get)

    async def open(self) -> None:
        pass

    async def before_load(self, tier: SecondaryTierManager | None) -> None:
        """Make the next load (raw, or `tier`'s when given) read the medium."""

    async def cleanup(self, n: int) -> None:
        pass

    async def close(self) -> None:
        pass


class RawMemcpy(RawMedium):
    """The primary's medium: host memory, one `copy_` of each batch into a slab."""

    description = "torch copy_"

    def __init__(self, num_blocks: int, block_bytes: int) -> None:
        super().__init__(1)
        self.slab = torch.zeros((num_blocks, block_bytes), dtype=torch.uint8)

    async def store(self, data: torch.Tensor, batch: Batch) -> None:
        self.slab[batch[0] : batch[1]].copy_(data[batch[0] : batch[1]])

    async def load(self, out: torch.Tensor, batch: Batch) -> None:
        out[batch[0] : batch[1]].copy_(self.slab[batch[0] : batch[1]])


def _drop_page_cache(paths: Sequence[Path]) -> None:
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


class RawFile(RawMedium):
    """`nvme`'s medium: one file, `os.pwrite`/`os.preadv` at block offsets in worker
    threads, the tier's `io_concurrency` at a time; `fdatasync` after each block when
    the tier has `fsync: always` (the durability the tier gives each block)."""

    def __init__(self, tier: Any, block_bytes: int) -> None:  # an NvmeTierConfig
        super().__init__(int(getattr(tier, "io_concurrency", 8)))
        self.fsync = getattr(tier, "fsync", "always") == "always"
        self.block_bytes = block_bytes
        self.description = f"os.pwrite/os.pread, {self.width} threads" + (
            ", fdatasync per block" if self.fsync else ""
        )
        self.directory = Path(str(tier.path))
        self.path = self.directory / f".tierkv-bench-raw-{os.getpid()}"
        self.fd = -1

    async def open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)

    def _write(self, row: memoryview, offset: int) -> None:
        os.pwrite(self.fd, row, offset)
        if self.fsync:
            os.fdatasync(self.fd)

    def _read(self, row: memoryview, offset: int) -> None:
        if os.preadv(self.fd, [row], offset) != len(row):
            raise OSError(f"short read at offset {offset} of {self.path}")

    async def put(self, i: int, row: memoryview) -> None:
        await anyio.to_thread.run_sync(self._write, row, i * self.block_bytes)

    async def get(self, i: int, row: memoryview) -> None:
        await anyio.to_thread.run_sync(self._read, row, i * self.block_bytes)

    async def before_load(self, tier: SecondaryTierManager | None) -> None:
        if tier is None:
            paths = [self.path]
        else:  # the nvme tier's directory for this namespace
            root = Path(str(getattr(tier, "directory", self.directory)))
            paths = [p for p in root.rglob("*") if p.is_file()]
        await anyio.to_thread.run_sync(_drop_page_cache, paths)

    async def cleanup(self, n: int) -> None:
        os.ftruncate(self.fd, 0)

    async def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.path.unlink(missing_ok=True)


class RawRedis(RawMedium):
    """`redis`'s medium: plain redis-py, one SET/GET per block, the tier's
    `max_connections` in flight (concurrent single commands: faster than pipelines
    for MiB-sized values on this kind of machine)."""

    def __init__(self, tier: Any) -> None:  # a RedisTierConfig
        super().__init__(int(getattr(tier, "max_connections", 16)))
        self.tier = tier
        self.description = f"redis-py SET/GET, {self.width} in flight"
        self.prefix = f"tierkv-bench-raw:{os.getpid()}:"
        self.client: Any = None

    async def open(self) -> None:
        aioredis: Any = importlib.import_module("redis.asyncio")
        password = getattr(self.tier, "password", None)
        self.client = aioredis.Redis.from_url(
            str(self.tier.url),
            password=password.get_secret_value() if password is not None else None,
            max_connections=self.width,
        )

    async def put(self, i: int, row: memoryview) -> None:
        await self.client.set(f"{self.prefix}{i}", row)

    async def get(self, i: int, row: memoryview) -> None:
        row[:] = await self.client.get(f"{self.prefix}{i}")

    async def cleanup(self, n: int) -> None:
        names = [f"{self.prefix}{i}" for i in range(n)]
        for start in range(0, n, 1000):
            await self.client.delete(*names[start : start + 1000])

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()


class RawS3(RawMedium):
    """`s3`'s medium: plain s3fs `_pipe_file`/`_cat_file`, one object per block, the
    tier's `max_concurrency` in flight, same endpoint and credentials."""

    def __init__(self, tier: Any) -> None:  # an S3TierConfig
        super().__init__(int(getattr(tier, "max_concurrency", 16)))
        self.tier = tier
        self.description = f"s3fs put/get, {self.width} in flight"
        root = f"{tier.bucket}/{tier.prefix}".rstrip("/")
        self.root = f"{root}/tierkv-bench-raw-{os.getpid()}"
        self.fs: Any = None
        self.session: Any = None

    async def open(self) -> None:
        s3fs: Any = importlib.import_module("s3fs")
        t = self.tier
        kwargs: dict[str, Any] = {}
        if t.access_key_id is not None:
            kwargs["key"] = t.access_key_id
            kwargs["secret"] = t.secret_access_key.get_secret_value()
            if t.session_token is not None:
                kwargs["token"] = t.session_token.get_secret_value()
        if t.profile is not None:
            kwargs["profile"] = t.profile
        self.fs = s3fs.S3FileSystem(
            asynchronous=True,
            skip_instance_cache=True,
            endpoint_url=t.endpoint_url,
            client_kwargs={"region_name": t.region} if t.region else {},
            config_kwargs={  # like the tier: the bytes carry no botocore checksum
                "max_pool_connections": self.width,
                "request_checksum_calculation": "when_required",
                "response_checksum_validation": "when_required",
            },
            max_concurrency=self.width,
            **kwargs,
        )
        self.session = await self.fs.set_session()

    async def put(self, i: int, row: memoryview) -> None:
        # botocore takes bytes, not a memoryview: one copy, as the tier makes
        await self.fs._pipe_file(f"{self.root}/{i}", bytes(row))

    async def get(self, i: int, row: memoryview) -> None:
        row[:] = await self.fs._cat_file(f"{self.root}/{i}")

    async def cleanup(self, n: int) -> None:
        await self.fs._rm([f"{self.root}/{i}" for i in range(n)])

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


RAW_BASELINES: dict[str, Callable[[TierConfig, int], RawMedium]] = {
    "nvme": lambda tier, block_bytes: RawFile(tier, block_bytes),
    "redis": lambda tier, block_bytes: RawRedis(tier),
    "s3": lambda tier, block_bytes: RawS3(tier),
}
"""Raw client per tier type; a tier type not listed is measured without a ratio."""


def raw_baseline_for(tier: TierConfig, block_bytes: int) -> RawMedium | None:
    if tier.type == "redis" and getattr(tier, "cluster", False):
        return None  # a cluster needs the cluster client; no like-for-like baseline
    make = RAW_BASELINES.get(tier.type)
    return make(tier, block_bytes) if make else None


# -- one medium -------------------------------------------------------------------------
def _bench_chain(
    chain: CacheConfig,
    namespace: str,
    block_bytes: int,
    primary_blocks: int,
    tiers: Sequence[TierConfig],
    *,
    pin_memory: bool | None = None,
    **settings: Any,
) -> CacheConfig:
    """`chain` rebuilt for one measurement: its own namespace, one group of
    `block_bytes` blocks, an LRU primary of `primary_blocks` blocks (pinned as the
    chain says unless `pin_memory` is given), `tiers`, and any cache-wide `settings`."""
    return chain.model_copy(
        update={
            "namespace": namespace,
            "layout": KVLayout(
                block_bytes=ByteSize(block_bytes), groups=(GroupSpec(block_size=BLOCK_TOKENS),)
            ),
            "primary": PrimaryConfig(
                capacity=ByteSize(primary_blocks * block_bytes),
                eviction="lru",
                pin_memory=chain.primary.pin_memory if pin_memory is None else pin_memory,
            ),
            "tiers": list(tiers),
            **settings,
        }
    )


def _written_through(tier: TierConfig, inflight_bytes: int) -> TierConfig:
    """`tier` as the bench drives it: write-through, room for `inflight_bytes` in
    flight, and required (a tier that cannot open is an error here)."""
    return tier.model_copy(
        update={
            "write_policy": "write_through",
            "max_inflight_bytes": max(tier.max_inflight_bytes, ByteSize(inflight_bytes)),
            "required": True,
        }
    )


def _bench_config(
    chain: CacheConfig, tier: TierConfig | None, options: BenchOptions, namespace: str
) -> CacheConfig:
    n, block = options.num_blocks, options.block_bytes
    tiers = [] if tier is None else [_written_through(tier, n * block + block)]
    return _bench_chain(chain, namespace, block, n, tiers, promotion_reserve=1.0)


def _keys(n: int, tag: str) -> list[OffloadKey]:
    prefix = tag.encode()[:16].ljust(16, b"\0")
    return [make_offload_key(prefix + i.to_bytes(16, "big"), 0) for i in range(n)]


def empty_primary(cache: TieredCache) -> int:
    """Evict every evictable block of the primary (so loads come from below); returns
    how many blocks it freed. Reserves the whole slab for throwaway keys and releases
    them without writing, which evicts through the primary's own policy."""
    primary = cache.primary
    resident = len(primary)
    scratch = [make_offload_key(os.urandom(32), 0) for _ in range(primary.num_blocks)]
    prepared = primary.prepare_store(scratch)
    if prepared is None:
        raise RuntimeError("the primary has blocks in use; cannot empty it")
    primary.complete_store(prepared.keys_to_store, success=False)
    cache.take_events()
    return resident - len(primary)


class UnknownMedium(ValueError):
    """A medium asked for is not in the chain."""


class BenchFailure(RuntimeError):
    """tierkv did not move every block (a tier failed or dropped some)."""


async def _bench_medium(
    chain: CacheConfig,
    medium: str,
    tier: TierConfig | None,
    raw: RawMedium | None,
    data: torch.Tensor,
    options: BenchOptions,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    n = options.num_blocks
    batches = _batches(n, options.batch)
    out = torch.zeros_like(data)
    timings: dict[tuple[str, str], list[_Timing]] = {
        (side, phase): [] for side in ("tierkv", "raw") for phase in ("store", "load")
    }
    run_tag = f"{os.getpid()}-{time.time_ns()}"
    if raw is not None:
        await raw.open()
    try:
        for rep in range(options.repeat):
            sides = ["tierkv", "raw"] if rep % 2 == 0 else ["raw", "tierkv"]
            for side in sides:
                if side == "raw" and raw is None:
                    continue
                progress(f"{medium}: repetition {rep + 1}/{options.repeat}, {side}")
                if side == "raw":
                    assert raw is not None
                    store, load = await _raw_rep(raw, data, out, batches, options)
                else:
                    config = _bench_config(chain, tier, options, f"tierkv-bench-{run_tag}")
                    keys = _keys(n, f"{rep}-{run_tag}")
                    store, load = await _tierkv_rep(
                        config, medium, raw, keys, data, out, batches, options
                    )
                if not torch.equal(out, data):
                    raise BenchFailure(f"{medium} ({side}): blocks read back differ")
                out.zero_()
                timings[side, "store"].append(store)
                timings[side, "load"].append(load)
    finally:
        if raw is not None:
            await raw.close()

    nbytes = n * options.block_bytes
    result: dict[str, Any] = {
        "medium": medium,
        "type": "primary" if tier is None else tier.type,
        "baseline": raw.description if raw is not None else None,
    }
    for phase in ("store", "load"):
        mine = _summary(nbytes, timings["tierkv", phase])
        entry: dict[str, Any] = {"tierkv": mine, "raw": None, "ratio": None}
        if raw is not None:
            theirs = _summary(nbytes, timings["raw", phase])
            entry["raw"] = theirs
            entry["ratio"] = mine["MBps"] / theirs["MBps"]
        result[phase] = entry
    return result


async def _raw_rep(
    raw: RawMedium,
    data: torch.Tensor,
    out: torch.Tensor,
    batches: list[Batch],
    options: BenchOptions,
) -> tuple[_Timing, _Timing]:
    store = _Timing.of(
        *await _drive(batches, options.concurrency, lambda a, b: raw.store(data, (a, b)))
    )
    await raw.before_load(None)
    load = _Timing.of(
        *await _drive(batches, options.concurrency, lambda a, b: raw.load(out, (a, b)))
    )
    await raw.cleanup(options.num_blocks)
    return store, load


async def _tierkv_rep(
    config: CacheConfig,
    medium: str,
    raw: RawMedium | None,
    keys: list[OffloadKey],
    data: torch.Tensor,
    out: torch.Tensor,
    batches: list[Batch],
    options: BenchOptions,
) -> tuple[_Timing, _Timing]:
    """Store then load every block through a freshly opened cache."""
    n = options.num_blocks
    async with TieredCache(config) as cache:
        cache.primary.view.tensor.zero_()  # fault the slab's pages in before timing
        tier_name = cache.tier_names[0] if cache.tier_names else None
        rejected = 0

        async def store_batch(a: int, b: int) -> None:
            nonlocal rejected
            result = await cache.store(keys[a:b], data[a:b])
            rejected += len(result.rejected)

        t0 = time.perf_counter()
        _, latencies = await _drive(batches, options.concurrency, store_batch)
        await cache.flush()
        store = _Timing.of(time.perf_counter() - t0, latencies)
        if rejected:
            raise BenchFailure(f"{medium}: the primary rejected {rejected} blocks")
        if tier_name is not None:
            tstats = cache.stats().tiers[tier_name]
            if tstats["blocks_stored"] != n:
                raise BenchFailure(
                    f"{medium}: {tstats['blocks_stored']} of {n} blocks reached the tier "
                    f"({tstats['failed_keys']} failed, {tstats['drops']} dropped, "
                    f"{tstats['errors']} errors)"
                )
            # a store call returns once its blocks are in the primary: the latency
            # that matters is the tier's job (one per call), from the fresh cache's stats
            jobs = tstats["job_latency"]
            store = _Timing(store.seconds, jobs["p50_ms"] / 1e3, jobs["p99_ms"] / 1e3)
            empty_primary(cache)
            if raw is not None:
                await raw.before_load(cache.tier(tier_name))
        failures: list[str] = []

        async def load_batch(a: int, b: int) -> None:
            result = await cache.load(keys[a:b], out[a:b])
            if not result.ok:
                failures.extend(result.errors.values())
            elif tier_name is not None and set(result.sources.values()) != {tier_name}:
                failures.append(f"served from {sorted(set(result.sources.values()))}")

        load = _Timing.of(*await _drive(batches, options.concurrency, load_batch))
        if failures:
            raise BenchFailure(f"{medium}: {len(failures)} blocks failed to load: {failures[0]}")
        if tier_name is not None:
            empty_primary(cache)
            await cache.tier(tier_name).remove(keys)
    return store, load


class RawBlockFiles(RawFile):
    """`nvme`'s medium as the tier uses it: one file per block, all in one directory.
    A store opens each file (`O_CREAT | O_TRUNC`), `os.pwrite`s the block, `fdatasync`s
    it when the tier has `fsync: always`, and closes it; a load opens, `os.preadv`s
    and closes. Worker threads, the tier's `io_concurrency` at a time, one block per
    thread call. What the tier adds on top: the frame header and its checksum (and
    MAC), the temporary name and rename, the fan-out directories walked without
    following links, and its index.

    The streaming phase's honest baseline: against one big file (`RawFile`) a
    file-per-block store also pays a file creation and, with fsync, a journal commit
    per block; a load an open per block. Both are reported."""

    def __init__(self, tier: Any, block_bytes: int) -> None:  # an NvmeTierConfig
        super().__init__(tier, block_bytes)
        self.description = (
            f"one file per block: open/os.pwrite{'/fdatasync' if self.fsync else ''}/close "
            f"and open/os.preadv/close, {self.width} threads"
        )
        self.blocks_dir = self.directory / f".tierkv-bench-raw-files-{os.getpid()}"
        self.written = 0

    def _file(self, offset: int) -> str:
        return str(self.blocks_dir / f"{offset // self.block_bytes}.blk")

    async def open(self) -> None:
        self.blocks_dir.mkdir(parents=True, exist_ok=True)

    def _write(self, row: memoryview, offset: int) -> None:
        fd = os.open(self._file(offset), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = row.cast("B")
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], done)
            if self.fsync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def _read(self, row: memoryview, offset: int) -> None:
        fd = os.open(self._file(offset), os.O_RDONLY)
        try:
            if os.preadv(fd, [row], 0) != len(row):
                raise OSError(f"short read of {self._file(offset)}")
        finally:
            os.close(fd)

    async def store(self, data: torch.Tensor, batch: Batch) -> None:
        await super().store(data, batch)
        self.written = max(self.written, batch[1])

    async def before_load(self, tier: SecondaryTierManager | None) -> None:
        if tier is None:
            paths = [Path(self._file(i * self.block_bytes)) for i in range(self.written)]
            await anyio.to_thread.run_sync(_drop_page_cache, paths)
        else:
            await super().before_load(tier)

    async def cleanup(self, n: int) -> None:
        def delete() -> None:
            for i in range(max(n, self.written)):
                Path(self._file(i * self.block_bytes)).unlink(missing_ok=True)

        await anyio.to_thread.run_sync(delete)
        self.written = 0

    async def close(self) -> None:
        await self.cleanup(self.written)
        with contextlib.suppress(OSError):
            self.blocks_dir.rmdir()


# -- streaming through a small primary ---------------------------------------------------
async def bench_streaming(
    chain: CacheConfig, options: BenchOptions, progress: Callable[[str], None]
) -> dict[str, Any] | None:
    """One request much larger than the primary (`streaming_blocks` blocks through a
    primary of `streaming_primary_blocks`), stored with one `store` call and loaded with
    one `load` call through the chain's nvme tier, against raw `pwrite`/`pread` of the
    same bytes at the tier's concurrency, one file per block as the tier stores them
    (`RawBlockFiles`: the ratios) and one big file (`RawFile`: for reference); wall
    time and CPU per block of each; and the promotion's wall time against each of
    its stages alone (stage 1: the tier's load jobs into primary slots, window by
    window; stage 2: the copies from the slots to the destination)."""
    tier = next((t for t in chain.tiers if t.type == "nvme"), None)
    n = options.streaming_blocks
    if tier is None or n == 0:
        return None
    block = options.block_bytes
    slots = options.streaming_primary_blocks
    run_tag = f"{os.getpid()}-{time.time_ns()}"
    config = _bench_chain(
        chain,
        f"tierkv-bench-stream-{run_tag}",
        block,
        slots,
        [_written_through(tier, slots * block)],
    )
    progress(f"streaming: {format_size(n * block)} through a {format_size(slots * block)} primary")
    gen = torch.Generator().manual_seed(options.seed + 1)
    data = torch.randint(0, 256, (n, block), dtype=torch.uint8, generator=gen)
    out = torch.zeros_like(data)
    raw = RawBlockFiles(tier, block)  # the baseline of the ratios: a file per block
    one_file = RawFile(tier, block)  # for reference: the same bytes in one big file
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "store",
            "load",
            "raw_store",
            "raw_load",
            "one_file_store",
            "one_file_load",
            "stage1",
            "stage2",
        )
    }
    cpu: dict[str, list[float]] = {k: [] for k in times if not k.startswith("stage")}
    windows = 0
    await raw.open()
    await one_file.open()
    try:
        for rep in range(options.repeat):
            for label, medium in (("raw", raw), ("one_file", one_file)):
                progress(f"streaming: repetition {rep + 1}/{options.repeat}, {label}")
                t0, c0 = time.perf_counter(), time.process_time()
                await medium.store(data, (0, n))
                times[f"{label}_store"].append(time.perf_counter() - t0)
                cpu[f"{label}_store"].append(time.process_time() - c0)
                await medium.before_load(None)
                t0, c0 = time.perf_counter(), time.process_time()
                await medium.load(out, (0, n))
                times[f"{label}_load"].append(time.perf_counter() - t0)
                cpu[f"{label}_load"].append(time.process_time() - c0)
                if not torch.equal(out, data):
                    raise BenchFailure(f"streaming ({label}): blocks read back differ")
                out.zero_()
                await medium.cleanup(n)
            progress(f"streaming: repetition {rep + 1}/{options.repeat}, tierkv")
            keys = _keys(n, f"s{rep}-{run_tag}")
            async with TieredCache(config) as cache:
                cache.primary.view.tensor.zero_()
                name = cache.tier_names[0]
                t0, c0 = time.perf_counter(), time.process_time()
                stored = await cache.store(keys, data)
                await cache.flush()
                times["store"].append(time.perf_counter() - t0)
                cpu["store"].append(time.process_time() - c0)
                if not stored.ok:
                    raise BenchFailure(f"streaming: {len(stored.rejected)} blocks rejected")
                empty_primary(cache)
                await raw.before_load(cache.tier(name))
                t0, c0 = time.perf_counter(), time.process_time()
                loaded = await cache.load(keys, out)
                times["load"].append(time.perf_counter() - t0)
                cpu["load"].append(time.process_time() - c0)
                if not loaded.ok or not torch.equal(out, data):
                    raise BenchFailure(
                        f"streaming: {len(loaded.failed_keys)} blocks failed to load"
                        if not loaded.ok
                        else "streaming: blocks loaded back differ"
                    )
                out.zero_()
                # each stage alone, over the same windows the promotion used
                window = max(1, cache.primary.promotion_share // 2)
                windows = -(-n // window)
                empty_primary(cache)
                await raw.before_load(cache.tier(name))
                nvme = cache.tier(name)
                dest = HostBlocks(out, block, writable=True)
                stage1 = stage2 = 0.0
                for a in range(0, n, window):
                    ks = tuple(keys[a : a + window])
                    rows = list(range(len(ks)))
                    t0 = time.perf_counter()
                    result = await nvme.load(JobMetadata(a + 1, ks, tuple(rows)))
                    stage1 += time.perf_counter() - t0
                    if not result.ok:
                        raise BenchFailure(f"streaming: stage 1 alone failed: {result.error}")
                    t0 = time.perf_counter()
                    await dest.copy_from_slots(
                        cache.primary.view, list(range(a, a + len(ks))), rows
                    )
                    stage2 += time.perf_counter() - t0
                if not torch.equal(out, data):
                    raise BenchFailure("streaming: stages alone read back different blocks")
                out.zero_()
                times["stage1"].append(stage1)
                times["stage2"].append(stage2)
                await nvme.remove(keys)
    finally:
        await raw.close()
        await one_file.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    nbytes = n * block
    return {
        "request_bytes": nbytes,
        "primary_bytes": slots * block,
        "blocks": n,
        "windows": windows,
        "baseline": raw.description,
        "one_file_baseline": one_file.description,
        **{f"{k}_seconds": v for k, v in med.items()},
        **{f"{k}_spread_seconds": [min(v), max(v)] for k, v in times.items()},
        # CPU seconds of this process (all threads) per block: steadier than wall time
        # on a shared machine, and what a busy server pays
        **{f"{k}_cpu_us_per_block": statistics.median(v) / n * 1e6 for k, v in cpu.items()},
        "store_MBps": nbytes / med["store"] / 1e6,
        "load_MBps": nbytes / med["load"] / 1e6,
        "raw_store_MBps": nbytes / med["raw_store"] / 1e6,
        "raw_load_MBps": nbytes / med["raw_load"] / 1e6,
        "one_file_store_MBps": nbytes / med["one_file_store"] / 1e6,
        "one_file_load_MBps": nbytes / med["one_file_load"] / 1e6,
        "store_ratio": med["raw_store"] / med["store"],
        "load_ratio": med["raw_load"] / med["load"],
        "one_file_store_ratio": med["one_file_store"] / med["store"],
        "one_file_load_ratio": med["one_file_load"] / med["load"],
        "promotion_vs_slower_stage": med["load"] / max(med["stage1"], med["stage2"]),
    }


# -- the orchestrator's own cost ----------------------------------------------------------
class _NoCopy:
    """A block source and destination that moves no bytes: what remains of a store or
    a load is the orchestrator's and the primary's bookkeeping."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    async def copy_to_slots(
        self, view: HostSlab, indices: Sequence[int], slots: Sequence[int]
    ) -> None:
        pass

    async def copy_from_slots(
        self, view: HostSlab, indices: Sequence[int], slots: Sequence[int]
    ) -> None:
        pass


async def bench_orchestrator(
    chain: CacheConfig, options: BenchOptions, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Keys per second of store, lookup (hit and miss) and load bookkeeping over a
    primary filled with `orchestrator_keys` keys, with no I/O and no copies.

    The fill is the store measurement (one sample per `repeat`-th of it); each
    repetition then times lookups of resident and of unknown keys, and loads, over a
    sample of the keys."""
    n = options.orchestrator_keys
    per_call = options.lookup_batch
    block_bytes = 64
    never_cascaded = MemoryTierConfig.model_validate(
        {"type": "memory", "write_policy": "write_through_selective", "min_hits": 2**31}
    )
    config = _bench_chain(
        chain,
        f"tierkv-bench-orchestrator-{os.getpid()}",
        block_bytes,
        n,
        [never_cascaded],
        pin_memory=False,
    )
    progress(f"orchestrator: making {n:,} keys")
    keys = _keys(n, "orch")
    sample = min(n, 1 << 16)  # keys per timed lookup/load pass
    unknown = _keys(sample, "miss")
    rates: dict[str, list[float]] = {"store": [], "lookup_hit": [], "lookup_miss": [], "load": []}

    def calls(pool: list[OffloadKey], start: int, end: int) -> Iterator[list[OffloadKey]]:
        for i in range(start, end, per_call):
            yield pool[i : min(end, i + per_call)]

    async with TieredCache(config) as cache:
        segment = -(-n // options.repeat)
        for first in range(0, n, segment):
            progress(f"orchestrator: storing keys {first:,}..{min(n, first + segment):,}")
            t0 = time.perf_counter()
            done = 0
            for chunk in calls(keys, first, first + segment):
                await cache.store(chunk, _NoCopy(len(chunk)))
                done += len(chunk)
            if done:
                rates["store"].append(done / (time.perf_counter() - t0))
        cache.take_events()
        for rep in range(options.repeat):
            progress(f"orchestrator: lookups and loads, repetition {rep + 1}/{options.repeat}")
            for name, pool in (("lookup_hit", keys), ("lookup_miss", unknown), ("load", keys)):
                t0 = time.perf_counter()
                done = 0
                for chunk in calls(pool, 0, sample):
                    if name == "load":
                        await cache.load(chunk, _NoCopy(len(chunk)))
                    else:
                        await cache.lookup([chunk])
                    done += len(chunk)
                rates[name].append(done / (time.perf_counter() - t0))
        bookkeeping = await _bench_bookkeeping(cache, keys, block_bytes, options, progress)
        resident = len(cache.primary)
    return {
        "resident_keys": resident,
        "keys_per_call": per_call,
        **bookkeeping,
        **{f"{name}_keys_per_s": statistics.median(values) for name, values in rates.items()},
        **{
            f"{name}_calls_per_s": statistics.median(values) / per_call
            for name, values in rates.items()
        },
    }


_FRESH = itertools.count()


async def _bench_bookkeeping(
    cache: TieredCache,
    keys: list[OffloadKey],
    block_bytes: int,
    options: BenchOptions,
    progress: Callable[[str], None],
) -> dict[str, float]:
    """Per block: a 1,024-block load of resident keys with no copies (what the cache
    adds to a load), and the host-tensor store/load path beyond its own copy (the
    same rows moved by one `index_copy_`/`index_select` into the same kind of slots).
    Medians of `repeat` runs of 16 calls each."""
    n = len(keys)
    big = min(1024, n)
    calls = [keys[i : i + big] for i in range(0, min(n, 16 * big), big)]
    tensor = torch.randint(0, 256, (big, block_bytes), dtype=torch.uint8)
    out = torch.zeros_like(tensor)
    slab = cache.primary.view.tensor
    per: dict[str, list[float]] = {
        k: [] for k in ("load_1024", "host_store", "host_load", "raw_store", "raw_load")
    }
    for rep in range(options.repeat):
        progress(f"orchestrator: 1,024-block calls, repetition {rep + 1}/{options.repeat}")
        t0 = time.perf_counter()
        for chunk in calls:
            await cache.load(chunk, _NoCopy(len(chunk)))
        per["load_1024"].append((time.perf_counter() - t0) / (len(calls) * big))
        t0 = time.perf_counter()
        for chunk in calls:
            await cache.load(chunk, out[: len(chunk)])
        per["host_load"].append((time.perf_counter() - t0) / (len(calls) * big))
        fresh = [_keys(big, f"h{next(_FRESH)}") for _ in calls]  # never stored before
        t0 = time.perf_counter()
        for chunk in fresh:
            await cache.store(chunk, tensor)
        per["host_store"].append((time.perf_counter() - t0) / (len(calls) * big))
        slots = torch.randperm(slab.shape[0])[:big]
        t0 = time.perf_counter()
        for _ in calls:
            slab.index_copy_(0, slots, tensor)
        per["raw_store"].append((time.perf_counter() - t0) / (len(calls) * big))
        t0 = time.perf_counter()
        for _ in calls:
            torch.index_select(slab, 0, slots, out=out)
        per["raw_load"].append((time.perf_counter() - t0) / (len(calls) * big))
    med = {k: statistics.median(v) * 1e6 for k, v in per.items()}
    return {
        "load_1024_us_per_block": med["load_1024"],
        "host_store_us_per_key_beyond_copy": med["host_store"] - med["raw_store"],
        "host_load_us_per_key_beyond_copy": med["host_load"] - med["raw_load"],
        "host_copy_us_per_key": (med["raw_store"] + med["raw_load"]) / 2,
    }


# -- the whole bench ----------------------------------------------------------------------
async def run_bench(
    chain: CacheConfig,
    options: BenchOptions,
    *,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure every medium of `chain` (or those named in `options.media`)."""
    say = progress or (lambda message: None)
    names = [PRIMARY_MEDIUM, *chain.tier_names()]
    wanted = list(options.media) if options.media else names
    unknown = [m for m in wanted if m not in names]
    if unknown:
        raise UnknownMedium(
            f"no medium named {', '.join(unknown)} in the chain; media: {', '.join(names)}"
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # block movers run with one torch thread (see LESSONS.md)
    try:
        return await _run_bench(chain, options, names, wanted, say)
    finally:
        torch.set_num_threads(threads)


async def _run_bench(
    chain: CacheConfig,
    options: BenchOptions,
    names: list[str],
    wanted: list[str],
    say: Callable[[str], None],
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(options.seed)
    n = options.num_blocks
    say(f"generating {format_size(n * options.block_bytes)} of random blocks")
    data = torch.randint(0, 256, (n, options.block_bytes), dtype=torch.uint8, generator=gen)
    started = time.perf_counter()
    results = []
    for medium, tier in zip(names, [None, *chain.tiers]):
        if medium not in wanted:
            continue
        raw = (
            RawMemcpy(n, options.block_bytes)
            if tier is None
            else raw_baseline_for(tier, options.block_bytes)
        )
        results.append(await _bench_medium(chain, medium, tier, raw, data, options, say))
    streaming = await bench_streaming(chain, options, say)
    orchestrator = (
        await bench_orchestrator(chain, options, say) if options.orchestrator_keys else None
    )
    return {
        "block_bytes": options.block_bytes,
        "total_bytes": n * options.block_bytes,
        "blocks": n,
        "batch": options.batch,
        "concurrency": options.concurrency,
        "repeat": options.repeat,
        "torch_threads": torch.get_num_threads(),  # during the bench
        "media": results,
        "streaming": streaming,
        "orchestrator": orchestrator,
        "integrity": bench_integrity(options.block_bytes),
        "elapsed_seconds": time.perf_counter() - started,
    }


# -- the summary ----------------------------------------------------------------------------
def bench_summary(report: dict[str, Any]) -> list[Block]:
    """Lines and tables for the terminal."""
    blocks: list[Block] = [
        f"tierkv bench: {report['blocks']} blocks of {format_size(report['block_bytes'])} "
        f"({format_size(report['total_bytes'])}) per medium, {report['batch']} blocks per "
        f"call, {report['concurrency']} calls in flight, median of {report['repeat']} "
        f"(min..max); MB/s = 10^6 bytes/s; latency per batch",
        "",
    ]
    rows = []
    for m in report["media"]:
        for phase in ("store", "load"):
            entry = m[phase]
            mine, raw = entry["tierkv"], entry["raw"]
            rows.append(
                [
                    m["medium"] if phase == "store" else "",
                    phase,
                    _rate(mine),
                    _rate(raw) if raw else "-",
                    f"{entry['ratio']:.2f}" if entry["ratio"] is not None else "n/a",
                    f"{mine['p50_ms']:.2f} / {mine['p99_ms']:.2f}",
                    f"{raw['p50_ms']:.2f} / {raw['p99_ms']:.2f}" if raw else "-",
                ]
            )
    blocks.append(
        TextTable(
            [
                "medium",
                "phase",
                "tierkv MB/s",
                "raw MB/s",
                "ratio",
                "tierkv p50/p99 ms",
                "raw p50/p99 ms",
            ],
            rows,
        )
    )
    for m in report["media"]:
        blocks.append(f"  {m['medium']}: raw = {m['baseline'] or 'no baseline for this tier type'}")
    orch = report.get("orchestrator")
    if orch:
        blocks.append("")
        blocks.append(
            TextTable(
                ["operation", "keys/s", "calls/s"],
                [
                    [
                        label,
                        f"{orch[f'{key}_keys_per_s']:,.0f}",
                        f"{orch[f'{key}_calls_per_s']:,.0f}",
                    ]
                    for key, label in (
                        ("store", "store (new keys)"),
                        ("lookup_hit", "lookup (resident)"),
                        ("lookup_miss", "lookup (unknown, asks the tier)"),
                        ("load", "load (resident)"),
                    )
                ],
                title=f"orchestrator bookkeeping, {orch['resident_keys']:,} resident keys, "
                f"{orch['keys_per_call']} keys per call, no I/O",
            )
        )
    stream = report.get("streaming")
    if stream:
        blocks.append("")
        nbytes = stream["request_bytes"]

        def rate(key: str) -> str:
            low, high = stream[f"{key}_spread_seconds"]
            return (
                f"{nbytes / stream[f'{key}_seconds'] / 1e6:,.0f} "
                f"({nbytes / high / 1e6:,.0f}..{nbytes / low / 1e6:,.0f})"
            )

        blocks.append(
            TextTable(
                [
                    "phase",
                    "tierkv MB/s",
                    "raw MB/s",
                    "ratio (target >= 0.8)",
                    "one-file MB/s",
                    "ratio to one file",
                    "CPU us/block tierkv / raw / one-file",
                ],
                [
                    [
                        phase,
                        rate(phase),
                        rate(f"raw_{phase}"),
                        f"{stream[f'{phase}_ratio']:.2f}",
                        rate(f"one_file_{phase}"),
                        f"{stream[f'one_file_{phase}_ratio']:.2f}",
                        " / ".join(
                            f"{stream[f'{side}_cpu_us_per_block']:,.0f}"
                            for side in (phase, f"raw_{phase}", f"one_file_{phase}")
                        ),
                    ]
                    for phase in ("store", "load")
                ],
                title=f"streaming: one {format_size(stream['request_bytes'])} request "
                f"through a {format_size(stream['primary_bytes'])} primary and nvme",
            )
        )
        blocks.append(f"  raw = {stream['baseline']}")
        blocks.append(f"  one-file = {stream['one_file_baseline']} (one file, for reference)")
        blocks.append(
            f"  promotion: {stream['load_seconds'] * 1e3:,.0f} ms in {stream['windows']} "
            f"windows; stage 1 alone {stream['stage1_seconds'] * 1e3:,.0f} ms, stage 2 "
            f"alone {stream['stage2_seconds'] * 1e3:,.0f} ms: "
            f"{stream['promotion_vs_slower_stage']:.2f}x the slower stage (target <= 1.25)"
        )
    if orch and "load_1024_us_per_block" in orch:
        blocks.append(
            f"  bookkeeping: {orch['load_1024_us_per_block']:.2f} us/block on 1,024-block "
            f"loads (target <= 5); lookup {1e6 / orch['lookup_hit_keys_per_s']:.2f} us/key "
            f"at {orch['resident_keys']:,} resident keys (target <= 1); host tensor "
            f"store {orch['host_store_us_per_key_beyond_copy']:.2f} / load "
            f"{orch['host_load_us_per_key_beyond_copy']:.2f} us/key beyond the copy "
            f"(target <= 2)"
        )
    if report.get("integrity"):
        blocks += ["", *integrity_summary(report["integrity"])]
    blocks.append(f"ran in {report['elapsed_seconds']:.1f} s")
    return blocks


def _rate(side: dict[str, Any]) -> str:
    low, high = side["spread"]
    return f"{side['MBps']:,.0f} ({low:,.0f}..{high:,.0f})"


# -- helpers for a tier package's own benchmark script ----------------------------------------
class TierJobBench:
    """The tier side of a per-tier benchmark: one store job and one load job covering
    every slot of the tier's primary, so the tier's own batching is what is measured."""

    def __init__(self, tier: SecondaryTierManager) -> None:
        self.tier = tier
        n = tier.primary.num_blocks
        self.keys = tuple(make_offload_key(i.to_bytes(32, "big"), 0) for i in range(n))
        self.job = JobMetadata(1, self.keys, tuple(range(n)))

    async def open(self) -> None:
        await self.tier.open()

    async def store(self) -> None:
        result = await self.tier.store(self.job)
        assert result.ok, result.error

    async def load(self) -> None:
        result = await self.tier.load(self.job)
        assert result.ok, result.error

    async def close(self) -> None:
        await self.tier.remove(self.keys)
        await self.tier.close()


async def timed(fn: Callable[[], Awaitable[None]]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one `await fn()`."""
    cpu, start = time.process_time(), time.perf_counter()
    await fn()
    return time.perf_counter() - start, time.process_time() - cpu


async def best_of(
    repeat: int, phases: Sequence[tuple[str, Callable[[], Awaitable[None]]]]
) -> dict[str, float]:
    """Run `phases` in order `repeat` times (raw and tier alternating, so a noisy
    neighbour hurts both alike); the best wall seconds of each as `name` and the best
    CPU seconds as `name_cpu`."""
    best: dict[str, float] = {}
    for _ in range(repeat):
        for name, fn in phases:
            wall, cpu = await timed(fn)
            best[name] = min(best.get(name, wall), wall)
            best[f"{name}_cpu"] = min(best.get(f"{name}_cpu", cpu), cpu)
    return best
