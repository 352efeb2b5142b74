"""The JSON report of a `tierkv demo` run, built from its turn records: the setup,
time to first token and prefill per column, where the tierkv column's reusable blocks
came from, correctness, and every turn (`tierkv.demo.report` renders it)."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch

from tierkv.cache import TieredCache
from tierkv.config import CacheConfig
from tierkv.contract.units import format_size
from tierkv.demo.groups import group_report
from tierkv.primary import MEDIUM as PRIMARY_MEDIUM
from tierkv.stats import percentile

COLUMNS = ("no_cache", "gpu_prefix_cache", "tierkv")
"""The three runs of every turn, in the report and the plot."""

GPU_MEDIUM = "gpu"
"""How the report names blocks the engine's own GPU prefix cache served."""

if TYPE_CHECKING:
    from tierkv.demo.engine import DemoEngine
    from tierkv.demo.hybrid_engine import HybridEngine
    from tierkv.demo.records import DemoOptions, TurnRecord

    Engine = DemoEngine | HybridEngine


def _ttft(values: list[float]) -> dict[str, float]:
    return {
        "mean_ms": statistics.fmean(values) * 1e3 if values else 0.0,
        "p50_ms": percentile(values, 0.5) * 1e3,
        "p90_ms": percentile(values, 0.9) * 1e3,
    }


def _speedup(records: list[TurnRecord], slow: str, fast: str) -> float:
    t_fast = sum(r.ttft[fast] for r in records)
    return sum(r.ttft[slow] for r in records) / t_fast if t_fast else 0.0


def build_report(
    config: CacheConfig,
    cache: TieredCache,
    engines: dict[str, Engine],
    options: DemoOptions,
    records: list[TurnRecord],
) -> dict[str, Any]:
    """The run's JSON report: the setup, TTFT and prefill per column, where the
    tierkv column's reusable blocks came from, correctness, and every turn."""
    tiered = engines["tierkv"]
    looked_up = sum(r.looked_up_blocks for r in records)
    gpu_served = sum(r.gpu_hit_blocks["tierkv"] for r in records)
    tiers = _tier_shares(cache, records, looked_up)
    tier_served = sum(t["blocks_served"] for t in tiers.values())
    correctness = _correctness(records, options.tolerance)
    return {
        "ok": correctness["ok"],
        "columns": list(COLUMNS),
        "model": _model_facts(tiered, options),
        "kv_cache": {
            "gpu_blocks": tiered.chunks.num_chunks * tiered.block_factor,
            "gpu_block_tokens": tiered.kv.block_tokens,
            "offloaded_block_tokens": tiered.offload_tokens,
            "block_bytes": int(config.layout.block_bytes),
            "engines": len(engines),
        },
        "workload": asdict(options.workload),
        "chain": _chain_facts(config, cache),
        "ttft": _ttft_by_column(records),
        "prefill_tokens": _prefill_tokens(records, tiered.offload_tokens),
        "gpu_prefix_cache": {
            c: {
                "hit_blocks": engines[c].chunks.hit_chunks,
                "evicted_blocks": engines[c].chunks.evicted_chunks,
                "capacity_blocks": engines[c].chunks.num_chunks,
            }
            for c in COLUMNS[1:]
        },
        "reusable_blocks": looked_up,
        "stored_blocks": sum(r.stored_blocks for r in records),
        "rejected_blocks": sum(r.rejected_blocks for r in records),
        "skipped_blocks": sum(r.skipped_blocks for r in records),
        "load_failures": sum(r.load_failures for r in records),
        "gpu_hit_rate": gpu_served / looked_up if looked_up else 0.0,
        "recomputed_block_rate": (1 - (gpu_served + tier_served) / looked_up if looked_up else 0.0),
        "tiers": tiers,
        "groups": group_report(tiered, records),
        "correctness": correctness,
        "turns": [asdict(r) for r in records],
    }


def _model_facts(tiered: Engine, options: DemoOptions) -> dict[str, Any]:
    """The model's config, its size, and where and how it ran."""
    model = tiered.model
    return {
        **asdict(options.model),
        "parameters": sum(p.numel() for p in model.parameters()),
        "device": str(model.device),
        "torch_threads": torch.get_num_threads(),
        "hybrid": asdict(options.hybrid) if options.hybrid is not None else None,
    }


def _chain_facts(config: CacheConfig, cache: TieredCache) -> dict[str, Any]:
    """The chain the tierkv column ran on: its primary and its tiers in order."""
    return {
        "namespace": config.namespace,
        "primary_blocks": cache.primary.num_blocks,
        "primary_capacity": format_size(int(config.primary.capacity)),
        "eviction": config.primary.eviction,
        "tiers": [
            {"name": name, "type": t.type, "write_policy": t.write_policy}
            for name, t in zip(cache.tier_names, config.tiers)
        ],
    }


def _tier_shares(
    cache: TieredCache, records: list[TurnRecord], looked_up: int
) -> dict[str, dict[str, Any]]:
    """Per medium (the primary, then each tier): its share of the `looked_up`
    reusable blocks, the blocks it served, and the bytes that went in and out."""
    stats = cache.stats()
    moved = {
        PRIMARY_MEDIUM: (stats.primary["bytes_in"], stats.primary["bytes_out"]),
        **{n: (t["bytes_in"], t["bytes_out"]) for n, t in stats.tiers.items()},
    }
    shares = {}
    for m in [PRIMARY_MEDIUM, *cache.tier_names]:
        served = sum(r.sources.get(m, 0) for r in records)
        shares[m] = {
            "hit_rate": served / looked_up if looked_up else 0.0,
            "blocks_served": served,
            "bytes_in": moved[m][0],
            "bytes_out": moved[m][1],
        }
    return shares


def _ttft_by_column(records: list[TurnRecord]) -> dict[str, Any]:
    """TTFT per column, and the speed-ups between columns (over every turn, and over
    the returning turns, where a user's own conversation can be reused)."""
    returning = [r for r in records if r.index > 0]
    return {
        **{c: _ttft([r.ttft[c] for r in records]) for c in COLUMNS},
        "speedup": _speedup(records, "gpu_prefix_cache", "tierkv"),
        "speedup_vs_no_cache": _speedup(records, "no_cache", "tierkv"),
        "speedup_returning_turns": _speedup(returning, "gpu_prefix_cache", "tierkv"),
        "gpu_prefix_cache_vs_no_cache": _speedup(records, "no_cache", "gpu_prefix_cache"),
    }


def _prefill_tokens(records: list[TurnRecord], offload_tokens: int) -> dict[str, int]:
    """Prompt tokens each column prefilled: all of them without a cache, less the GPU
    prefix cache's hits, less those and what tierkv's tiers served."""
    prompt_tokens = sum(r.prompt_tokens for r in records)
    gpu_only = sum(r.gpu_hit_blocks["gpu_prefix_cache"] for r in records) * offload_tokens
    gpu_served = sum(r.gpu_hit_blocks["tierkv"] for r in records)
    tier_reused = sum(r.reused_tokens for r in records)
    return {
        "no_cache": prompt_tokens,
        "gpu_prefix_cache": prompt_tokens - gpu_only,
        "tierkv": prompt_tokens - gpu_served * offload_tokens - tier_reused,
    }


def _correctness(records: list[TurnRecord], tol: float) -> dict[str, Any]:
    """Whether every turn's tokens were identical in every column and the logits
    within `tol`; and per cached column, where it went wrong."""
    identical = sum(r.tokens_match for r in records)
    max_diff = max((r.max_logit_diff for r in records), default=0.0)
    return {
        "ok": identical == len(records) and max_diff <= tol and not math.isnan(max_diff),
        "turns": len(records),
        "tokens_identical_turns": identical,
        "max_logit_diff": max_diff,
        "by_column": _by_column(records),
        "atol": tol,
    }


def _by_column(records: list[TurnRecord]) -> dict[str, dict[str, Any]]:
    """Per cached column against no cache: identical turns, the largest logit
    difference, and the first turn that differed (None if none did)."""
    out: dict[str, dict[str, Any]] = {}
    for column in ("gpu_prefix_cache", "tierkv"):
        differing = [r for r in records if not r.column_match.get(column, True)]
        out[column] = {
            "tokens_identical_turns": len(records) - len(differing),
            "max_logit_diff": max((r.column_diff.get(column, 0.0) for r in records), default=0.0),
            "first_differing_turn": (
                f"user {differing[0].user} turn {differing[0].index + 1}" if differing else None
            ),
        }
    return out
