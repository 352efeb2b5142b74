"""The chain a measurement runs on: the user's chain rebuilt with the bench's layout,
its own namespace and primary, and tiers written through (`bench_chain`,
`written_through`, `bench_config`); the keys it stores (`bench_keys`); and emptying
the primary so loads come from below (`empty_primary`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from hashlib import blake2b
from typing import Any

import anyio
from pydantic import ByteSize

from tierkv.bench.options import BenchOptions
from tierkv.cache import TieredCache
from tierkv.config import CacheConfig
from tierkv.contract.keys import OffloadKey, make_offload_key
from tierkv.contract.tier import TierConfig
from tierkv.layout import GroupSpec, KVLayout
from tierkv.primary import PrimaryConfig

BLOCK_TOKENS = 16  # tokens per block in the bench layout (any value works)


def bench_chain(
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


def written_through(tier: TierConfig, inflight_bytes: int) -> TierConfig:
    """`tier` as the bench drives it: write-through, room for `inflight_bytes` in
    flight, and required (a tier that cannot open is an error here)."""
    return tier.model_copy(
        update={
            "write_policy": "write_through",
            "max_inflight_bytes": max(tier.max_inflight_bytes, ByteSize(inflight_bytes)),
            "required": True,
        }
    )


def bench_config(
    chain: CacheConfig, tier: TierConfig | None, options: BenchOptions, namespace: str
) -> CacheConfig:
    n, block = options.num_blocks, options.block_bytes
    tiers = [] if tier is None else [written_through(tier, n * block + block)]
    return bench_chain(chain, namespace, block, n, tiers, promotion_reserve=1.0)


def bench_keys(n: int, tag: str) -> list[OffloadKey]:
    """`n` distinct keys for `tag` (the same ones for the same tag), shaped like an
    engine's block hashes: 32 bytes from blake2b, so they spread over an nvme tier's
    fan-out directories and a Redis Cluster's slots as real keys do. (Keys that began
    with the tag put every block of a run into one directory, which measured neither
    the layout's cost nor its spread.)"""
    seed = tag.encode()
    return [
        make_offload_key(blake2b(seed + i.to_bytes(8, "big"), digest_size=32).digest(), 0)
        for i in range(n)
    ]


async def check_reachable(
    chain: CacheConfig, media: Sequence[str], progress: Callable[[str], None]
) -> None:
    """Open and close every tier of `chain` named in `media` that keeps no files (a
    server, a bucket), before anything is measured: one that cannot open (an
    unreachable Redis) fails the run now, with `TierUnavailable` naming it, not after
    the media before it were measured. A tier that keeps files is left to its own
    phase: opening it here would create a directory the bench does not use."""
    from tierkv.contract.errors import TierUnavailable
    from tierkv.contract.slab import PrimaryView
    from tierkv.demo.scratch import path_fields
    from tierkv.registry import create_tier

    block = int(chain.layout.block_bytes)
    view = PrimaryView(bytearray(block), block, chain.namespace)
    for name, tier_config in zip(chain.tier_names(), chain.tiers):
        if name not in media or path_fields(tier_config):
            continue
        progress(f"{name}: checking it opens")
        tier = create_tier(tier_config, view)
        try:
            with anyio.fail_after(tier_config.job_timeout):
                await tier.open()
                await tier.close()
        except TierUnavailable as exc:
            raise TierUnavailable(f"tier {name} cannot open, nothing measured: {exc}") from exc
        except (OSError, TimeoutError) as exc:
            raise TierUnavailable(
                f"tier {name} cannot open, nothing measured: {type(exc).__name__}: {exc}"
            ) from exc


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
