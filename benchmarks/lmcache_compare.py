"""tierkv's redis and nvme tiers side by side with LMCache 0.5.6's RedisConnector and
LocalDiskBackend, and with the raw medium, in one process, interleaved.

Run it from a venv that holds both tierkv and LMCache (never tierkv's own venv: LMCache
pins numpy and torch versions of its own); benchmarks/README.md has the setup:

    redis-server --port 6391 --save "" --appendonly no --daemonize yes
    /work/lmc-venv/bin/python benchmarks/lmcache_compare.py            # both media
    /work/lmc-venv/bin/python benchmarks/lmcache_compare.py --media nvme --sizes 1MiB \
        --rounds 5 --json out.json

What it measures, per medium and value size: store GB/s and load GB/s (10^9 bytes/s)
of `--total` bytes (1 GiB) through each system, the median of `--rounds` rounds with
min..max and CPU seconds of this process (all threads). Every system gets the same
calls: the blocks go in calls of `--batch` keys (16), one call after the other (or
`--calls` at once), and each system moves a call's blocks with `--concurrency` (16) in
flight by its own means:

- tierkv: the tier itself (`RedisTier`, `NvmeTier`) through its jobs API, one
  `store(job)` / `load(job)` per call, with `max_connections` / `io_concurrency` =
  `--concurrency`, behind a tierkv `PrimaryTier` holding the bytes (no cache, no
  primary copies: only the tier's own framing, checksum and I/O). nvme runs with
  `fsync: always` (the tier's default: each block fdatasync'ed before its rename)
  and `fsync: never`.
- lmcache: the backend objects LMCache's storage manager calls, on CPU memory objects
  (`TensorMemoryAllocator` over a plain tensor; no GPU involved, no cache engine):
  redis: `RedisConnector.batched_put(keys, objs)` / `batched_get_non_blocking(keys)`
  (returned objects are freed after each call); disk:
  `LocalDiskBackend.batched_submit_put_task` (a store counts until every key's
  completion callback ran) / `batched_get_blocking(keys)`, with `disk_io_threads` =
  `--concurrency`. LMCache's event loop runs in its own thread, as in its engine.
- raw: the plain client in `--concurrency` threads, one block per thread task:
  redis-py SET/GET of one value per command (`raw-set`) and redis-py pipelines of
  `--pipeline` (4) commands (`raw-pipe`); for nvme one file per block (open, write,
  close; open, readinto, close) without fsync (`raw-files`) and with `fdatasync`
  before close (`raw-files-fsync`).

Before each nvme load phase the system's own files are flushed and dropped from the
page cache (`posix_fadvise(DONTNEED)`, as `tierkv bench` does), so loads read the disk.
Each round runs every system (store, load, delete) in turn, the order rotated per
round, so a noisy neighbour hurts all alike; keys are fresh every round. `--warmup`
rounds (1) run first and are not counted: the first 1 GiB stored into a fresh
redis-server ran at 0.2-0.35 GB/s for whichever system came first. After each
system's first load the first and last blocks are compared with what was stored.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from tierkv.bench.raw_files import drop_page_cache  # as `tierkv bench` drops it

os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")  # before lmcache is imported
GiB = 1 << 30
T = TypeVar("T")


def parse_size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "b": 1}
    low = text.strip().lower()
    for unit, factor in units.items():
        if low.endswith(unit):
            return int(float(low[: -len(unit)]) * factor)
    return int(low)


def size_name(n: int) -> str:
    return f"{n >> 20}MiB" if n % (1 << 20) == 0 else f"{n >> 10}KiB"


class LoopThread:
    """An asyncio event loop in a daemon thread; `call` runs a coroutine there and
    waits for it from the calling thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class System(Protocol):
    name: str

    def store(self, round_no: int, indices: Sequence[int]) -> None: ...
    def load(self, round_no: int, indices: Sequence[int]) -> None: ...
    def check(self, round_no: int, indices: Sequence[int]) -> None: ...
    def files(self) -> list[Path]: ...
    def cleanup(self, round_no: int) -> None: ...
    def close(self) -> None: ...


@dataclass
class Source:
    """The bytes every system stores: `n` blocks of `block` bytes, all distinct."""

    block: int
    n: int
    data: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        pattern = torch.frombuffer(bytearray(os.urandom(self.block)), dtype=torch.uint8)
        self.data = pattern.repeat(self.n).view(self.n, self.block).clone()
        stamps = torch.arange(self.n, dtype=torch.int64).view(self.n, 1)
        self.data[:, :8] = stamps.view(torch.uint8).view(self.n, 8)
        self.data[:, -8:] = (stamps * 7919).view(torch.uint8).view(self.n, 8)

    def row(self, i: int) -> memoryview:
        return self.data[i].numpy().data.cast("B")


def files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


# -- tierkv ----------------------------------------------------------------------------
class TierkvSystem:
    """A tierkv tier driven through its jobs API, one job per call."""

    def __init__(self, name: str, src: Source, make_tier: Callable[[Any], Any]) -> None:
        from tierkv.primary import PrimaryTier

        self.name = name
        self.src = src
        self.primary = PrimaryTier(src.n, src.block, pin_memory=False, namespace="lmc-compare")
        view = self.primary.view
        for i in range(src.n):
            view.block(i)[:] = src.row(i)
        self.loop = LoopThread(f"tierkv-{name}")
        self.tier = make_tier(view)
        self.loop.call(self.tier.open())
        self.keys: dict[int, list[Any]] = {}
        self.job_id = 0

    def _keys(self, round_no: int) -> list[Any]:
        from tierkv import make_offload_key

        if round_no not in self.keys:
            self.keys[round_no] = [make_offload_key(os.urandom(16), 0) for _ in range(self.src.n)]
        return self.keys[round_no]

    def _job(self, round_no: int, indices: Sequence[int]) -> Any:
        from tierkv import JobMetadata

        keys = self._keys(round_no)
        self.job_id += 1
        return JobMetadata(self.job_id, tuple(keys[i] for i in indices), tuple(indices))

    def store(self, round_no: int, indices: Sequence[int]) -> None:
        result = self.loop.call(self.tier.store(self._job(round_no, indices)))
        if not result.ok:
            raise RuntimeError(f"{self.name} store failed: {result.error}")

    def load(self, round_no: int, indices: Sequence[int]) -> None:
        result = self.loop.call(self.tier.load(self._job(round_no, indices)))
        if not result.ok:
            raise RuntimeError(f"{self.name} load failed: {result.error}")

    def check(self, round_no: int, indices: Sequence[int]) -> None:
        view = self.primary.view
        for i in indices:
            view.block(i)[:] = b"\0" * self.src.block
        self.load(round_no, indices)
        for i in indices:
            if bytes(view.block(i)) != bytes(self.src.row(i)):
                raise RuntimeError(f"{self.name}: block {i} loaded wrong bytes")

    def files(self) -> list[Path]:
        directory = getattr(self.tier, "directory", None)
        return files_under(Path(directory)) if directory is not None else []

    def cleanup(self, round_no: int) -> None:
        keys = self.keys.pop(round_no, None)
        if keys:
            self.loop.call(self.tier.remove(keys))

    def close(self) -> None:
        self.loop.call(self.tier.close())
        self.loop.stop()


def tierkv_redis(src: Source, url: str, concurrency: int) -> TierkvSystem:
    from tierkv_redis import RedisTier, RedisTierConfig  # type: ignore[import-not-found,unused-ignore]

    config = RedisTierConfig(type="redis", url=url, max_connections=concurrency)
    return TierkvSystem("tierkv", src, lambda view: RedisTier(config, view))


def tierkv_nvme(src: Source, root: Path, concurrency: int, fsync: str) -> TierkvSystem:
    from pydantic import ByteSize
    from tierkv_nvme import NvmeTier, NvmeTierConfig  # type: ignore[import-not-found,unused-ignore]

    config = NvmeTierConfig(
        type="nvme",
        path=root / f"tierkv-{fsync}",
        capacity=ByteSize(4 * src.n * (src.block + 8192)),
        fsync=fsync,
        io_concurrency=concurrency,
    )
    return TierkvSystem(f"tierkv-fsync-{fsync}", src, lambda view: NvmeTier(config, view))


# -- LMCache ---------------------------------------------------------------------------
class LMCacheParts:
    """LMCache's config, metadata and CPU backend for blocks of `block` bytes: one
    KV group of shape [2, 1 layer, 256 tokens, block/1024 bf16 values]."""

    def __init__(self, src: Source, extra_blocks: int, disk: Path | None, threads: int) -> None:
        from lmcache.v1.config import LMCacheEngineConfig  # type: ignore[import-not-found,unused-ignore]
        from lmcache.v1.memory_allocators.tensor_memory_allocator import (  # type: ignore[import-not-found,unused-ignore]
            TensorMemoryAllocator,
        )
        from lmcache.v1.metadata import LMCacheMetadata  # type: ignore[import-not-found,unused-ignore]
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # type: ignore[import-not-found,unused-ignore]

        if src.block % 1024:
            raise SystemExit("LMCache's chunk shape needs a block size that is a multiple of 1KiB")
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=256,
            local_cpu=False,
            max_local_cpu_size=1.0,
            local_disk=str(disk) if disk else None,
            max_local_disk_size=1000.0,  # GB: never evicts during the benchmark
            extra_config={"disk_io_threads": threads},
        )
        self.metadata = LMCacheMetadata(
            model_name="bench",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.bfloat16,
            kv_shape=(1, 2, 256, 1, src.block // 1024),
        )
        shapes, dtypes = self.metadata.get_shapes(), self.metadata.get_dtypes()
        pool = (src.n + extra_blocks + 4) * src.block + (64 << 20)
        self.allocator = TensorMemoryAllocator(torch.empty(pool, dtype=torch.uint8))
        self.cpu = LocalCPUBackend(self.config, self.metadata, memory_allocator=self.allocator)
        self.objects = []
        for i in range(src.n):
            obj = self.cpu.allocate(shapes, dtypes)
            if obj is None:
                raise RuntimeError("LMCache's CPU allocator ran out")
            memoryview(obj.byte_array).cast("B")[:] = src.row(i)
            self.objects.append(obj)
        self.loop = LoopThread("lmcache")

    def free(self) -> None:
        for obj in self.objects:
            obj.ref_count_down()
        self.objects = []

    def key(self, round_no: int, i: int) -> Any:
        from lmcache.utils import CacheEngineKey  # type: ignore[import-not-found,unused-ignore]

        return CacheEngineKey("bench", 1, 0, round_no * 10**9 + i, torch.bfloat16)


class LMCacheRedis:
    name = "lmcache"

    def __init__(self, src: Source, url: str, extra_blocks: int) -> None:
        from lmcache.v1.storage_backend.connector.redis_connector import RedisConnector  # type: ignore[import-not-found,unused-ignore]

        self.src = src
        self.parts = LMCacheParts(src, extra_blocks, None, 4)
        self.conn = RedisConnector(url, self.parts.loop.loop, self.parts.cpu)
        self.stored: dict[int, list[Any]] = {}

    def store(self, round_no: int, indices: Sequence[int]) -> None:
        keys = [self.parts.key(round_no, i) for i in indices]
        objs = [self.parts.objects[i] for i in indices]
        self.parts.loop.call(self.conn.batched_put(keys, objs))
        self.stored.setdefault(round_no, []).extend(keys)

    def _get(self, round_no: int, indices: Sequence[int]) -> list[Any]:
        keys = [self.parts.key(round_no, i) for i in indices]
        objs = self.parts.loop.call(self.conn.batched_get_non_blocking("bench", keys))
        if len(objs) != len(keys):
            for obj in objs:
                obj.ref_count_down()
            raise RuntimeError(f"lmcache redis: {len(objs)} of {len(keys)} values loaded")
        return list(objs)

    def load(self, round_no: int, indices: Sequence[int]) -> None:
        for obj in self._get(round_no, indices):
            obj.ref_count_down()

    def check(self, round_no: int, indices: Sequence[int]) -> None:
        check_lmcache_objects("lmcache redis", self._get(round_no, indices), self.src, indices)

    def files(self) -> list[Path]:
        return []

    def cleanup(self, round_no: int) -> None:
        keys = self.stored.pop(round_no, [])
        names = [k.to_string() + suffix for k in keys for suffix in ("kv_bytes", "metadata")]
        for lo in range(0, len(names), 512):
            self.parts.loop.call(self.conn.connection.delete(*names[lo : lo + 512]))

    def close(self) -> None:
        # not `conn.close()`: it calls the executor's blocking shutdown on the loop's
        # own thread and never returns
        with contextlib.suppress(Exception):
            self.parts.loop.call(self.conn.pq_executor.shutdown_async(wait=False))
            self.parts.loop.call(self.conn.connection.aclose())
        self.parts.free()
        self.parts.loop.stop()


def check_lmcache_objects(
    system: str, objs: Sequence[Any], src: Any, indices: Sequence[int]
) -> None:
    """Compare LMCache memory objects with the source rows, then free them."""
    try:
        for i, obj in zip(indices, objs):
            if bytes(memoryview(obj.byte_array).cast("B")) != bytes(src.row(i)):
                raise RuntimeError(f"{system}: block {i} loaded wrong bytes")
    finally:
        for obj in objs:
            obj.ref_count_down()


class LMCacheDisk:
    name = "lmcache"

    def __init__(self, src: Source, root: Path, extra_blocks: int, threads: int) -> None:
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend  # type: ignore[import-not-found,unused-ignore]

        self.src = src
        self.root = root / "lmcache"
        self.root.mkdir(parents=True, exist_ok=True)
        self.parts = LMCacheParts(src, extra_blocks, self.root, threads)
        self.backend = LocalDiskBackend(
            self.parts.config, self.parts.loop.loop, self.parts.cpu, metadata=self.parts.metadata
        )
        self.stored: dict[int, list[Any]] = {}

    def store(self, round_no: int, indices: Sequence[int]) -> None:
        keys = [self.parts.key(round_no, i) for i in indices]
        objs = [self.parts.objects[i] for i in indices]
        left = len(keys)
        lock = threading.Lock()
        done = threading.Event()

        def finished(_key: Any) -> None:
            nonlocal left
            with lock:
                left -= 1
                if left == 0:
                    done.set()

        self.backend.batched_submit_put_task(keys, objs, on_complete_callback=finished)
        if not done.wait(120):
            raise RuntimeError(f"lmcache disk: {left} of {len(keys)} writes never completed")
        self.stored.setdefault(round_no, []).extend(keys)

    def _get(self, round_no: int, indices: Sequence[int]) -> list[Any]:
        keys = [self.parts.key(round_no, i) for i in indices]
        objs = self.backend.batched_get_blocking(keys)
        good = [o for o in objs if o is not None]
        if len(good) != len(keys):
            for obj in good:
                obj.ref_count_down()
            raise RuntimeError(f"lmcache disk: {len(good)} of {len(keys)} blocks loaded")
        return good

    def load(self, round_no: int, indices: Sequence[int]) -> None:
        for obj in self._get(round_no, indices):
            obj.ref_count_down()

    def check(self, round_no: int, indices: Sequence[int]) -> None:
        check_lmcache_objects("lmcache disk", self._get(round_no, indices), self.src, indices)

    def files(self) -> list[Path]:
        return files_under(self.root)

    def cleanup(self, round_no: int) -> None:
        for key in self.stored.pop(round_no, []):
            self.backend.remove(key)

    def close(self) -> None:
        self.backend.close()
        self.parts.free()
        self.parts.loop.stop()


# -- raw media -------------------------------------------------------------------------
class RawRedis:
    """redis-py (sync, hiredis) in `concurrency` threads: one SET/GET per command, or
    pipelines of `depth` commands."""

    def __init__(self, src: Source, url: str, concurrency: int, depth: int) -> None:
        import redis

        self.name = "raw-set" if depth == 1 else f"raw-pipe{depth}"
        self.src = src
        self.depth = depth
        self.client = redis.Redis.from_url(url, max_connections=concurrency)
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix=self.name)
        self.stored: set[int] = set()

    def _name(self, round_no: int, i: int) -> str:
        return f"lmc-compare:{self.name}:{round_no}:{i}"

    def _groups(self, indices: Sequence[int]) -> list[Sequence[int]]:
        return [indices[lo : lo + self.depth] for lo in range(0, len(indices), self.depth)]

    def _put(self, round_no: int, group: Sequence[int]) -> None:
        if self.depth == 1:
            self.client.set(self._name(round_no, group[0]), self.src.row(group[0]))
            return
        pipe = self.client.pipeline(transaction=False)
        for i in group:
            pipe.set(self._name(round_no, i), self.src.row(i))
        pipe.execute()

    def _fetch(self, round_no: int, group: Sequence[int]) -> list[bytes]:
        if self.depth == 1:
            return [self.client.get(self._name(round_no, group[0]))]  # type: ignore[list-item]
        pipe = self.client.pipeline(transaction=False)
        for i in group:
            pipe.get(self._name(round_no, i))
        return pipe.execute()

    def _get(self, round_no: int, group: Sequence[int]) -> None:
        values = self._fetch(round_no, group)
        if any(v is None for v in values):
            raise RuntimeError(f"{self.name}: a value is missing")

    def store(self, round_no: int, indices: Sequence[int]) -> None:
        self.stored.add(round_no)
        list(self.pool.map(lambda g: self._put(round_no, g), self._groups(indices)))

    def load(self, round_no: int, indices: Sequence[int]) -> None:
        list(self.pool.map(lambda g: self._get(round_no, g), self._groups(indices)))

    def check(self, round_no: int, indices: Sequence[int]) -> None:
        for i in indices:
            if self._fetch(round_no, [i])[0] != bytes(self.src.row(i)):
                raise RuntimeError(f"{self.name}: block {i} loaded wrong bytes")

    def files(self) -> list[Path]:
        return []

    def cleanup(self, round_no: int) -> None:
        if round_no in self.stored:
            self.stored.discard(round_no)
            names = [self._name(round_no, i) for i in range(self.src.n)]
            for lo in range(0, len(names), 512):
                self.client.delete(*names[lo : lo + 512])

    def close(self) -> None:
        self.pool.shutdown()
        self.client.close()


class RawFiles:
    """One file per block in `concurrency` threads: open, write, [fdatasync,] close;
    open, readinto the block's buffer, close."""

    def __init__(self, src: Source, root: Path, concurrency: int, fsync: bool) -> None:
        self.name = "raw-files-fsync" if fsync else "raw-files"
        self.src = src
        self.fsync = fsync
        self.root = root / self.name
        self.root.mkdir(parents=True, exist_ok=True)
        self.buffers = torch.empty(src.n, src.block, dtype=torch.uint8)
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix=self.name)

    def _path(self, round_no: int, i: int) -> Path:
        return self.root / f"{round_no}-{i}.blk"

    def _put(self, round_no: int, i: int) -> None:
        fd = os.open(self._path(round_no, i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = self.src.row(i)
            while view:
                view = view[os.write(fd, view) :]
            if self.fsync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def _get(self, round_no: int, i: int) -> None:
        with open(self._path(round_no, i), "rb", buffering=0) as f:
            dest = self.buffers[i].numpy().data.cast("B")
            if f.readinto(dest) != len(dest):
                raise RuntimeError(f"{self.name}: short read")

    def store(self, round_no: int, indices: Sequence[int]) -> None:
        list(self.pool.map(lambda i: self._put(round_no, i), indices))

    def load(self, round_no: int, indices: Sequence[int]) -> None:
        list(self.pool.map(lambda i: self._get(round_no, i), indices))

    def check(self, round_no: int, indices: Sequence[int]) -> None:
        self.load(round_no, indices)
        for i in indices:
            if bytes(self.buffers[i].numpy().data) != bytes(self.src.row(i)):
                raise RuntimeError(f"{self.name}: block {i} loaded wrong bytes")

    def files(self) -> list[Path]:
        return files_under(self.root)

    def cleanup(self, round_no: int) -> None:
        for path in self.root.glob(f"{round_no}-*.blk"):
            path.unlink()

    def close(self) -> None:
        self.pool.shutdown()


# -- driver ----------------------------------------------------------------------------
def cpu_seconds() -> float:
    return time.process_time()


def run_calls(
    op: Callable[[int, Sequence[int]], None], round_no: int, n: int, batch: int, calls: int
) -> None:
    groups = [range(lo, min(n, lo + batch)) for lo in range(0, n, batch)]
    if calls <= 1:
        for group in groups:
            op(round_no, group)
        return
    with ThreadPoolExecutor(calls) as pool:
        list(pool.map(lambda g: op(round_no, g), groups))


@dataclass
class Sample:
    seconds: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def measure(
    systems: Sequence[System], src: Source, args: argparse.Namespace, drop: bool
) -> dict[str, dict[str, Sample]]:
    results: dict[str, dict[str, Sample]] = {
        s.name: {"store": Sample(), "load": Sample()} for s in systems
    }
    edge = [0, src.n - 1]
    for round_no in range(args.warmup + args.rounds):
        counted = round_no >= args.warmup
        shift = round_no % len(systems)
        for system in [*systems[shift:], *systems[:shift]]:
            for phase in ("store", "load"):
                if phase == "load" and drop:
                    drop_page_cache(system.files())
                op = system.store if phase == "store" else system.load
                cpu, start = cpu_seconds(), time.perf_counter()
                run_calls(op, round_no, src.n, args.batch, args.calls)
                wall = time.perf_counter() - start
                if counted:
                    results[system.name][phase].seconds.append(wall)
                    results[system.name][phase].cpu.append(cpu_seconds() - cpu)
            if round_no == 0:
                system.check(round_no, edge)
            system.cleanup(round_no)
            label = f"round {round_no - args.warmup + 1}" if counted else "warm-up"
            log(f"  {label}: {system.name} done")
    return results


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def summarize(
    medium: str, block: int, total: int, results: dict[str, dict[str, Sample]]
) -> dict[str, Any]:
    out: dict[str, Any] = {"medium": medium, "block": block, "bytes": total, "systems": {}}
    for name, phases in results.items():
        entry: dict[str, Any] = {}
        for phase, sample in phases.items():
            rates = [total / s / 1e9 for s in sample.seconds]
            entry[phase] = {
                "gbps_median": statistics.median(rates),
                "gbps_min": min(rates),
                "gbps_max": max(rates),
                "gbps_runs": rates,
                "cpu_s_median": statistics.median(sample.cpu),
            }
        out["systems"][name] = entry
    return out


def print_table(summary: dict[str, Any]) -> None:
    systems = summary["systems"]
    print(f"\n{summary['medium']} {size_name(summary['block'])} values, "
          f"{summary['bytes'] / GiB:g} GiB per run: GB/s median (min..max), CPU s")  # fmt: skip
    for phase in ("store", "load"):
        for name, entry in systems.items():
            e = entry[phase]
            print(
                f"  {phase:5} {name:18} {e['gbps_median']:6.2f} "
                f"({e['gbps_min']:.2f}..{e['gbps_max']:.2f})  cpu {e['cpu_s_median']:.2f}"
            )
        lm = systems.get("lmcache", {}).get(phase, {}).get("gbps_median")
        for name, entry in systems.items():
            if name.startswith("tierkv") and lm:
                print(f"  {phase:5} {name} / lmcache = {entry[phase]['gbps_median'] / lm:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--media", default="redis,nvme", help="redis, nvme or both")
    parser.add_argument("--sizes", default="1MiB,8MiB", help="value sizes")
    parser.add_argument("--total", default="1GiB", help="bytes per run")
    parser.add_argument("--concurrency", type=int, default=16, help="blocks in flight")
    parser.add_argument("--batch", type=int, default=16, help="keys per call")
    parser.add_argument("--calls", type=int, default=1, help="calls in flight")
    parser.add_argument("--pipeline", type=int, default=4, help="raw-pipe depth")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="uncounted rounds first (the first stores into a fresh redis-server also "
        "pay for its memory growing, whichever system runs first)",
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6391/0")
    parser.add_argument("--dir", default=None, help="where nvme files go (default: /tmp)")
    parser.add_argument("--fsync", default="always,never", help="tierkv nvme fsync modes")
    parser.add_argument("--no-raw", action="store_true", help="leave out the raw media")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    total = parse_size(args.total)
    summaries: list[dict[str, Any]] = []
    for medium in [m.strip() for m in args.media.split(",") if m.strip()]:
        for size_text in args.sizes.split(","):
            block = parse_size(size_text)
            src = Source(block, max(1, total // block))
            log(f"{medium} {size_name(block)}: {src.n} blocks")
            extra = args.batch * args.calls
            systems: list[System] = []
            root = Path(tempfile.mkdtemp(prefix="lmc-compare-", dir=args.dir))
            try:
                if medium == "redis":
                    systems.append(tierkv_redis(src, args.redis_url, args.concurrency))
                    systems.append(LMCacheRedis(src, args.redis_url, extra))
                    if not args.no_raw:
                        systems.append(RawRedis(src, args.redis_url, args.concurrency, 1))
                        systems.append(
                            RawRedis(src, args.redis_url, args.concurrency, args.pipeline)
                        )
                elif medium == "nvme":
                    for mode in args.fsync.split(","):
                        systems.append(tierkv_nvme(src, root, args.concurrency, mode.strip()))
                    systems.append(LMCacheDisk(src, root, extra, args.concurrency))
                    if not args.no_raw:
                        systems.append(RawFiles(src, root, args.concurrency, False))
                        systems.append(RawFiles(src, root, args.concurrency, True))
                else:
                    raise SystemExit(f"unknown medium {medium!r}: redis or nvme")
                results = measure(systems, src, args, drop=medium == "nvme")
            finally:
                for system in systems:
                    with contextlib.suppress(Exception):
                        system.close()
                shutil.rmtree(root, ignore_errors=True)
            summary = summarize(medium, block, src.n * block, results)
            summary["settings"] = {
                k: getattr(args, k)
                for k in ("concurrency", "batch", "calls", "rounds", "warmup", "pipeline")
            }
            print_table(summary)
            summaries.append(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
