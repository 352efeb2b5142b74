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


async def run_roundtrip(
    config: CacheConfig, num_blocks: int, seed: int, *, remove_after: bool = False
) -> dict[str, Any]:
    """Run the round trip; return a report with `ok` and printable `lines`. Tiers are
    named as the chain names them (a YAML `name:`, else the type); with
    `remove_after`, every tier is asked to remove the blocks before it closes."""
    rng = random.Random(seed)
    group = config.layout.groups[0]
    primary = PrimaryTier.from_config(config.primary, config.layout, config.namespace)
    tiers = [create_tier(t, primary.view) for t in config.tiers]
    names = config.tier_names()
    ctx = ReqContext(request_id="roundtrip")

    tokens = [rng.randrange(32000) for _ in range(num_blocks * group.block_size)]
    keys = [
        make_offload_key(h, 0)
        for h in hash_token_blocks(tokens, group.block_size, namespace=config.namespace)
    ]
    for tier in tiers:
        await tier.open()
    try:
        t0 = time.perf_counter()
        expected = await _store_all(primary, tiers, keys, rng)
        store_s = time.perf_counter() - t0

        in_primary = primary.lookup(keys)
        resident = sum(1 for k in keys if primary.is_ready(k))
        per_tier = {n: sum(await t.lookup(keys, ctx)) for n, t in zip(names, tiers)}

        t0 = time.perf_counter()
        counts, missing, mismatched = await _load_all(primary, tiers, keys, expected, ctx)
        promoted = dict(zip(names, counts))
        load_s = time.perf_counter() - t0
    finally:
        for tier in tiers:
            try:
                if remove_after:
                    await tier.remove(keys)
            finally:
                await tier.close()

    report: dict[str, Any] = {
        "ok": not mismatched and not missing,
        "blocks": len(keys),
        "block_bytes": primary.view.block_bytes,
        "primary_blocks": primary.num_blocks,
        "primary_resident_after_store": resident,
        "tier_blocks": per_tier,
        "promoted": promoted,
        "missing": len(missing),
        "mismatched": len(mismatched),
        "store_seconds": store_s,
        "load_seconds": load_s,
    }
    report["lines"] = _lines(report, config.primary.eviction, in_primary)
    return report


async def _store_all(
    primary: PrimaryTier,
    tiers: Sequence[SecondaryTierManager],
    keys: list[OffloadKey],
    rng: random.Random,
) -> dict[OffloadKey, bytes]:
    """Store `keys` a few at a time: random bytes into the primary's slots, then on to
    every tier, so later batches push earlier ones out of a small primary. Returns
    the bytes stored under each key."""
    block_bytes = primary.view.block_bytes
    batch = max(1, min(8, primary.num_blocks // 2))
    expected: dict[OffloadKey, bytes] = {}
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
    return expected


async def _load_all(
    primary: PrimaryTier,
    tiers: Sequence[SecondaryTierManager],
    keys: list[OffloadKey],
    expected: dict[OffloadKey, bytes],
    ctx: ReqContext,
) -> tuple[list[int], list[OffloadKey], list[OffloadKey]]:
    """Read every key back from the primary, promoting the ones it no longer holds;
    return the blocks promoted per tier (in chain order), the keys no tier had, and
    the keys whose bytes differ from `expected`."""
    promoted = [0] * len(tiers)
    mismatched: list[OffloadKey] = []
    missing: list[OffloadKey] = []
    for key in keys:
        if not primary.is_ready(key):
            source = await _promote(primary, tiers, key, ctx)
            if source is None:
                missing.append(key)
                continue
            promoted[source] += 1
        [slot] = primary.prepare_load([key])
        if bytes(primary.view.block(slot)) != expected[key]:
            mismatched.append(key)
        primary.complete_load([key])
        primary.touch([key])
    return promoted, missing, mismatched


async def _promote(
    primary: PrimaryTier, tiers: Sequence[SecondaryTierManager], key: OffloadKey, ctx: ReqContext
) -> int | None:
    """Load `key` into a primary slot from the first tier that has it; return that
    tier's position, or None when no tier could (the slot is then given back)."""
    prepared = primary.prepare_store([key])
    if prepared is None:
        raise RuntimeError("primary could not make room for a promotion")
    slot = prepared.slots[0]
    source = None
    for i, tier in enumerate(tiers):
        result = await tier.load(JobMetadata(next(_job_ids), (key,), (slot,), ctx))
        if result.ok:
            source = i
            break
    primary.complete_store([key], success=source is not None)
    return source


def _lines(report: dict[str, Any], eviction: str, leading: int) -> list[str]:
    """The report for a person; `leading`: the prefix of keys the primary held after
    the store."""
    blocks, block_bytes, per_tier = report["blocks"], report["block_bytes"], report["tier_blocks"]
    return [
        f"tierkv roundtrip: {blocks} blocks of {format_size(block_bytes)} "
        f"({format_size(blocks * block_bytes)}), primary holds {report['primary_blocks']} "
        f"blocks ({eviction}), tiers: {', '.join(per_tier) or 'none'}",
        f"  stored in {report['store_seconds'] * 1e3:.1f} ms; after the store the primary "
        f"holds {report['primary_resident_after_store']} blocks (leading prefix {leading})",
        *(f"  tier {name}: holds {n} of {blocks} blocks" for name, n in per_tier.items()),
        *(f"  promoted from {name}: {n} blocks" for name, n in report["promoted"].items()),
        f"  loaded all blocks back in {report['load_seconds'] * 1e3:.1f} ms",
        "  result: every block read back byte-identical"
        if report["ok"]
        else f"  result: FAILED: {report['missing']} missing, {report['mismatched']} mismatched",
    ]
