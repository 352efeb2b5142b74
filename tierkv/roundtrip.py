"""The placeholder main job: a real store -> lookup -> load round trip.

Blocks of a token sequence are hashed, stored into the primary slab, written on to
every secondary tier, pushed out of the primary by later blocks, looked up, and loaded
back (promoted from the first tier that has them). Every block must come back
byte-identical. The orchestrator issue replaces the hand-driven steps below with
`TieredCache`; until then this is what `tierkv roundtrip` runs.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence
from typing import Any

from tierkv.config import CacheConfig
from tierkv.contract.jobs import JobMetadata, ReqContext
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.contract.tier import SecondaryTierManager
from tierkv.contract.units import format_size
from tierkv.primary import PrimaryTier
from tierkv.registry import create_tier

_job_ids = itertools.count(1)


async def _cascade(
    primary: PrimaryTier, tiers: Sequence[SecondaryTierManager], keys: list[OffloadKey]
) -> None:
    slots = primary.prepare_load(keys)  # readers keep the slots from eviction meanwhile
    try:
        for tier in tiers:
            result = await tier.store(JobMetadata(next(_job_ids), tuple(keys), tuple(slots)))
            if not result.ok:
                raise RuntimeError(f"tier {tier.name} failed to store: {result.error}")
    finally:
        primary.complete_load(keys)


async def run_roundtrip(config: CacheConfig, num_blocks: int, seed: int) -> dict[str, Any]:
    """Run the round trip; return a report with `ok` and printable `lines`."""
    rng = random.Random(seed)
    group = config.layout.groups[0]
    primary = PrimaryTier.from_config(config.primary, config.layout, config.namespace)
    tiers = [create_tier(t, primary.view) for t in config.tiers]
    ctx = ReqContext(request_id="roundtrip")
    block_bytes = primary.view.block_bytes
    batch = max(1, min(8, primary.num_blocks // 2))

    tokens = [rng.randrange(32000) for _ in range(num_blocks * group.block_size)]
    keys = [
        make_offload_key(h, 0)
        for h in hash_token_blocks(tokens, group.block_size, namespace=config.namespace)
    ]
    expected: dict[OffloadKey, bytes] = {}
    for tier in tiers:
        await tier.open()
    try:
        t0 = time.perf_counter()
        for start in range(0, len(keys), batch):
            chunk = keys[start : start + batch]
            prepared = primary.prepare_store(chunk)
            if prepared is None:
                raise RuntimeError("primary could not make room for a store")
            for key, slot in zip(prepared.keys_to_store, prepared.slots):
                data = rng.randbytes(block_bytes)
                primary.view.block(slot)[:] = data
                expected[key] = data
            primary.complete_store(prepared.keys_to_store, success=True)
            if tiers:
                await _cascade(primary, tiers, prepared.keys_to_store)
        store_s = time.perf_counter() - t0

        in_primary = primary.lookup(keys)
        resident = sum(1 for k in keys if primary.is_ready(k))
        per_tier = {t.name: sum(await t.lookup(keys, ctx)) for t in tiers}

        t0 = time.perf_counter()
        promoted: dict[str, int] = {t.name: 0 for t in tiers}
        mismatched: list[OffloadKey] = []
        missing: list[OffloadKey] = []
        for key in keys:
            if not primary.is_ready(key):
                prepared = primary.prepare_store([key])
                if prepared is None:
                    raise RuntimeError("primary could not make room for a promotion")
                slot = prepared.slots[0]
                source = None
                for tier in tiers:
                    result = await tier.load(JobMetadata(next(_job_ids), (key,), (slot,), ctx))
                    if result.ok:
                        source = tier.name
                        break
                primary.complete_store([key], success=source is not None)
                if source is None:
                    missing.append(key)
                    continue
                promoted[source] += 1
            [slot] = primary.prepare_load([key])
            if bytes(primary.view.block(slot)) != expected[key]:
                mismatched.append(key)
            primary.complete_load([key])
            primary.touch([key])
        load_s = time.perf_counter() - t0
    finally:
        for tier in tiers:
            await tier.close()

    ok = not mismatched and not missing
    total = len(keys) * block_bytes
    lines = [
        f"tierkv roundtrip: {len(keys)} blocks of {format_size(block_bytes)} "
        f"({format_size(total)}), primary holds {primary.num_blocks} blocks "
        f"({config.primary.eviction}), tiers: {', '.join(per_tier) or 'none'}",
        f"  stored in {store_s * 1e3:.1f} ms; after the store the primary holds "
        f"{resident} blocks (leading prefix {in_primary})",
        *(f"  tier {name}: holds {n} of {len(keys)} blocks" for name, n in per_tier.items()),
        *(f"  promoted from {name}: {n} blocks" for name, n in promoted.items()),
        f"  loaded all blocks back in {load_s * 1e3:.1f} ms",
        "  result: every block read back byte-identical"
        if ok
        else f"  result: FAILED: {len(missing)} missing, {len(mismatched)} mismatched",
    ]
    return {
        "ok": ok,
        "blocks": len(keys),
        "block_bytes": block_bytes,
        "primary_blocks": primary.num_blocks,
        "primary_resident_after_store": resident,
        "tier_blocks": per_tier,
        "promoted": promoted,
        "missing": len(missing),
        "mismatched": len(mismatched),
        "store_seconds": store_s,
        "load_seconds": load_s,
        "lines": lines,
    }
