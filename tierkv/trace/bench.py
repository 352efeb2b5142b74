"""`tierkv bench trace FILE`: replay a trace once per tier capacity and admission
policy, and report each beside the trace's own references and a TTFT estimate; then,
under a backlog, once more per prefetch policy behind the modelled server
(`tierkv.trace.server`), to set the TTFT with prefetch beside the TTFT without."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tierkv.cache.prefetch import PrefetchPolicy
from tierkv.contract.keys import OffloadKey
from tierkv.contract.units import approx_size, format_size
from tierkv.trace.costmodel import PRIMARY, CostModel, arrival_scale_for, ttft_summary
from tierkv.trace.format import TraceError, TraceRequest, read_trace, request_keys
from tierkv.trace.reference import infinite_cache_hits, lru_hits
from tierkv.trace.replay import ReplayOptions, ReplayReport, primary_and_tier_blocks, replay
from tierkv.trace.server import ServerOptions, replay_queued


@dataclass(frozen=True)
class TraceBenchOptions:
    path: Path
    limit: int | None = None
    block_bytes: int = 64 << 10
    primary: str = "2%"
    tier_capacities: tuple[str, ...] = ("10%", "25%")
    tiers: tuple[str, ...] = ("nvme",)
    admissions: tuple[str, ...] = ("all", "reuse", "tinylfu")
    redis_url: str | None = None
    directory: Path | None = None
    load: float = 0.7
    backlog_load: float = 1.3
    model: CostModel = field(default_factory=CostModel)
    bandwidth: Mapping[str, float] = field(default_factory=dict)
    prefetch: tuple[PrefetchPolicy, ...] = ("best_effort",)  # () : no queued replay
    prefetch_depth: int = 8
    prefetch_timeout: float = 60.0
    abandon: float = 0.0
    quotas: Mapping[str, Any] | None = field(default=None, hash=False)  # tenants.quotas


def _model(report: ReplayReport, o: TraceBenchOptions) -> CostModel:
    """The cost model with the replay's measured tier bandwidths (or `o.bandwidth`)."""
    measured = {m: bw for m, bw in report.load_bandwidth.items() if m != PRIMARY}
    primary = {PRIMARY: o.model.bandwidth.get(PRIMARY, 25e9)}
    return replace(o.model, bandwidth={**primary, **measured, **o.bandwidth})


async def _queued_runs(
    keyed: Sequence[tuple[TraceRequest, Sequence[OffloadKey]]],
    options: ReplayOptions,
    report: ReplayReport,
    model: CostModel,
    scale: float,
    o: TraceBenchOptions,
    say: Callable[[str], None],
    label: str,
) -> dict[str, Any]:
    """The backlog with and without prefetch, each policy one queued replay through
    the real cache; the baseline is the plain replay's costs on the same server (the
    same events reach the cache), or a queued replay of its own when clients abandon."""
    out: dict[str, Any] = {}
    for policy in (None, *o.prefetch):
        name = policy or "off"
        if policy is None and not o.abandon:
            out[name] = {"ttft": ttft_summary(model.ttft(report.costs, arrival_scale=scale))}
            continue
        server = ServerOptions(
            arrival_scale=scale,
            prefetch=policy,
            depth=o.prefetch_depth,
            timeout=o.prefetch_timeout,
            abandon=o.abandon,
        )
        say(f"{label}: queued replay, prefetch {name}")
        tick = _ticker(say, f"{label}, prefetch {name}")
        queued = await replay_queued(keyed, options, server, model, progress=tick)
        out[name] = queued.as_dict()
    return out


def _ticker(say: Callable[[str], None], label: str) -> Callable[[int, int], None]:
    """A replay's progress callback: says how far `label` got every 500 requests and
    at the end."""

    def tick(n: int, total: int) -> None:
        if n % 500 == 0 or n == total:
            say(f"{label}: {n}/{total} requests")

    return tick


async def run_trace_bench(
    o: TraceBenchOptions, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Every replay of `o`, as a JSON-able report."""
    say = progress or (lambda _: None)
    requests = read_trace(o.path, o.limit)
    keyed = [(r, request_keys(r)) for r in requests]
    only_keys = [k for _, k in keyed]
    if not any(only_keys):  # every hit rate would divide by zero blocks
        raise TraceError(f"{o.path}: no request asks for a block (every hash_ids is empty)")
    out = _trace_facts(o, len(requests), only_keys)
    asked, distinct = out["blocks_asked"], out["distinct_blocks"]
    for capacity in o.tier_capacities:
        primary, tier = primary_and_tier_blocks(distinct, o.primary, capacity)
        facts = {
            "tier_capacity": capacity,
            "lru_reference_hit_rate": lru_hits(only_keys, primary + tier) / asked,
            "lru_tier_only_hit_rate": lru_hits(only_keys, tier) / asked,
        }
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
            out["runs"].append(await _replay_run(keyed, options, facts, o, say, label))
    return out


def _trace_facts(
    o: TraceBenchOptions, requests: int, keys: list[list[OffloadKey]]
) -> dict[str, Any]:
    """The report's head: what the trace asks for, what an infinite cache would
    serve of it, and the cost model; its `runs` still empty."""
    asked = sum(len(k) for k in keys)
    return {
        "trace": str(o.path),
        "requests": requests,
        "blocks_asked": asked,
        "distinct_blocks": len({key for request in keys for key in request}),
        "infinite_cache_hit_rate": infinite_cache_hits(keys) / asked,
        "cost_model": {
            "model": o.model.model,
            "prefill_tokens_per_s": o.model.prefill_tokens_per_s,
            "kv_bytes_per_token": o.model.kv_bytes_per_token,
        },
        "runs": [],
    }


async def _replay_run(
    keyed: Sequence[tuple[TraceRequest, Sequence[OffloadKey]]],
    options: ReplayOptions,
    facts: dict[str, Any],
    o: TraceBenchOptions,
    say: Callable[[str], None],
    label: str,
) -> dict[str, Any]:
    """One replay at one capacity and admission: its report with `facts` (the
    capacity and the LRU references), the TTFT estimate at the steady load, and the
    backlog's queued replays."""
    say(f"replaying: {label}")
    report = await replay(
        keyed, options, kv_bytes_per_token=o.model.kv_bytes_per_token, progress=_ticker(say, label)
    )
    run = report.as_dict()
    run.update(facts)
    model = _model(report, o)
    backlog = arrival_scale_for(report.costs, model, o.backlog_load)
    steady = arrival_scale_for(report.costs, model, o.load)
    run["estimates"] = {
        "bandwidth": dict(model.bandwidth),
        "at_load": o.load,
        "ttft": ttft_summary(model.ttft(report.costs, arrival_scale=steady)),
        "backlog_load": o.backlog_load,
        "backlog_arrival_scale": backlog,
    }
    run["backlog"] = await _queued_runs(keyed, options, report, model, backlog, o, say, label)
    return run


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
        f"{'declined':>8} {'evicted':>8} {'TTFT mean':>9} {'blocks/s':>8} {'per CPU s':>9}",
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
            f"{run['trace_blocks_per_second']:>8,.0f} {run['trace_blocks_per_cpu_second']:>9,.0f}"
        )
    lines.append("")
    lines.append(
        "hit: blocks served / asked (prefix); LRU P+T / T: one plain LRU of the primary's "
        "+ the tier's capacity / of the tier's alone (a write-through chain is inclusive: "
        "the primary's blocks are in the tier too); written: bytes into the tiers; TTFT "
        "at the given load (an estimate from the cost model); blocks/s: the replay's own "
        "rate, trace blocks per second of wall time and of this process's CPU time"
    )
    backlog = [r for r in report["runs"] if len(r.get("backlog", {})) > 1]
    if backlog:
        lines += ["", *_backlog_lines(backlog)]
    return lines


def _backlog_lines(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    first = runs[0]
    lines = [
        f"under a backlog (arrivals scaled x{first['estimates']['backlog_arrival_scale']:.3f}, "
        f"load {first['estimates']['backlog_load']}), TTFT mean / p50 / p99 in seconds:",
        f"{'tier cap':>8} {'admission':>9} {'prefetch':>11} {'mean':>8} {'p50':>8} {'p99':>8} "
        f"{'vs off':>7} {'prefetched':>10} {'used':>7} {'in time':>7} {'shed':>7} "
        f"{'cancelled':>9} {'dropped':>7} {'blocks/s':>8} {'per CPU s':>9}",
    ]
    for run in runs:
        off = run["backlog"]["off"]["ttft"]["mean"]
        for policy, q in run["backlog"].items():
            t = q["ttft"]
            c = q.get("prefetch_counters", {})
            vs = f"{t['mean'] / off - 1:+.0%}" if off and policy != "off" else ""
            lines.append(
                f"{run['tier_capacity']:>8} {run['admission']:>9} {policy:>11} "
                f"{t['mean']:>8.2f} {t['p50']:>8.2f} {t['p99']:>8.2f} {vs:>7} "
                f"{c.get('prefetched_blocks', 0):>10,} {c.get('prefetch_used', 0):>7,} "
                f"{q.get('prefetched_in_time', 0):>7,} {c.get('prefetch_shed', 0):>7,} "
                f"{c.get('prefetch_cancelled', 0):>9,} {q.get('dropped', 0):>7,} "
                f"{q.get('trace_blocks_per_second', run['trace_blocks_per_second']):>8,.0f} "
                f"{q.get('trace_blocks_per_cpu_second', run['trace_blocks_per_cpu_second']):>9,.0f}"
            )
    lines.append(
        "off: no prefetch (the plain replay's costs on the same server); a policy: a "
        "queued replay calling cache.prefetch for the next queued requests. prefetched / "
        "used / shed / cancelled: the cache's counters (blocks); in time: used blocks "
        "read before their request's turn (served as primary hits); blocks/s: the "
        "replay's own rate"
    )
    return lines
