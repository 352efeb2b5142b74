"""`tierkv demo`: the chat workload on the demo model, with and without tierkv.

Every turn runs twice in a row on the same prompt: first without tierkv (the whole
prompt prefilled), then with it (the cached prefix loaded through the transfer
worker, the rest prefilled). Both runs are timed to the first token, and their
greedy tokens and logits are compared. The conversation continues with the reply of
the run without tierkv, so both see the same prompts whatever happens.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
import torch
from pydantic import ByteSize

from tierkv.config import CacheConfig
from tierkv.demo.engine import DemoEngine, Generation, build_engine
from tierkv.demo.model import ModelConfig
from tierkv.demo.report import percentile
from tierkv.demo.workload import ChatWorkload, WorkloadConfig
from tierkv.orchestrator import TieredCache
from tierkv.primary import MEDIUM as PRIMARY_MEDIUM
from tierkv.units import format_size

DEFAULT_ATOL = {"float32": 1e-3, "float16": 5e-2, "bfloat16": 2e-1}
"""Largest |logit difference| accepted between the runs with and without tierkv. The
prefix KV is the same bytes either way; only the order of floating-point sums in the
prefill differs (a suffix computed against a loaded prefix vs the whole prompt)."""


@dataclass(frozen=True)
class DemoOptions:
    model: ModelConfig = field(default_factory=ModelConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    device: str = "auto"
    gpu_block_tokens: int = 16
    block_factor: int = 2
    gpu_blocks: int | None = None  # default: the longest request, plus one block
    primary_capacity: int | None = None  # overrides the chain's primary capacity
    atol: float | None = None  # default: DEFAULT_ATOL[dtype]
    threaded: bool = True

    @property
    def tolerance(self) -> float:
        return self.atol if self.atol is not None else DEFAULT_ATOL[self.model.dtype]


@dataclass
class TurnRecord:
    user: int
    index: int
    prompt_tokens: int
    ttft_without: float
    ttft_with: float
    reused_tokens: int
    looked_up_blocks: int
    sources: dict[str, int]
    load_failures: int
    stored_blocks: int
    rejected_blocks: int
    tokens_match: bool
    max_logit_diff: float


def _ttft(values: list[float]) -> dict[str, float]:
    return {
        "mean_ms": statistics.fmean(values) * 1e3 if values else 0.0,
        "p50_ms": percentile(values, 0.5) * 1e3,
        "p90_ms": percentile(values, 0.9) * 1e3,
    }


def _compare(a: Generation, b: Generation) -> tuple[bool, float]:
    diff = max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits))
    return a.tokens == b.tokens, diff


def demo_config(config: CacheConfig, engine: DemoEngine, options: DemoOptions) -> CacheConfig:
    """`config`'s tiers and cache settings, with the engine's layout and namespace (the
    KV geometry and the model decide those) and the primary capacity override."""
    primary = config.primary
    if options.primary_capacity is not None:
        primary = primary.model_copy(update={"capacity": ByteSize(options.primary_capacity)})
    return config.model_copy(
        update={"layout": engine.layout, "namespace": engine.namespace, "primary": primary}
    )


async def run_demo(
    config: CacheConfig,
    options: DemoOptions,
    *,
    on_turn: Callable[[TurnRecord], None] | None = None,
    on_report: Callable[[dict[str, Any]], None] | None = None,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    linger: float = 0.0,
) -> dict[str, Any]:
    """Run the demo over the tier chain `config`; return the report.

    `on_report` gets the report while the cache (and the metrics endpoint, with
    `metrics_port`) is still up; the run then waits `linger` seconds before closing."""
    started = time.perf_counter()
    wl = options.workload
    need_tokens = wl.longest_prompt + wl.reply_tokens
    gpu_blocks = options.gpu_blocks or -(-need_tokens // options.gpu_block_tokens) + 1
    engine = build_engine(
        options.model,
        device=options.device,
        gpu_blocks=gpu_blocks,
        gpu_block_tokens=options.gpu_block_tokens,
        block_factor=options.block_factor,
        threaded=options.threaded,
    )
    config = demo_config(config, engine, options)
    workload = ChatWorkload(wl, options.model.vocab)
    records: list[TurnRecord] = []

    async with AsyncExitStack() as stack:
        cache = await stack.enter_async_context(TieredCache(config))
        engine.attach(cache)
        metrics_url = None
        if metrics_port is not None:
            from tierkv.metrics import serve_metrics

            server = await stack.enter_async_context(
                serve_metrics(cache, port=metrics_port, host=metrics_host)
            )
            metrics_url = server.url
        # warm-up: first calls into torch pay one-time costs
        warm = [t % options.model.vocab for t in range(engine.offload_tokens + 1)]
        await engine.generate(warm, 2, use_cache=False)

        for turn in workload.turns():
            base = await engine.generate(turn.prompt, wl.reply_tokens, use_cache=False)
            tier = await engine.generate(turn.prompt, wl.reply_tokens, use_cache=True)
            same, diff = _compare(base, tier)
            record = TurnRecord(
                user=turn.user,
                index=turn.index,
                prompt_tokens=len(turn.prompt),
                ttft_without=base.ttft,
                ttft_with=tier.ttft,
                reused_tokens=tier.reused_tokens,
                looked_up_blocks=tier.looked_up_blocks,
                sources=dict(tier.sources),
                load_failures=tier.load_failures,
                stored_blocks=tier.stored_blocks,
                rejected_blocks=tier.rejected_blocks,
                tokens_match=same,
                max_logit_diff=diff,
            )
            records.append(record)
            workload.reply(turn, base.tokens)
            if on_turn is not None:
                on_turn(record)
        await cache.flush()
        report = _report(config, cache, engine, options, records)
        report["elapsed_seconds"] = time.perf_counter() - started
        report["metrics_url"] = metrics_url
        if on_report is not None:
            on_report(report)
        if linger > 0:
            await anyio.sleep(linger)
    return report


def _report(
    config: CacheConfig,
    cache: TieredCache,
    engine: DemoEngine,
    options: DemoOptions,
    records: list[TurnRecord],
) -> dict[str, Any]:
    stats = cache.stats()
    media = [PRIMARY_MEDIUM, *cache.tier_names]
    looked_up = sum(r.looked_up_blocks for r in records)
    served = {m: sum(r.sources.get(m, 0) for r in records) for m in media}
    moved = {
        PRIMARY_MEDIUM: (stats.primary["bytes_in"], stats.primary["bytes_out"]),
        **{n: (t["bytes_in"], t["bytes_out"]) for n, t in stats.tiers.items()},
    }
    tiers = {
        m: {
            "hit_rate": served[m] / looked_up if looked_up else 0.0,
            "blocks_served": served[m],
            "bytes_in": moved[m][0],
            "bytes_out": moved[m][1],
        }
        for m in media
    }
    without = [r.ttft_without for r in records]
    with_ = [r.ttft_with for r in records]
    returning = [r for r in records if r.index > 0]
    tol = options.tolerance
    identical = sum(r.tokens_match for r in records)
    max_diff = max((r.max_logit_diff for r in records), default=0.0)
    correct = identical == len(records) and max_diff <= tol and not math.isnan(max_diff)
    prompt_tokens = sum(r.prompt_tokens for r in records)
    reused = sum(r.reused_tokens for r in records)

    def speedup(rs: list[TurnRecord]) -> float:
        t_with = sum(r.ttft_with for r in rs)
        return sum(r.ttft_without for r in rs) / t_with if t_with else 0.0

    model = engine.model
    return {
        "ok": correct,
        "model": {
            **asdict(options.model),
            "parameters": sum(p.numel() for p in model.parameters()),
            "device": str(model.device),
            "torch_threads": torch.get_num_threads(),
        },
        "kv_cache": {
            "gpu_blocks": engine.kv.num_blocks,
            "gpu_block_tokens": engine.kv.block_tokens,
            "offloaded_block_tokens": engine.offload_tokens,
            "block_bytes": int(config.layout.block_bytes),
        },
        "workload": asdict(options.workload),
        "chain": {
            "namespace": config.namespace,
            "primary_blocks": cache.primary.num_blocks,
            "primary_capacity": format_size(int(config.primary.capacity)),
            "eviction": config.primary.eviction,
            "tiers": [
                {"name": name, "type": t.type, "write_policy": t.write_policy}
                for name, t in zip(cache.tier_names, config.tiers)
            ],
        },
        "ttft": {
            "without": _ttft(without),
            "with": _ttft(with_),
            "speedup": speedup(records),
            "speedup_returning_turns": speedup(returning),
        },
        "prefill_tokens": {"without": prompt_tokens, "with": prompt_tokens - reused},
        "reusable_blocks": looked_up,
        "stored_blocks": sum(r.stored_blocks for r in records),
        "rejected_blocks": sum(r.rejected_blocks for r in records),
        "load_failures": sum(r.load_failures for r in records),
        "recomputed_block_rate": 1 - sum(served.values()) / looked_up if looked_up else 0.0,
        "tiers": tiers,
        "correctness": {
            "ok": correct,
            "turns": len(records),
            "tokens_identical_turns": identical,
            "max_logit_diff": max_diff,
            "atol": tol,
        },
        "turns": [asdict(r) for r in records],
    }
