"""One replay of a trace through a real `TieredCache` over real tiers of this machine.

Each request, in arrival order and strictly after the one before: `lookup` its block
keys, `load` the hit into a host buffer, `store` the blocks after the hit (as a server
does once prefill ends). Each trace block is one tierkv block of `block_bytes` (the
trace's 512-token blocks scaled down, so a replay fits a laptop); the cost model
scales bytes back to the model's real KV size. What a replay measures: blocks served
per medium, bytes written to and read from each tier, evictions, each tier's load
bandwidth at this block size, and its own bookkeeping rate.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.framing import FIXED_HEADER_BYTES
from tierkv.jobs import ReqContext
from tierkv.keys import OffloadKey
from tierkv.trace.costmodel import PRIMARY, RequestCost
from tierkv.trace.format import TRACE_BLOCK_TOKENS, TraceRequest

FS_BLOCK = 4096


@dataclass(frozen=True)
class ReplayOptions:
    """One chain to replay: a primary of `primary_blocks` over `tiers` (types:
    `nvme`, `memory`, `redis`), each of `tier_blocks` blocks (nvme and memory: Redis
    is bounded by its own maxmemory), written through with `admission`."""

    block_bytes: int = 64 << 10
    primary_blocks: int = 880
    tiers: tuple[str, ...] = ("nvme",)
    tier_blocks: int = 4400
    admission: str = "all"
    directory: Path | None = None
    redis_url: str | None = None
    namespace: str = "trace-replay"


@dataclass
class ReplayReport:
    options: ReplayOptions
    requests: int = 0
    blocks_asked: int = 0
    blocks_served: int = 0
    served_by: Counter[str] = field(default_factory=Counter)
    failed_loads: int = 0
    rejected_stores: int = 0
    bytes_written: dict[str, int] = field(default_factory=dict)
    bytes_read: dict[str, int] = field(default_factory=dict)
    declined: dict[str, int] = field(default_factory=dict)
    evictions: Counter[str] = field(default_factory=Counter)
    load_bandwidth: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    costs: list[RequestCost] = field(default_factory=list, repr=False)

    @property
    def hit_rate(self) -> float:
        return self.blocks_served / self.blocks_asked if self.blocks_asked else 0.0

    @property
    def blocks_per_second(self) -> float:
        return self.blocks_asked / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        o = self.options
        return {
            "tiers": list(o.tiers),
            "admission": o.admission,
            "block_bytes": o.block_bytes,
            "primary_blocks": o.primary_blocks,
            "tier_blocks": o.tier_blocks,
            "requests": self.requests,
            "blocks_asked": self.blocks_asked,
            "blocks_served": self.blocks_served,
            "hit_rate": self.hit_rate,
            "served_by": dict(self.served_by),
            "failed_loads": self.failed_loads,
            "rejected_stores": self.rejected_stores,
            "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read,
            "declined_blocks": self.declined,
            "evictions": dict(self.evictions),
            "load_bandwidth": self.load_bandwidth,
            "seconds": self.seconds,
            "trace_blocks_per_second": self.blocks_per_second,
        }


def _tier(kind: str, o: ReplayOptions, root: Path, key_bytes: int) -> dict[str, Any]:
    spec: dict[str, Any] = {"type": kind, "admission": o.admission}
    if kind == "nvme":
        frame = o.block_bytes + FIXED_HEADER_BYTES + key_bytes
        footprint = -(-frame // FS_BLOCK) * FS_BLOCK  # the tier counts allocated bytes
        spec.update(path=str(root / "nvme"), capacity=o.tier_blocks * footprint, fsync="never")
    elif kind == "memory":
        spec.update(capacity=o.tier_blocks * o.block_bytes)
    elif kind == "redis":
        if not o.redis_url:
            raise ValueError("a redis tier needs redis_url (--redis-url)")
        spec.update(url=o.redis_url, job_timeout=60)
    else:
        raise ValueError(f"replay tiers are nvme, memory or redis, not {kind!r}")
    return spec


async def replay(
    requests: Sequence[tuple[TraceRequest, Sequence[OffloadKey]]],
    options: ReplayOptions,
    *,
    kv_bytes_per_token: int = 131_072,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayReport:
    """Replay `requests` (each with its block keys) through a fresh cache."""
    o = options
    report = ReplayReport(o)
    if not requests:
        return report
    key_bytes = len(requests[0][1][0]) if requests[0][1] else 20
    real_block = TRACE_BLOCK_TOKENS * kv_bytes_per_token
    with tempfile.TemporaryDirectory(prefix="tierkv-trace-", dir=o.directory) as tmp:
        config = parse_config(
            {
                "namespace": o.namespace,
                "layout": {"block_bytes": o.block_bytes, "groups": [{"block_size": 1}]},
                "primary": {"capacity": o.primary_blocks * o.block_bytes, "pin_memory": False},
                "tiers": [_tier(t, o, Path(tmp), key_bytes) for t in o.tiers],
                "lookup_timeout": None,  # the replay measures hits, not a busy machine
            }
        )
        longest = max(len(k) for _, k in requests)
        source = torch.zeros(longest, o.block_bytes, dtype=torch.uint8)
        sink = torch.empty(longest, o.block_bytes, dtype=torch.uint8)
        load_bytes: Counter[str] = Counter()
        load_time: dict[str, float] = {}
        first = requests[0][0].timestamp_ms
        started = time.perf_counter()
        async with TieredCache(config) as cache:
            for n, (request, keys) in enumerate(requests):
                ctx = ReqContext(request_id=f"r{n}")
                hit = await cache.lookup([keys], ctx)
                load = list(hit.keys_to_load)
                served = 0
                by: Counter[str] = Counter()
                if load:
                    t0 = time.perf_counter()
                    result = await cache.load(load, sink[: len(load)], ctx)
                    spent = time.perf_counter() - t0
                    ok = set(result.ok_keys)
                    for key in load:  # the prefix stops at the first failed block
                        if key not in ok:
                            break
                        served += 1
                        by[result.sources.get(key, PRIMARY)] += 1
                    report.failed_loads += len(result.failed_keys)
                    for medium, count in by.items():  # a bandwidth sample per medium:
                        # a load served by several is split by their shares of its bytes
                        load_bytes[medium] += count * o.block_bytes
                        share = spent * count / served
                        load_time[medium] = load_time.get(medium, 0.0) + share
                if served < len(keys):
                    stored = await cache.store(keys[served:], source[: len(keys) - served])
                    report.rejected_stores += len(stored.rejected)
                for event in cache.take_events():
                    if event.removed:
                        report.evictions[event.medium] += len(event.keys)
                report.requests += 1
                report.blocks_asked += len(keys)
                report.blocks_served += served
                report.served_by.update(by)
                tokens_hit = served * TRACE_BLOCK_TOKENS
                report.costs.append(
                    RequestCost(
                        (request.timestamp_ms - first) / 1000.0,
                        max(0, request.input_length - tokens_hit),
                        {m: c * real_block for m, c in by.items()},
                    )
                )
                if progress is not None:
                    progress(n + 1, len(requests))
            await cache.flush()
            report.seconds = time.perf_counter() - started
            for name, tier in cache.stats().tiers.items():
                report.bytes_written[name] = int(tier["bytes_in"])
                report.bytes_read[name] = int(tier["bytes_out"])
                report.declined[name] = int(tier["declined"])
        for medium, nbytes in load_bytes.items():
            if load_time.get(medium, 0.0) > 0:
                # measured at this block size: small blocks make it pessimistic for
                # a model's real ones (pass measured figures to the cost model instead)
                report.load_bandwidth[medium] = nbytes / load_time[medium]
    return report


def primary_and_tier_blocks(distinct: int, primary: str, tier: str) -> tuple[int, int]:
    """Parse `2%` (of the trace's distinct blocks) or a block count, for both."""
    return _blocks(primary, distinct), _blocks(tier, distinct)


def _blocks(text: str, distinct: int) -> int:
    text = text.strip()
    try:
        if text.endswith("%"):
            return max(1, math.ceil(float(text[:-1]) / 100 * distinct))
        value = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a block count or a percentage (e.g. 2%)") from None
    if value < 1:
        raise ValueError(f"{text!r}: at least 1 block")
    return value
