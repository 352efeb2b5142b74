"""tierkv's bookkeeping per key side by side with vLLM's own CPU tier manager
(`vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager`, the installed wheel).

    .venv/bin/python scripts/bench_vs_vllm_manager.py [--resident 1000000] [--per-call 64]

Both hold `--resident` keys in a CPU primary of tiny blocks (64 bytes, so the copy is
nearly free and what is timed is bookkeeping). Interleaved, `--repeat` rounds of:
- lookup: a request's `--per-call` resident keys. vLLM: what its scheduler does per
  request (`lookup` key by key until a miss; its LRU learns recency at request end,
  not here), and the same followed by `touch` (its LRU's recency update). tierkv:
  `TieredCache.lookup` (one call; it also touches), and `PrimaryTier.lookup` + `touch`
  alone (the primary without the cache layer).
- store: `--per-call` new keys from a host tensor. vLLM: `prepare_store`, the rows
  copied into its CPU tensor at the returned chunk ids (`index_copy_`),
  `complete_store`. tierkv: `TieredCache.store(keys, tensor)`.
Prints the median us/key of each and tierkv's speed as a ratio to vLLM's (above 1:
tierkv faster). Needs vLLM (`scripts/setup-vllm.sh`).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import time
from collections.abc import Callable

import anyio
import torch

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.keys import OffloadKey, make_offload_key

BLOCK = 64


def keys(n: int, tag: str) -> list[OffloadKey]:
    return [make_offload_key(hashlib.sha256(f"{tag}{i}".encode()).digest(), 0) for i in range(n)]


async def run(args: argparse.Namespace) -> None:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    n, per = args.resident, args.per_call
    capacity = n + args.repeat * args.calls * per + per  # stores never evict
    resident = keys(n, "r")
    torch.set_num_threads(1)

    vm = CPUOffloadingManager(num_chunks=capacity)
    vtensor = torch.zeros(capacity, BLOCK, dtype=torch.uint8)
    vctx = ReqContext(req_id="bench")
    src = torch.randint(0, 256, (per, BLOCK), dtype=torch.uint8)

    def v_store(batch: list[OffloadKey]) -> None:
        out = vm.prepare_store(batch, vctx)
        assert out is not None
        ids = torch.as_tensor(out.store_spec.block_ids, dtype=torch.long)
        vtensor.index_copy_(0, ids, src[: len(batch)])
        vm.complete_store(batch, vctx)

    for i in range(0, n, per):
        v_store(resident[i : i + per])

    config = parse_config(
        {
            "namespace": "vs-vllm",
            "layout": {"block_bytes": BLOCK, "groups": [{"block_size": 16}]},
            "primary": {"capacity": capacity * BLOCK, "pin_memory": False},
        }
    )
    async with TieredCache(config) as cache:
        for i in range(0, n, per):
            await cache.store(resident[i : i + per], src[: len(resident[i : i + per])])
        cache.take_events()
        primary = cache.primary
        assert len(primary) == n

        def v_lookup(batch: list[OffloadKey]) -> int:
            hits = 0
            for key in batch:
                if vm.lookup(key, vctx) is not LookupResult.HIT:
                    break
                hits += 1
            return hits

        def v_lookup_touch(batch: list[OffloadKey]) -> None:
            vm.touch(batch[: v_lookup(batch)], vctx)

        def p_lookup(batch: list[OffloadKey]) -> None:
            primary.touch(batch[: primary.lookup(batch)])

        def each(
            fn: Callable[[list[OffloadKey]], object], batches: list[list[OffloadKey]]
        ) -> float:
            t0 = time.perf_counter()
            for batch in batches:
                fn(batch)
            return time.perf_counter() - t0

        async def t_lookups(batches: list[list[OffloadKey]]) -> float:
            t0 = time.perf_counter()
            for batch in batches:
                await cache.lookup([batch])
            return time.perf_counter() - t0

        async def t_stores(batches: list[list[OffloadKey]]) -> float:
            t0 = time.perf_counter()
            for batch in batches:
                await cache.store(batch, src)
            return time.perf_counter() - t0

        names = ("vllm_lookup", "vllm_lookup_touch", "tierkv_lookup", "primary_lookup")
        samples: dict[str, list[float]] = {k: [] for k in (*names, "vllm_store", "tierkv_store")}
        fresh = iter(keys(args.repeat * args.calls * 2 * per, "s"))
        rng = random.Random(0)
        for _ in range(args.repeat):
            starts = [rng.randrange(0, n - per) for _ in range(args.calls)]
            calls = [resident[j : j + per] for j in starts]
            samples["vllm_lookup"].append(each(v_lookup, calls))
            samples["vllm_lookup_touch"].append(each(v_lookup_touch, calls))
            samples["tierkv_lookup"].append(await t_lookups(calls))
            samples["primary_lookup"].append(each(p_lookup, calls))
            vbatches = [[next(fresh) for _ in range(per)] for _ in range(args.calls)]
            tbatches = [[next(fresh) for _ in range(per)] for _ in range(args.calls)]
            samples["vllm_store"].append(each(v_store, vbatches))
            samples["tierkv_store"].append(await t_stores(tbatches))
            cache.take_events()
    per_key = {k: statistics.median(v) * 1e6 / (args.calls * per) for k, v in samples.items()}
    print(f"{n:,} resident keys, {per}-key calls, median of {args.repeat} interleaved rounds")
    for name, us in per_key.items():
        print(f"  {name:16s} {us:6.3f} us/key")
    print(
        f"  lookup: tierkv/vLLM speed {per_key['vllm_lookup'] / per_key['tierkv_lookup']:.2f}x "
        f"(against lookup+touch {per_key['vllm_lookup_touch'] / per_key['tierkv_lookup']:.2f}x) "
        f"(primary alone {per_key['vllm_lookup'] / per_key['primary_lookup']:.2f}x); "
        f"store: {per_key['vllm_store'] / per_key['tierkv_store']:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resident", type=int, default=1_000_000)
    parser.add_argument("--per-call", type=int, default=64)
    parser.add_argument("--calls", type=int, default=500, help="calls per timed sample")
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    anyio.run(run, args)


if __name__ == "__main__":
    main()
