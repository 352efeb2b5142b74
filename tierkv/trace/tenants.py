"""`tierkv bench trace FILE --tenant-report A`: what the other tenants of a trace cost
tenant A, with or without the cache's tenant quotas.

Two replays per size and policy, each through a fresh chain of the same sizes,
admission and quotas: (a) tenant A's requests alone, (b) the whole trace. Per replay,
A's served share is the blocks A's lookups found over the blocks they asked for
(`hits / (hits + misses)` of A's row in `TieredCache.stats().tenants`, the cache's own
per-tenant count), and (b)/(a) is the part of A's hits the mix leaves it. A flooder
(`tierkv.trace.conversations` `--flooder`: tenant B's one-off prompts at 10x A's rate)
pushes A's conversations out of an LRU chain long before their next turn, so (b)/(a)
falls well under 1; quotas (`quotas`, the cache config's `tenants.quotas`) that
guarantee A its share of each tier are what should bring it back near 1. The same
command runs with and without them, so the two figures sit side by side.

Sizes are of A's working set: a share (`2%`) is of tenant A's distinct blocks, not
the trace's, so the chain is the same whatever the other tenants add. A request with
no tenant is the default tenant's (`default`, as the cache reports it).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierkv.contract.keys import OffloadKey
from tierkv.contract.tenants import DEFAULT_TENANT
from tierkv.trace.format import TraceError, TraceRequest, read_trace, request_keys
from tierkv.trace.reference import infinite_cache_hits
from tierkv.trace.replay import ReplayOptions, ReplayReport, primary_and_tier_blocks, replay

Keyed = Sequence[tuple[TraceRequest, Sequence[OffloadKey]]]


@dataclass(frozen=True)
class TenantReportOptions:
    """The trace, the tenant whose share is reported, and the chain: a primary and
    tier capacities (`2%`: of the tenant's distinct blocks; or block counts), one pair
    of replays per capacity x admission policy; `quotas` as in `ReplayOptions`."""

    path: Path
    tenant: str
    limit: int | None = None
    block_bytes: int = 4 << 10
    primary: str = "2%"
    capacities: tuple[str, ...] = ("25%",)
    tiers: tuple[str, ...] = ("nvme",)
    admissions: tuple[str, ...] = ("all",)
    directory: Path | None = None
    redis_url: str | None = None
    quotas: Mapping[str, Any] | None = field(default=None, hash=False)


def tenant_of(request: TraceRequest) -> str:
    """The request's tenant as the cache reports it (no tenant: `default`)."""
    return request.tenant or DEFAULT_TENANT


async def run_tenant_report(
    o: TenantReportOptions, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Every pair of replays of `o`, as a JSON-able report (`runs`, in table order)."""
    say = progress or (lambda _: None)
    requests = read_trace(o.path, o.limit)
    keyed = [(r, request_keys(r)) for r in requests]
    own = [(r, k) for r, k in keyed if tenant_of(r) == o.tenant]
    counts = Counter(tenant_of(r) for r in requests)
    if not own:
        named = ", ".join(sorted(counts))
        raise TraceError(f"{o.path}: no request of tenant {o.tenant!r} (its tenants: {named})")
    own_keys = [k for _, k in own]
    asked = sum(len(k) for k in own_keys)
    if not asked:
        raise TraceError(f"{o.path}: tenant {o.tenant!r} asks for no block (empty hash_ids)")
    distinct = len({key for keys in own_keys for key in keys})
    report: dict[str, Any] = {
        "trace": str(o.path),
        "tenant": o.tenant,
        "requests": len(requests),
        "tenants": dict(counts),
        "tenant_blocks_asked": asked,
        "tenant_distinct_blocks": distinct,
        "tenant_infinite_cache_hit_rate": infinite_cache_hits(own_keys) / asked,
        "tiers": list(o.tiers),
        "block_bytes": o.block_bytes,
        "quotas": dict(o.quotas) if o.quotas else None,
        "runs": [],
    }
    for capacity in o.capacities:
        primary, tier = primary_and_tier_blocks(distinct, o.primary, capacity)
        for admission in o.admissions:
            options = ReplayOptions(
                block_bytes=o.block_bytes,
                primary_blocks=primary,
                tiers=o.tiers,
                tier_blocks=tier,
                admission=admission,
                directory=o.directory,
                redis_url=o.redis_url,
                quotas=o.quotas,
            )
            label = f"tier {capacity} ({tier} blocks), admission {admission}"
            say(f"{label}: tenant {o.tenant} alone")
            alone = _share(await replay(own, options), o.tenant)
            say(f"{label}: the whole trace")
            mix = _share(await replay(keyed, options), o.tenant)
            report["runs"].append(
                {
                    "primary": o.primary,
                    "primary_blocks": primary,
                    "tier_capacity": capacity,
                    "tier_blocks": tier,
                    "admission": admission,
                    "alone": alone,
                    "mix": mix,
                    "mix_vs_alone": (
                        mix["served_share"] / alone["served_share"]
                        if alone["served_share"]
                        else None
                    ),
                }
            )
    return report


def _share(report: ReplayReport, tenant: str) -> dict[str, Any]:
    """One replay as the tenant saw it: its hits over the blocks it looked up (the
    cache's per-tenant count), beside every tenant's row."""
    row = report.tenants.get(tenant, {})
    hits, misses = int(row.get("hits", 0)), int(row.get("misses", 0))
    looked_up = hits + misses
    return {
        "requests": report.requests,
        "hits": hits,
        "looked_up": looked_up,
        "served_share": hits / looked_up if looked_up else 0.0,
        "failed_loads": report.failed_loads,
        "evictions": dict(report.evictions),
        "seconds": report.seconds,
        "tenants": report.tenants,
    }


def tenant_lines(report: Mapping[str, Any]) -> list[str]:
    """The human summary of `run_tenant_report`'s report: one row per size and
    policy, the tenant's served share alone and in the mix, and their ratio."""
    t = report["tenant"]
    others = sum(n for name, n in report["tenants"].items() if name != t)
    quotas = report["quotas"]
    lines = [
        f"trace {report['trace']}: {report['requests']:,} requests (tenant {t}: "
        f"{report['tenants'][t]:,}, other tenants: {others:,}); tenant {t} asks "
        f"{report['tenant_blocks_asked']:,} blocks, {report['tenant_distinct_blocks']:,} "
        f"distinct; an infinite cache serves it "
        f"{report['tenant_infinite_cache_hit_rate']:.1%}",
        f"chain: tiers {','.join(report['tiers'])}, {report['block_bytes']:,}-byte blocks; "
        f"quotas: {json.dumps(quotas, sort_keys=True) if quotas else 'none'}",
        "",
        f"{'primary':>13} {'tier cap':>14} {'admission':>9} | {t + ' alone':>10} "
        f"{'hits/asked':>17} | {t + ' in mix':>10} {'hits/asked':>17} | {'mix/alone':>9}",
    ]
    for run in report["runs"]:
        alone, mix = run["alone"], run["mix"]
        ratio = run["mix_vs_alone"]
        lines.append(
            f"{run['primary']:>5} ({run['primary_blocks']:>5,}) "
            f"{run['tier_capacity']:>5} ({run['tier_blocks']:>6,}) {run['admission']:>9} | "
            f"{alone['served_share']:>10.1%} {_fraction(alone):>17} | "
            f"{mix['served_share']:>10.1%} {_fraction(mix):>17} | "
            f"{'-' if ratio is None else f'{ratio:.2f}':>9}"
        )
    lines += [
        "",
        f"primary, tier cap: share of tenant {t}'s distinct blocks (blocks); {t} alone: a "
        f"replay of {t}'s requests only; {t} in mix: of the whole trace, through a fresh "
        f"chain of the same sizes and quotas; share: blocks {t}'s lookups hit / blocks "
        f"they asked for (the cache's stats().tenants); mix/alone: the part of its hits "
        f"the other tenants leave {t}",
    ]
    return lines


def _fraction(share: Mapping[str, Any]) -> str:
    return f"{share['hits']:,}/{share['looked_up']:,}"
