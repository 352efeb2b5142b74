"""The bookkeeping of a store or a load with nothing else in it: a block source and
destination that moves no bytes (`NoCopy`), the cost per block of 1,024-block loads,
and what the host-tensor path adds to its own copy (`bench_bookkeeping`)."""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from tierkv.bench.chain import bench_keys
from tierkv.bench.options import BenchOptions
from tierkv.cache import TieredCache
from tierkv.contract.keys import OffloadKey
from tierkv.primary import HostSlab


class NoCopy:
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


_FRESH = itertools.count()


async def bench_bookkeeping(
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
            await cache.load(chunk, NoCopy(len(chunk)))
        per["load_1024"].append((time.perf_counter() - t0) / (len(calls) * big))
        t0 = time.perf_counter()
        for chunk in calls:
            await cache.load(chunk, out[: len(chunk)])
        per["host_load"].append((time.perf_counter() - t0) / (len(calls) * big))
        fresh = [bench_keys(big, f"h{next(_FRESH)}") for _ in calls]  # never stored before
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
