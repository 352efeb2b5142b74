"""tierkv as LMCache's L2 adapter vs LMCache's own L2 adapters, through the adapter
interface, in one process, interleaved.

    python benchmarks/lmcache_l2_compare.py                       # nvme and redis, 1 and 8 MiB
    python benchmarks/lmcache_l2_compare.py --media nvme --sizes 1MiB --rounds 5
    python benchmarks/lmcache_l2_compare.py --media nvme --sizes 1MiB --full   # tier full

Both systems are built by LMCache 0.5.6's own factory from `--l2-adapter` JSON and
driven the same way, as LMCache's controllers drive an adapter: a store task of
`--batch` objects is submitted and its event fd waited on, then the next; for loads,
a lookup-and-lock task, then the load task (timed), then the unlock. Objects are
`TensorMemoryObj`s over one L1 buffer (CPU memory; no GPU, no cache engine).

- nvme: tierkv's adapter over one nvme tier (`fsync: never`, as LMCache's `fs`
  adapter, which never fsyncs; `--fsync always` for tierkv's default) vs LMCache's
  `fs` adapter (aiofiles, one raw file per object, no header, no checksum), both on
  the same directory's disk. Before each load phase each system's files are flushed
  and dropped from the page cache, so loads read the disk.
- redis: tierkv's adapter over one redis tier vs LMCache's `resp` adapter (its C++
  RESP connector, 8 worker threads), both on one private redis-server started here,
  flushed between systems.

tierkv's tiers frame each block with a header and an xxh3 checksum, checked on every
load; LMCache's adapters store raw bytes. Each round runs every system in turn (store
all keys, drop caches, load all keys), the order alternating per round; `--warmup`
rounds are not counted. Every loaded object is compared with what was stored (outside
the timing): a wrong byte aborts the run. Prints GB/s (10^9 bytes/s) median (min..max)
per system, phase and size, and tierkv / LMCache.

The harness's own work on the objects (zeroing the targets before each load, comparing
them after) goes through NumPy, which runs on the calling thread alone. Through torch
(`zero_`, `torch.equal`) its OpenMP worker spun for about 10 ms of CPU after each 16 MiB
zeroing, right when the load it preceded ran: on the 2-core dev VM that slowed both
systems' loads by 20-60 %. torch's threads are left as they are: LMCache's `fs` adapter
stored 8 MiB objects at 0.4-0.5 GB/s under `torch.set_num_threads(1)` and at 1.5-1.9
with the default, so something on its store path depends on them (measured
2026-11-27).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy
import torch

from tierkv.bench.raw_files import drop_page_cache

os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")  # lmcache is imported later

MiB = 1 << 20


def parse_size(text: str) -> int:
    low = text.strip().lower()
    for unit, factor in (("gib", 1 << 30), ("mib", MiB), ("kib", 1 << 10)):
        if low.endswith(unit):
            return int(float(low[: -len(unit)]) * factor)
    return int(low)


class L1:
    """Source and target objects over one buffer, as LMCache's L1 hands them out."""

    def __init__(self, batch: int, size: int) -> None:
        from lmcache.v1.distributed.internal_api import L1MemoryDesc

        self.size, self.batch = size, batch
        self.buffer = torch.empty(2 * batch * size, dtype=torch.uint8)
        self.buffer[: batch * size].random_(0, 256, generator=torch.Generator().manual_seed(7))
        self.desc = L1MemoryDesc(
            ptr=self.buffer.data_ptr(), size=self.buffer.numel(), align_bytes=4096
        )
        self.sources = [self._obj(i) for i in range(batch)]
        self.targets = [self._obj(batch + i) for i in range(batch)]
        # the harness's own zeroing and checks: NumPy, on this thread (module docstring)
        self.array = self.buffer.numpy()

    def _obj(self, i: int) -> Any:
        from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

        raw = self.buffer[i * self.size : (i + 1) * self.size]
        meta = MemoryObjMetadata(
            shape=torch.Size([self.size]),
            dtype=torch.uint8,
            address=raw.data_ptr(),
            phy_size=self.size,
            fmt=MemoryFormat.KV_2LTD,
            ref_count=1,
        )
        return TensorMemoryObj(raw, meta, parent_allocator=None)

    def clear_targets(self) -> None:
        self.array[self.batch * self.size :] = 0

    def check(self) -> None:
        half = self.batch * self.size
        if not numpy.array_equal(self.array[:half], self.array[half:]):
            raise SystemExit("a load returned wrong bytes")


def build(spec: dict[str, Any], l1: L1) -> Any:
    import argparse as ap

    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    parsed = parse_args_to_l2_adapters_config(ap.Namespace(l2_adapter=[json.dumps(spec)]))
    return create_l2_adapter(parsed.adapters[0], l1_memory_desc=l1.desc)


def wait(fd: int, take: Callable[[], Any]) -> Any:
    from lmcache.v1.platform import consume_fd

    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        got = take()
        if got is not None:
            return got
        if not poller.poll(60_000):
            raise SystemExit("no result within 60 s")
        with contextlib.suppress(BlockingIOError):
            consume_fd(fd)


def keys_for(system: str, round_: int, count: int) -> list[Any]:
    from lmcache.v1.distributed.api import ObjectKey

    return [
        ObjectKey(
            chunk_hash=f"{system}:{round_}:{i}".encode().ljust(16, b"."),
            model_name="bench/model",
            kv_rank=0,
        )
        for i in range(count)
    ]


def run_round(
    adapter: Any, keys: list[Any], l1: L1, drop: Callable[[], None]
) -> tuple[float, float]:
    """Seconds to store and to load `keys` (in tasks of `l1.batch`)."""
    started = time.perf_counter()
    for start in range(0, len(keys), l1.batch):
        batch = keys[start : start + l1.batch]
        task = adapter.submit_store_task(batch, l1.sources[: len(batch)])
        result = wait(
            adapter.get_store_event_fd(), lambda t=task: adapter.pop_completed_store_tasks().get(t)
        )
        if not result.is_successful():
            raise SystemExit(f"{type(adapter).__name__}: a store failed")
    stored = time.perf_counter() - started
    drop()
    loading = 0.0
    for start in range(0, len(keys), l1.batch):
        batch = keys[start : start + l1.batch]
        task = adapter.submit_lookup_and_lock_task(batch, {})
        found = wait(
            adapter.get_lookup_and_lock_event_fd(),
            lambda t=task: adapter.query_lookup_and_lock_result(t),
        )
        if found.popcount() != len(batch):
            raise SystemExit(f"{type(adapter).__name__}: a lookup missed")
        l1.clear_targets()
        began = time.perf_counter()
        task = adapter.submit_load_task(batch, l1.targets[: len(batch)])
        got = wait(adapter.get_load_event_fd(), lambda t=task: adapter.query_load_result(t))
        loading += time.perf_counter() - began
        adapter.submit_unlock(batch)
        if got.popcount() != len(batch):
            raise SystemExit(f"{type(adapter).__name__}: a load missed")
        l1.check() if len(batch) == l1.batch else None
    return stored, loading


def files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--media", default="nvme,redis")
    parser.add_argument("--sizes", default="1MiB,8MiB")
    parser.add_argument("--total", default="256MiB", help="bytes per system per round")
    parser.add_argument("--batch", type=int, default=16, help="objects per task")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dir", default=None, help="the disk to use (a temp dir on /tmp)")
    parser.add_argument("--fsync", default="never", choices=("never", "always"))
    parser.add_argument(
        "--nvme-layout", default="slab", choices=("slab", "files"), help="the nvme tier's layout"
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="tierkv's nvme tier holds one round's objects and keeps them (no delete "
        "between rounds): after the warm-up, every store evicts one (a server's steady "
        "state). LMCache's fs adapter, which has no capacity, is deleted as before",
    )
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()

    from tierkv_redis.testing import RedisServer

    work = Path(tempfile.mkdtemp(prefix="tierkv-l2-bench-", dir=args.dir))
    server = RedisServer(work / "redis-data") if "redis" in args.media else None
    if server is not None:
        (work / "redis-data").mkdir()
        server.start()
    figures: dict[str, Any] = {}
    try:
        for medium in args.media.split(","):
            for size in (parse_size(s) for s in args.sizes.split(",")):
                figures[f"{medium} {size // MiB}MiB"] = compare(medium, size, args, work, server)
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


def compare(medium: str, size: int, args: Any, work: Path, server: Any) -> dict[str, Any]:
    l1 = L1(args.batch, size)
    count = max(args.batch, parse_size(args.total) // size)
    plugin = {
        "type": "plugin",
        "module_path": "tierkv.integrations.lmcache",
        "class_name": "TierkvL2Adapter",
    }
    if medium == "nvme":
        tdir, ldir = work / f"tierkv-{size}", work / f"fs-{size}"
        tier = {
            "type": "nvme",
            "path": str(tdir),
            # full: one round's objects, each a slot (or a file) with a 4 KiB header
            "capacity": f"{count * (size // 1024 + 4)}KiB" if args.full else "16GiB",
            "fsync": args.fsync,
            "layout": args.nvme_layout,
        }
        specs = {
            "tierkv": {**plugin, "adapter_params": {"tiers": [tier]}},
            "lmcache-fs": {"type": "fs", "base_path": str(ldir)},
        }
        drops = {
            "tierkv": lambda: drop_page_cache(files_under(tdir)),
            "lmcache-fs": lambda: drop_page_cache(files_under(ldir)),
        }
    else:
        tier = {"type": "redis", "url": server.url}
        specs = {
            "tierkv": {**plugin, "adapter_params": {"tiers": [tier]}},
            "lmcache-resp": {"type": "resp", "host": "127.0.0.1", "port": server.port},
        }
        drops = {name: (lambda: None) for name in specs}
    adapters = {name: build(spec, l1) for name, spec in specs.items()}
    times: dict[str, dict[str, list[float]]] = {n: {"store": [], "load": []} for n in specs}
    try:
        for round_ in range(args.warmup + args.rounds):
            order = list(specs) if round_ % 2 == 0 else list(reversed(specs))
            for name in order:
                if medium == "redis":
                    server._command("FLUSHALL")
                keys = keys_for(name, round_, count)
                stored, loaded = run_round(adapters[name], keys, l1, drops[name])
                if medium == "nvme" and not (args.full and name == "tierkv"):
                    adapters[name].delete(keys)
                if round_ >= args.warmup:
                    times[name]["store"].append(count * size / stored / 1e9)
                    times[name]["load"].append(count * size / loaded / 1e9)
    finally:
        for adapter in adapters.values():
            adapter.close()
    ours, theirs = list(specs)
    out: dict[str, Any] = {}
    for phase in ("store", "load"):
        row = {n: times[n][phase] for n in specs}
        ratio = statistics.median(row[ours]) / statistics.median(row[theirs])
        out[phase] = {**row, "ratio": ratio}
        print(
            f"{medium:5} {size // MiB:2d} MiB {phase:5}  "
            + "  ".join(
                f"{n} {statistics.median(v):5.2f} ({min(v):.2f}..{max(v):.2f})"
                for n, v in row.items()
            )
            + f"  GB/s   tierkv/LMCache {ratio:.2f}x",
            flush=True,
        )
    return out


if __name__ == "__main__":
    main()
