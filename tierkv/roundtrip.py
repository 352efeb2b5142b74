"""`tierkv roundtrip`'s job: store -> lookup -> load of random blocks through a
`TieredCache` built from the chain, every byte checked.

The chain runs as a server would run it: its tiers open as the cache opens them (an
optional tier, `required: false`, that cannot open is skipped, and the cache runs
without it), the blocks are stored a few at a time with `TieredCache.store`, so each
tier takes what its `write_policy` and `admission` give it and later stores push
earlier blocks out of a small primary, and `flush()` waits for the cascades (and the
write-back). One lookup of every block follows, then one load of every block, each
checked against the bytes stored.

What counts as a failure: a block read back with other bytes; a block some tier took
and no longer gives back (evicted for room, lost); a block that a tier taking every
block (`write_through` with `admission: all`, or `write_back`) was never written to
(its store failed or was dropped); a block the cache rejected. A block the chain's
policies kept out of every tier below the primary (`write_through_selective` before
`min_hits` lookups, an admission policy's verdict, or no tier opened) and that the
primary has since evicted is reported, not failed: that is the chain as configured.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tierkv.cache import TieredCache
from tierkv.config import CacheConfig
from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.contract.tier import TierConfig
from tierkv.contract.units import format_size
from tierkv.layout import GroupSpec
from tierkv.primary import MEDIUM as PRIMARY_MEDIUM

REQUEST = "tierkv-roundtrip"


def takes_every_block(tier: TierConfig) -> bool:
    """Whether the tier's policies write it every block stored (by the end of a
    `flush`): write-through with admission `all`, or write-back."""
    if tier.write_policy == "write_back":
        return True
    return tier.write_policy == "write_through" and tier.admission == "all"


def policy_text(tier: TierConfig) -> str:
    """What the tier's policies write to it, for a person (empty for every block)."""
    if tier.write_policy == "write_through_selective":
        return f"write_through_selective: only blocks looked up {tier.min_hits} times"
    if tier.admission != "all":
        return f"admission {tier.admission}: only blocks it judges likely to be read again"
    return ""


@dataclass
class _Tally:
    """What the tiers did with the blocks: per tier, the keys it reported stored and
    removed (from the cache's events), and the keys each held after the store."""

    stored: dict[str, set[OffloadKey]] = field(default_factory=dict)
    removed: dict[str, set[OffloadKey]] = field(default_factory=dict)

    def take(self, cache: TieredCache) -> None:
        for event in cache.take_events():
            if event.medium == PRIMARY_MEDIUM:
                continue
            into = self.removed if event.removed else self.stored
            into.setdefault(event.medium, set()).update(event.keys)


def roundtrip_chain(config: CacheConfig) -> CacheConfig:
    """`config` with one full-attention group (the first group's block size): the
    round trip stores one sequence of blocks, and a lookup of it is a plain prefix."""
    group = config.layout.groups[0]
    layout = config.layout.model_copy(
        update={"groups": (GroupSpec(block_size=group.block_size),), "checkpoint_every": None}
    )
    return config.model_copy(update={"layout": layout})


async def run_roundtrip(
    config: CacheConfig, num_blocks: int, seed: int, *, remove_after: bool = False
) -> dict[str, Any]:
    """Run the round trip through a `TieredCache` of `config`; return a report with
    `ok` and printable `lines`. Tiers are named as the chain names them (a YAML
    `name:`, else the type); with `remove_after`, every tier that opened is asked to
    remove the blocks before the cache closes."""
    config = roundtrip_chain(config)
    rng = random.Random(seed)
    block_size = config.layout.groups[0].block_size
    tokens = [rng.randrange(32000) for _ in range(num_blocks * block_size)]
    keys = [
        make_offload_key(h, 0)
        for h in hash_token_blocks(tokens, block_size, namespace=config.namespace)
    ]
    ctx = ReqContext(request_id=REQUEST)
    cache = TieredCache(config)
    block_bytes = cache.block_bytes
    expected = {k: rng.randbytes(block_bytes) for k in keys}
    tally = _Tally()
    report: dict[str, Any] = {
        "blocks": len(keys),
        "block_bytes": block_bytes,
        "primary_blocks": cache.primary.num_blocks,
    }
    async with cache:
        handles = {h.name: h for h in cache.core.tiers}
        opened = [name for name, h in handles.items() if h.opened]
        report["skipped"] = {
            name: h.open_error or "it failed to open" for name, h in handles.items() if not h.opened
        }
        try:
            t0 = time.perf_counter()
            rejected = set(await _store_all(cache, keys, expected, tally))
            report["store_seconds"] = time.perf_counter() - t0
            report["rejected"] = len(rejected)
            report["primary_resident_after_store"] = sum(
                1 for k in keys if cache.primary.is_ready(k)
            )
            report["leading_prefix"] = cache.primary.lookup(keys)
            held = {name: await cache.tier(name).lookup(keys, ctx) for name in opened}
            report["tier_blocks"] = {name: sum(flags) for name, flags in held.items()}
            hit = await cache.lookup([keys], ctx)
            report["lookup_hit_blocks"] = len(hit.keys_to_load)
            t0 = time.perf_counter()
            outcome = await _load_all(cache, keys, expected, ctx)
            report["load_seconds"] = time.perf_counter() - t0
            tally.take(cache)
            stats = cache.stats().tiers
        finally:
            if remove_after:
                for name in opened:
                    await cache.tier(name).remove(keys)
    report.update(outcome.summary(keys, held, tally, config, opened, rejected))
    report["stats"] = {
        name: {
            k: tier_stats[k]
            for k in ("blocks_stored", "declined", "drops", "failed_keys", "errors")
        }
        for name, tier_stats in stats.items()
    }
    report["ok"] = not (
        report["mismatched"] or report["missing"] or report["not_written"] or rejected
    )
    report["lines"] = _lines(report, config)
    return report


async def _store_all(
    cache: TieredCache,
    keys: list[OffloadKey],
    expected: dict[OffloadKey, bytes],
    tally: _Tally,
) -> list[OffloadKey]:
    """Store `keys` a few at a time (as a server stores its requests' blocks), so later
    stores push earlier ones out of a small primary, then flush; return the keys the
    cache rejected."""
    batch = max(1, min(8, cache.primary.num_blocks // 2))
    rejected: list[OffloadKey] = []
    for start in range(0, len(keys), batch):
        chunk = keys[start : start + batch]
        result = await cache.store(chunk, [expected[k] for k in chunk])
        rejected.extend(result.rejected)
        tally.take(cache)
    await cache.flush()
    tally.take(cache)
    return rejected


@dataclass
class _Loaded:
    """The load of every block: where each ok block came from, and which failed or
    differ."""

    sources: dict[OffloadKey, str]
    failed: dict[OffloadKey, str]
    mismatched: list[OffloadKey]

    def summary(
        self,
        keys: Sequence[OffloadKey],
        held: dict[str, list[bool]],
        tally: _Tally,
        config: CacheConfig,
        opened: list[str],
        rejected: set[OffloadKey],
    ) -> dict[str, Any]:
        """Each failed block sorted by why: lost (a tier took it and does not give it
        back), not written (a tier taking every block never got it), not kept (the
        policies kept it out of every tier, and the primary evicted it)."""
        everyone = {
            name
            for name, tier in zip(config.tier_names(), config.tiers)
            if name in opened and takes_every_block(tier)
        }
        position = {k: i for i, k in enumerate(keys)}
        lost: list[OffloadKey] = []
        not_kept: list[OffloadKey] = []
        evicted = 0
        for key in self.failed:
            if key in rejected:
                continue
            took = [n for n in opened if key in tally.stored.get(n, ())]
            claims = [n for n in opened if held[n][position[key]]]
            if took or claims:
                lost.append(key)
                evicted += any(key in tally.removed.get(n, ()) for n in took)
            else:
                not_kept.append(key)
        # blocks a tier that takes every block never stored (failed or dropped)
        not_written = {
            name: sum(1 for k in keys if k not in tally.stored.get(name, ()) and k not in rejected)
            for name in sorted(everyone)
        }
        served: dict[str, int] = {}
        for source in self.sources.values():
            served[source] = served.get(source, 0) + 1
        return {
            "served": served,
            "promoted": {name: served.get(name, 0) for name in opened},
            "missing": len(lost),
            "evicted_by_tiers": evicted,
            "not_kept": len(not_kept),
            "not_written": {n: c for n, c in not_written.items() if c},
            "mismatched": len(self.mismatched),
            "errors": sorted(set(self.failed[k] for k in lost))[:3],
        }


async def _load_all(
    cache: TieredCache, keys: list[OffloadKey], expected: dict[OffloadKey, bytes], ctx: ReqContext
) -> _Loaded:
    """Load every key back (promoting what the primary no longer holds) and compare."""
    block_bytes = cache.block_bytes
    out = [bytearray(block_bytes) for _ in keys]
    result = await cache.load(keys, out, ctx)
    cache.end_request(ctx)
    ok = set(result.ok_keys)
    mismatched = [k for k, buf in zip(keys, out) if k in ok and bytes(buf) != expected[k]]
    return _Loaded(
        sources={k: result.sources.get(k, "?") for k in result.ok_keys},
        failed={k: result.errors.get(k, "failed") for k in result.failed_keys},
        mismatched=mismatched,
    )


def _tier_line(name: str, tier: TierConfig, report: dict[str, Any]) -> str:
    blocks = report["blocks"]
    if name in report["skipped"]:
        return (
            f"  tier {name}: skipped: optional (required: false) and cannot open "
            f"({report['skipped'][name]}); the cache runs without it"
        )
    policy = policy_text(tier)
    line = f"  tier {name}: holds {report['tier_blocks'][name]} of {blocks} blocks"
    notes = [policy] if policy else []
    stats = report["stats"].get(name, {})
    if stats.get("declined"):
        notes.append(f"{stats['declined']} declined by admission")
    missed = report["not_written"].get(name)
    if missed:
        notes.append(
            f"{missed} never written: {stats.get('failed_keys', 0)} failed, "
            f"{stats.get('drops', 0)} dropped (max_inflight_bytes), "
            f"{stats.get('errors', 0)} errors"
        )
    return line + (f" ({'; '.join(notes)})" if notes else "")


def _lines(report: dict[str, Any], config: CacheConfig) -> list[str]:
    """The report for a person."""
    blocks, block_bytes = report["blocks"], report["block_bytes"]
    names = config.tier_names()
    lines = [
        f"tierkv roundtrip: {blocks} blocks of {format_size(block_bytes)} "
        f"({format_size(blocks * block_bytes)}), primary holds {report['primary_blocks']} "
        f"blocks ({config.primary.eviction}), tiers: {', '.join(names) or 'none'}",
        f"  stored in {report['store_seconds'] * 1e3:.1f} ms through TieredCache (each "
        f"tier's write policy); after the store the primary holds "
        f"{report['primary_resident_after_store']} blocks (leading prefix "
        f"{report['leading_prefix']})",
        *(_tier_line(name, tier, report) for name, tier in zip(names, config.tiers)),
        f"  lookup: a prefix of {report['lookup_hit_blocks']} of {blocks} blocks found",
        *(
            f"  promoted from {name}: {n} blocks"
            for name, n in report["served"].items()
            if name != PRIMARY_MEDIUM
        ),
        f"  loaded {sum(report['served'].values())} blocks back in "
        f"{report['load_seconds'] * 1e3:.1f} ms ({report['served'].get(PRIMARY_MEDIUM, 0)} "
        "from the primary)",
    ]
    if report["not_kept"]:
        lines.append(
            f"  not kept: {report['not_kept']} blocks the chain's policies kept out of every "
            "tier below the primary, which has since evicted them (as configured)"
        )
    problems = []
    if report["mismatched"]:
        problems.append(f"{report['mismatched']} mismatched")
    if report["missing"]:
        evicted = report["evicted_by_tiers"]
        problems.append(
            f"{report['missing']} missing (a tier took them and does not give them back"
            + (f"; {evicted} evicted by their tier for room" if evicted else "")
            + ")"
        )
    for name, n in report["not_written"].items():
        problems.append(f"{n} never written to {name}")
    if report["rejected"]:
        problems.append(f"{report['rejected']} rejected by the cache")
    if problems:
        lines.append(f"  result: FAILED: {', '.join(problems)}")
        lines.extend(f"    {error}" for error in report["errors"])
    elif report["not_kept"]:
        lines.append("  result: every block the chain kept read back byte-identical")
    else:
        lines.append("  result: every block read back byte-identical")
    return lines
