"""`tierkv bench trace FILE`: replay a trace once per tier capacity and admission
policy, and report each beside the trace's own references and a TTFT estimate."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tierkv.stats import percentile
from tierkv.trace.costmodel import PRIMARY, CostModel, arrival_scale_for
from tierkv.trace.format import read_trace, request_keys
from tierkv.trace.reference import infinite_cache_hits, lru_hits
from tierkv.trace.replay import ReplayOptions, ReplayReport, primary_and_tier_blocks, replay
from tierkv.units import approx_size, format_size


@dataclass(frozen=True)
class TraceBenchOptions:
    path: Path
    limit: int | None = None
    block_bytes: int = 64 << 10
    primary: str = "2%"
    tier_capacities: tuple[str, ...] = ("10%", "25%")
    tiers: tuple[str, ...] = ("nvme",)
    admissions: tuple[str, ...] = ("all", "reuse")
    redis_url: str | None = None
    directory: Path | None = None
    load: float = 0.7
    backlog_load: float = 1.3
    model: CostModel = field(default_factory=CostModel)
    bandwidth: Mapping[str, float] = field(default_factory=dict)
    prefetch_share: float = 0.25  # of the primary: promotion reserve x prefetch share


def _ttft(times: Sequence[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "mean": statistics.fmean(times),
        "p50": percentile(ordered, 0.5),
        "p90": percentile(ordered, 0.9),
    }


def _estimates(report: ReplayReport, o: TraceBenchOptions, real_block: int) -> dict[str, Any]:
    measured = {m: bw for m, bw in report.load_bandwidth.items() if m != PRIMARY}
    bandwidth = {PRIMARY: o.model.bandwidth.get(PRIMARY, 25e9), **measured, **o.bandwidth}
    budget = o.prefetch_share * report.options.primary_blocks * real_block
    model = replace(o.model, bandwidth=bandwidth, prefetch_budget_bytes=budget)
    steady = arrival_scale_for(report.costs, model, o.load)
    backlog = arrival_scale_for(report.costs, model, o.backlog_load)
    return {
        "bandwidth": bandwidth,
        "at_load": o.load,
        "ttft": _ttft(model.ttft(report.costs, arrival_scale=steady)),
        "backlog_load": o.backlog_load,
        "backlog_ttft": _ttft(model.ttft(report.costs, arrival_scale=backlog)),
        "backlog_ttft_prefetch": _ttft(
            model.ttft(report.costs, arrival_scale=backlog, prefetch=True)
        ),
    }


async def run_trace_bench(
    o: TraceBenchOptions, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Every replay of `o`, as a JSON-able report."""
    say = progress or (lambda _: None)
    requests = read_trace(o.path, o.limit)
    keyed = [(r, request_keys(r)) for r in requests]
    only_keys = [k for _, k in keyed]
    asked = sum(len(k) for k in only_keys)
    distinct = len({key for keys in only_keys for key in keys})
    real_block = 512 * o.model.kv_bytes_per_token
    out: dict[str, Any] = {
        "trace": str(o.path),
        "requests": len(requests),
        "blocks_asked": asked,
        "distinct_blocks": distinct,
        "infinite_cache_hit_rate": infinite_cache_hits(only_keys) / asked,
        "cost_model": {
            "model": o.model.model,
            "prefill_tokens_per_s": o.model.prefill_tokens_per_s,
            "kv_bytes_per_token": o.model.kv_bytes_per_token,
        },
        "runs": [],
    }
    for capacity in o.tier_capacities:
        primary, tier = primary_and_tier_blocks(distinct, o.primary, capacity)
        lru = lru_hits(only_keys, primary + tier) / asked
        lru_tier = lru_hits(only_keys, tier) / asked
        for admission in o.admissions:
            options = ReplayOptions(
                block_bytes=o.block_bytes,
                primary_blocks=primary,
                tiers=o.tiers,
                tier_blocks=tier,
                admission=admission,
                directory=o.directory,
                redis_url=o.redis_url,
            )
            label = f"tier {capacity} ({tier} blocks), admission {admission}"
            say(f"replaying: {label}")

            def tick(n: int, total: int, label: str = label) -> None:
                if n % 500 == 0 or n == total:
                    say(f"{label}: {n}/{total} requests")

            report = await replay(
                keyed, options, kv_bytes_per_token=o.model.kv_bytes_per_token, progress=tick
            )
            run = report.as_dict()
            run["tier_capacity"] = capacity
            run["lru_reference_hit_rate"] = lru
            run["lru_tier_only_hit_rate"] = lru_tier
            run["estimates"] = _estimates(report, o, real_block)
            out["runs"].append(run)
    return out


def summary_lines(report: Mapping[str, Any]) -> list[str]:
    """The human summary of `run_trace_bench`'s report."""
    lines = [
        f"trace {report['trace']}: {report['requests']:,} requests, "
        f"{report['blocks_asked']:,} blocks asked, {report['distinct_blocks']:,} distinct; "
        f"an infinite cache serves {report['infinite_cache_hit_rate']:.1%}",
        f"cost model: {report['cost_model']['model']}, "
        f"{report['cost_model']['prefill_tokens_per_s']:,.0f} prefill tokens/s, "
        f"{format_size(report['cost_model']['kv_bytes_per_token'])} KV per token",
        "",
        f"{'tier cap':>8} {'admission':>9} {'hit':>6} {'LRU P+T':>7} {'LRU T':>6} {'written':>10} "
        f"{'declined':>8} {'evicted':>8} {'TTFT mean':>9} {'backlog':>8} {'+prefetch':>9} "
        f"{'blocks/s':>8}",
    ]
    for run in report["runs"]:
        est = run["estimates"]
        written = sum(run["bytes_written"].values())
        declined = sum(run["declined_blocks"].values())
        evicted = sum(v for m, v in run["evictions"].items() if m != PRIMARY)
        lines.append(
            f"{run['tier_capacity']:>8} {run['admission']:>9} {run['hit_rate']:>6.1%} "
            f"{run['lru_reference_hit_rate']:>7.1%} {run['lru_tier_only_hit_rate']:>6.1%} "
            f"{approx_size(written, sep=' '):>10} "
            f"{declined:>8,} {evicted:>8,} {est['ttft']['mean']:>8.2f}s "
            f"{est['backlog_ttft']['mean']:>7.2f}s {est['backlog_ttft_prefetch']['mean']:>8.2f}s "
            f"{run['trace_blocks_per_second']:>8,.0f}"
        )
    lines.append("")
    lines.append(
        "hit: blocks served / asked (prefix); LRU P+T / T: one plain LRU of the primary's "
        "+ the tier's capacity / of the tier's alone (a write-through chain is inclusive: "
        "the primary's blocks are in the tier too); written: bytes into the tiers; TTFT "
        "at the given load, then under a backlog without and with prefetch (estimates "
        "from the cost model)"
    )
    return lines
