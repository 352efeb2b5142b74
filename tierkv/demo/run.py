"""`tierkv demo`: the chat workload on the demo model, three ways.

Every turn runs three times on the same prompt, each on its own engine (one shared
model, three KV caches of the same size):

- `no_cache`: the whole prompt is prefilled, as an engine with no prefix cache does;
- `gpu_prefix_cache`: the engine's own GPU prefix cache (bounded by its KV blocks, as a
  real engine's) serves whatever prefix it still holds;
- `tierkv`: the same GPU prefix cache, and for the blocks after its hit the tier chain:
  looked up, loaded through the transfer worker, then the rest prefilled.

Each run is timed to its first token; greedy tokens and logits of the last two are
compared with the first. The order of the three rotates from turn to turn, so none
always runs on a warm CPU cache. The conversation continues with the reply of the run
without a cache, so all three see the same prompts whatever happens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio
from pydantic import ByteSize

from tierkv.cache import TieredCache
from tierkv.config import CacheConfig
from tierkv.demo.engine import DemoEngine, Generation, build_engine, resolve_device
from tierkv.demo.hybrid_engine import HybridEngine
from tierkv.demo.hybrid_model import HybridDecoder
from tierkv.demo.model import TinyDecoder
from tierkv.demo.records import DemoOptions, TurnRecord
from tierkv.demo.run_report import COLUMNS, build_report
from tierkv.demo.workload import ChatWorkload, Turn


def compare(a: Generation, b: Generation) -> tuple[bool, float]:
    """The correctness check's two numbers: whether the greedy tokens are identical,
    and the largest |logit difference| (NaN when either run produced NaN)."""
    diff = max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits))
    return a.tokens == b.tokens, diff


def agrees(a: Generation, b: Generation, atol: float) -> bool:
    """The correctness check of one turn: identical tokens, logits within `atol`."""
    same, diff = compare(a, b)
    return same and diff <= atol and not math.isnan(diff)


def demo_config(config: CacheConfig, engine: Engine, options: DemoOptions) -> CacheConfig:
    """`config`'s tiers and cache settings, with the engine's layout and namespace (the
    KV geometry and the model decide those) and the primary capacity override."""
    primary = config.primary
    if options.primary_capacity is not None:
        primary = primary.model_copy(update={"capacity": ByteSize(options.primary_capacity)})
    return config.model_copy(
        update={"layout": engine.layout, "namespace": engine.namespace, "primary": primary}
    )


Engine = DemoEngine | HybridEngine


def build_engines(options: DemoOptions) -> dict[str, Engine]:
    """One model, three engines with KV caches of the same size."""
    device = resolve_device(options.device)
    if options.hybrid is not None:
        hybrid = HybridDecoder(options.model, options.hybrid, device)
        return {
            column: HybridEngine(
                hybrid,
                gpu_blocks=options.kv_blocks(),
                gpu_block_tokens=options.gpu_block_tokens,
                block_factor=options.block_factor,
                threaded=options.threaded,
                prefix_caching=column != "no_cache",
            )
            for column in COLUMNS
        }
    model = TinyDecoder(options.model, device)
    return {
        column: build_engine(
            options.model,
            gpu_blocks=options.kv_blocks(),
            gpu_block_tokens=options.gpu_block_tokens,
            block_factor=options.block_factor,
            threaded=options.threaded,
            prefix_caching=column != "no_cache",
            model=model,
        )
        for column in COLUMNS
    }


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
    engines = build_engines(options)
    tiered = engines["tierkv"]
    config = demo_config(config, tiered, options)
    workload = ChatWorkload(options.workload, options.model.vocab)
    records: list[TurnRecord] = []

    async with AsyncExitStack() as stack:
        cache = await stack.enter_async_context(TieredCache(config))
        held = blocks_held(cache)
        tiered.attach(cache)
        tiered.stored_keys = set()  # to tell this run's blocks from an earlier run's
        metrics_url = None
        if metrics_port is not None:
            metrics_url = await _serve_metrics(stack, cache, metrics_port, metrics_host)
        # warm-up: first calls into torch pay one-time costs
        warm = [t % options.model.vocab for t in range(tiered.offload_tokens + 1)]
        await engines["no_cache"].generate(warm, 2, use_cache=False)

        for number, turn in enumerate(workload.turns()):
            runs = await _run_columns(engines, turn, options.workload.reply_tokens, number)
            record = _turn_record(turn, runs, tiered.offload_tokens)
            records.append(record)
            workload.reply(turn, runs["no_cache"].tokens)
            if on_turn is not None:
                on_turn(record)
        await cache.flush()
        report = build_report(config, cache, engines, options, records)
        report["earlier_run"] = {
            "blocks_at_start": held,
            "served_blocks": sum(r.earlier_blocks for r in records),
        }
        report["elapsed_seconds"] = time.perf_counter() - started
        report["metrics_url"] = metrics_url
        if on_report is not None:
            on_report(report)
        if linger > 0:
            await anyio.sleep(linger)
    return report


async def _serve_metrics(stack: AsyncExitStack, cache: TieredCache, port: int, host: str) -> str:
    """Serve `cache`'s Prometheus metrics until `stack` closes; return the URL."""
    from tierkv.metrics import serve_metrics

    server = await stack.enter_async_context(serve_metrics(cache, port=port, host=host))
    return server.url


async def _run_columns(
    engines: dict[str, Engine], turn: Turn, reply_tokens: int, number: int
) -> dict[str, Generation]:
    """Turn `number` on each column's engine, the order rotated by one column per
    turn so that no column always runs on a warm CPU cache."""
    runs: dict[str, Generation] = {}
    shift = number % len(COLUMNS)
    for column in COLUMNS[shift:] + COLUMNS[:shift]:
        runs[column] = await engines[column].generate(
            turn.prompt, reply_tokens, use_cache=column == "tierkv"
        )
    return runs


def _turn_record(turn: Turn, runs: dict[str, Generation], offload_tokens: int) -> TurnRecord:
    """What one turn did: every column's TTFT and GPU hit, the tierkv column's
    traffic, and both cached columns compared with the run without a cache."""
    base, tier = runs["no_cache"], runs["tierkv"]
    same_gpu, diff_gpu = compare(base, runs["gpu_prefix_cache"])
    same_tier, diff_tier = compare(base, tier)
    return TurnRecord(
        user=turn.user,
        index=turn.index,
        prompt_tokens=len(turn.prompt),
        ttft={c: runs[c].ttft for c in COLUMNS},
        gpu_hit_blocks={c: runs[c].gpu_hit_tokens // offload_tokens for c in COLUMNS},
        reused_tokens=tier.reused_tokens,
        looked_up_blocks=tier.looked_up_blocks,
        sources=dict(tier.sources),
        load_failures=tier.load_failures,
        stored_blocks=tier.stored_blocks,
        rejected_blocks=tier.rejected_blocks,
        skipped_blocks=tier.skipped_blocks,
        tokens_match=same_gpu and same_tier,
        max_logit_diff=max(diff_gpu, diff_tier),
        column_match={"gpu_prefix_cache": same_gpu, "tierkv": same_tier},
        column_diff={"gpu_prefix_cache": diff_gpu, "tierkv": diff_tier},
        earlier_blocks=tier.earlier_blocks,
        group_loaded=list(tier.group_loaded),
        group_stored=list(tier.group_stored),
    )


def blocks_held(cache: TieredCache) -> dict[str, int]:
    """Blocks each tier of the open `cache` holds in its namespace, for the tiers that
    say (`describe()["blocks"]` or `len(tier)`): at the start of a run, what an earlier
    run left in a kept directory."""
    held = {}
    for name in cache.tier_names:
        tier = cache.tier(name)
        count = tier.describe().get("blocks")
        if count is None and hasattr(tier, "__len__"):
            count = len(tier)
        if isinstance(count, int):
            held[name] = count
    return held
