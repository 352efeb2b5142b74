"""Soak the cache core: many concurrent requests over a small primary, with redis
killed and restarted in the middle.

    .venv/bin/python scripts/soak_cache.py --seconds 180 --tasks 32

Chain: primary 16 MiB (1 MiB blocks) -> nvme (write-through, small capacity, so it
evicts) -> redis (write-through, a real redis-server this script starts). Each task
loops: pick one of a few shared prompt families and a length, `lookup`, `load` the hit
and check every loaded block byte for byte, then `store` the blocks the hit lacked.
Every block's bytes are a function of its key, so a block served for the wrong key
or half written is caught. At a third of the run redis is killed; it comes back
(empty) 15 s later. At the end: the cache is flushed and must be idle (every slot
free or evictable, nothing pinned, nothing promoting); the script prints counters and
exits non-zero on a wrong byte, an exception out of the cache, or a leaked slot.
Not a CI test (minutes, timing-dependent load); see the review report for results.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import anyio
import numpy as np
import torch

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.room import Kind

MIB = 1 << 20


def pattern(key: OffloadKey) -> torch.Tensor:
    """The bytes of `key`'s block: the key repeated (cheap, and unique per key)."""
    return torch.from_numpy(np.resize(np.frombuffer(key, dtype=np.uint8), MIB))


class Soak:
    def __init__(self, cache: TieredCache, families: list[list[OffloadKey]], seed: int) -> None:
        self.cache = cache
        self.families = families
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.wrong = 0
        self.errors: list[str] = []

    async def task(self, n: int, stop_at: float) -> None:
        rng = random.Random(self.rng.random())
        i = 0
        while time.monotonic() < stop_at:
            i += 1
            family = rng.choice(self.families)
            ks = family[: rng.randint(4, len(family))]
            ctx = ReqContext(request_id=f"t{n}-{i}")
            try:
                await self.request(ks, ctx)
            except Exception as exc:  # nothing a tier does may raise out of the cache
                self.errors.append(f"{type(exc).__name__}: {exc}")
                self.counts["exceptions"] += 1

    async def request(self, ks: list[OffloadKey], ctx: ReqContext) -> None:
        cache = self.cache
        hit = await cache.lookup([ks], ctx)
        self.counts["requests"] += 1
        self.counts["blocks_asked"] += len(ks)
        self.counts["blocks_hit"] += len(hit.keys_to_load)
        load = hit.keys_to_load
        if load:
            out = torch.empty(len(load), MIB, dtype=torch.uint8)
            result = await cache.load(load, out, ctx)
            self.counts["blocks_loaded"] += len(result.ok_keys)
            self.counts["blocks_load_failed"] += len(result.failed_keys)
            for key in result.failed_keys:
                self.failures[result.errors[key][:60]] += 1
            ok = set(result.ok_keys)
            for j, key in enumerate(load):
                if key in ok and not torch.equal(out[j], pattern(key)):
                    self.wrong += 1
        done = {k for k in load}
        rest = [k for k in ks if k not in done]
        if rest:
            src = torch.stack([pattern(k) for k in rest])
            stored = await cache.store(rest, src)
            self.counts["blocks_stored"] += len(stored.stored)
            self.counts["blocks_rejected"] += len(stored.rejected)
            if stored.rejected and stored.error:
                self.failures["store: " + stored.error[:60]] += len(stored.rejected)


async def run(args: argparse.Namespace) -> int:
    from tierkv_redis.testing import RedisServer

    workdir = Path(tempfile.mkdtemp(prefix="tierkv-soak-"))
    (workdir / "redis").mkdir()
    server = RedisServer(workdir / "redis")
    server.start()
    config = parse_config(
        {
            "namespace": "soak",
            "layout": {"block_bytes": MIB, "groups": [{"block_size": 16}]},
            "primary": {"capacity": f"{args.primary_mib}MiB", "pin_memory": False},
            "promotion_wait": args.promotion_wait,
            "tiers": [
                {
                    "type": "nvme",
                    "path": str(workdir / "nvme"),
                    "capacity": f"{args.nvme_mib}MiB",
                    "fsync": "never",
                },
                {
                    "type": "redis",
                    "url": server.url,
                    "recovery_after": "2s",
                    "write_policy": args.redis_policy,
                },
            ],
        }
    )
    families = [
        [
            make_offload_key(h, 0)
            for h in hash_token_blocks(list(range(16 * args.blocks)), 16, namespace=f"f{f}")
        ]
        for f in range(args.families)
    ]
    started = time.monotonic()
    stop_at = started + args.seconds
    async with TieredCache(config) as cache:
        soak = Soak(cache, families, args.seed)

        async def chaos() -> None:
            await anyio.sleep(args.seconds / 3)
            server.stop()
            print(f"[{time.monotonic() - started:6.1f}s] redis killed", flush=True)
            await anyio.sleep(15)
            server.start()
            print(f"[{time.monotonic() - started:6.1f}s] redis restarted (empty)", flush=True)

        async def report() -> None:
            while time.monotonic() < stop_at:
                await anyio.sleep(15)
                s = cache.stats()
                print(
                    f"[{time.monotonic() - started:6.1f}s] {dict(soak.counts)} "
                    f"redis breaker={s.tiers['redis']['breaker']} "
                    f"free={s.primary['free']} evictable={s.primary['evictable']} "
                    f"promoting={s.primary['promoting']} "
                    f"waiting={cache.primary.waiting(Kind.PROMOTION)}+"
                    f"{cache.primary.waiting(Kind.STORE)}",
                    flush=True,
                )

        async with anyio.create_task_group() as tg:
            tg.start_soon(chaos)
            tg.start_soon(report)
            for n in range(args.tasks):
                tg.start_soon(soak.task, n, stop_at)
        await cache.flush()
        p = cache.primary
        leaked = p.num_blocks - p.num_free - p.num_evictable
        pinned = sum(1 for k in p.keys_in_slots() if p.readers(k) or not p.is_ready(k))
        stats = cache.stats()
    server.close()
    print("counts:", dict(soak.counts))
    hit = soak.counts["blocks_hit"] or 1
    print(
        f"shed share of hit blocks: {soak.counts['blocks_load_failed'] / hit:.1%}; "
        f"store throughput: {soak.counts['blocks_stored'] / args.seconds:.1f} blocks/s; "
        f"load throughput: {soak.counts['blocks_loaded'] / args.seconds:.1f} blocks/s"
    )
    print("failed keys by reason:", dict(soak.failures.most_common(8)))
    print("primary:", {k: stats.primary[k] for k in sorted(stats.primary)})
    for name, tier in stats.tiers.items():
        keep = ("blocks_stored", "blocks_loaded", "errors", "failed_keys", "drops", "breaker")
        keep += ("skipped_unhealthy", "job_latency")
        print(f"{name}:", {k: tier.get(k) for k in keep})
    print(
        f"wrong blocks: {soak.wrong}; exceptions: {len(soak.errors)}; leaked slots: {leaked}; "
        f"pinned after idle: {pinned}; promoting: {cache.core.index.promoting}"
    )
    for line in Counter(soak.errors).most_common(5):
        print("  exception:", line)
    bad = soak.wrong or soak.errors or leaked or pinned or cache.core.index.promoting
    return 1 if bad else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=180)
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--families", type=int, default=6)
    parser.add_argument("--blocks", type=int, default=40, help="blocks per prompt family")
    parser.add_argument("--primary-mib", type=int, default=16)
    parser.add_argument("--nvme-mib", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--promotion-wait", default="50ms", help="how long a load may wait for promotion room"
    )
    parser.add_argument(
        "--redis-policy", default="write_through", choices=["write_through", "write_back"]
    )
    args = parser.parse_args()
    sys.exit(anyio.run(run, args))


if __name__ == "__main__":
    main()
