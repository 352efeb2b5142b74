"""One replay of a trace through a real `TieredCache` over real tiers of this machine.

Each request, in arrival order and strictly after the one before: `lookup` its block
keys, `load` the hit into a host buffer, `store` the blocks after the hit (as a server
does once prefill ends), each with the request's tenant (`ReqContext.tenant`), so the
cache counts per tenant (`ReplayReport.tenants`) and holds tenants to the quotas given
(`ReplayOptions.quotas`). Each trace block is one tierkv block of `block_bytes` (the
trace's 512-token blocks scaled down, so a replay fits a laptop); the cost model
scales bytes back to the model's real KV size. What a replay measures: blocks served
per medium, bytes written to and read from each tier, evictions, each tier's load
bandwidth at this block size, and its own bookkeeping rate. `tierkv.trace.server`
replays the same steps behind a modelled server that prefetches for its queue.
"""

from __future__ import annotations

import math
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.framing import FIXED_HEADER_BYTES
from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.trace.costmodel import PRIMARY, PrefetchedBytes, RequestCost
from tierkv.trace.format import TRACE_BLOCK_TOKENS, TraceRequest

FS_BLOCK = 4096
PREFETCH_COUNTERS = ("prefetched_blocks", "prefetch_used", "prefetch_shed", "prefetch_cancelled")
"""The cache's prefetch counters a replay reports (`TieredCache.stats().primary`)."""
REPORT_TOP = 1000
"""`tenants.report_top` of a replay's cache: the most tenants named in its stats."""


@dataclass(frozen=True)
class ReplayOptions:
    """One chain to replay: a primary of `primary_blocks` over `tiers` (types:
    `nvme`, `memory`, `redis`), each of `tier_blocks` blocks (nvme and memory: Redis
    is bounded by its own maxmemory), written through with `admission`; `quotas` is
    the cache config's `tenants.quotas` (`primary` or a tier's type -> its quotas;
    None: no quota)."""

    block_bytes: int = 64 << 10
    primary_blocks: int = 880
    tiers: tuple[str, ...] = ("nvme",)
    tier_blocks: int = 4400
    admission: str = "all"
    directory: Path | None = None
    redis_url: str | None = None
    namespace: str = "trace-replay"
    quotas: Mapping[str, Any] | None = field(default=None, hash=False)


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
    blocks_written: dict[str, int] = field(default_factory=dict)
    bytes_read: dict[str, int] = field(default_factory=dict)
    declined: dict[str, int] = field(default_factory=dict)
    evictions: Counter[str] = field(default_factory=Counter)
    load_bandwidth: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time (all threads): the rate on a busy machine
    costs: list[RequestCost] = field(default_factory=list, repr=False)
    prefetch: dict[str, int] = field(default_factory=dict)
    tenants: dict[str, dict[str, int]] = field(default_factory=dict)  # stats().tenants

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
            "blocks_written": self.blocks_written,
            "bytes_read": self.bytes_read,
            "declined_blocks": self.declined,
            "evictions": dict(self.evictions),
            "load_bandwidth": self.load_bandwidth,
            "seconds": self.seconds,
            "trace_blocks_per_second": self.blocks_per_second,
            "cpu_seconds": self.cpu_seconds,
            "trace_blocks_per_cpu_second": (
                self.blocks_asked / self.cpu_seconds if self.cpu_seconds else 0.0
            ),
            "prefetch_counters": self.prefetch,
            "tenants": self.tenants,
        }


def _tier(kind: str, o: ReplayOptions, root: Path, key_bytes: int) -> dict[str, Any]:
    spec: dict[str, Any] = {"type": kind, "admission": o.admission}
    frame = o.block_bytes + FIXED_HEADER_BYTES + key_bytes
    if kind == "nvme":
        footprint = -(-frame // FS_BLOCK) * FS_BLOCK  # the tier counts allocated bytes
        spec.update(path=str(root / "nvme"), capacity=o.tier_blocks * footprint, fsync="never")
    elif kind == "memory":  # the tier counts framed bytes: room for exactly tier_blocks
        spec.update(capacity=o.tier_blocks * frame)
    elif kind == "redis":
        if not o.redis_url:
            raise ValueError("a redis tier needs redis_url (--redis-url)")
        spec.update(url=o.redis_url, job_timeout=60)
    else:
        raise ValueError(f"replay tiers are nvme, memory or redis, not {kind!r}")
    return spec


def chain_config(o: ReplayOptions, root: Path, key_bytes: int = 20) -> dict[str, Any]:
    """The cache config of one replay (its tier files under `root`), as a mapping for
    `parse_config`."""
    config: dict[str, Any] = {
        # a fresh namespace per run: a redis tier must not serve blocks an earlier run
        # (of this bench or another) left there
        "namespace": f"{o.namespace}-{uuid.uuid4().hex[:12]}",
        "layout": {"block_bytes": o.block_bytes, "groups": [{"block_size": 1}]},
        "primary": {"capacity": o.primary_blocks * o.block_bytes, "pin_memory": False},
        "tiers": [_tier(t, o, root, key_bytes) for t in o.tiers],
        "lookup_timeout": None,  # the replay measures hits, not a busy machine
        # every tenant by name in stats().tenants (the most a config allows), so a
        # report can find any tenant's row
        "tenants": {"report_top": REPORT_TOP},
    }
    if o.quotas:
        config["tenants"]["quotas"] = dict(o.quotas)
    return config


@dataclass(frozen=True)
class Served:
    """What one request's load served: the prefix of its keys, each with its medium."""

    keys: list[OffloadKey]
    sources: list[str]


class ReplayChain:
    """An open cache over the replay's tiers and the steps of one request, shared by
    the plain replay (`replay`) and the queued one (`tierkv.trace.server`).

    Every store is followed by `flush`: each request's cascades end before the next
    event, so which blocks are evictable (and so hits, prefetch room and sheds) does
    not depend on how fast this machine's disk happens to be; a replay is
    deterministic for a given trace and chain."""

    def __init__(
        self,
        cache: TieredCache,
        report: ReplayReport,
        longest: int,
        real_block: int,
    ) -> None:
        self.cache = cache
        self.report = report
        self.real_block = real_block
        block_bytes = report.options.block_bytes
        self._source = torch.zeros(longest, block_bytes, dtype=torch.uint8)
        self._sink = torch.empty(longest, block_bytes, dtype=torch.uint8)
        self._load_bytes: Counter[str] = Counter()
        self._load_time: dict[str, float] = {}
        self._started = time.perf_counter()
        self._cpu_started = time.process_time()

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        requests: Sequence[tuple[TraceRequest, Sequence[OffloadKey]]],
        options: ReplayOptions,
        report: ReplayReport,
        kv_bytes_per_token: int,
    ) -> AsyncIterator[ReplayChain]:
        """A fresh chain for `requests` (its tier files in a temporary directory,
        removed after); `finish` fills the report's totals."""
        o = options
        key_bytes = len(requests[0][1][0]) if requests and requests[0][1] else 20
        with tempfile.TemporaryDirectory(prefix="tierkv-trace-", dir=o.directory) as tmp:
            config = parse_config(chain_config(o, Path(tmp), key_bytes))
            longest = max((len(k) for _, k in requests), default=1)
            async with TieredCache(config) as cache:
                chain = cls(cache, report, max(1, longest), TRACE_BLOCK_TOKENS * kv_bytes_per_token)
                yield chain
                await chain.finish()
                if "redis" in o.tiers:  # a shared server outlives the run: leave nothing
                    distinct = list(dict.fromkeys(k for _, ks in requests for k in ks))
                    await cache.tier("redis").remove(distinct)

    async def load_hit(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> Served:
        """`lookup` the request's keys and `load` the hit (the prefix up to the first
        block that failed); count what each medium served."""
        report = self.report
        hit = await self.cache.lookup([keys], ctx)
        load = list(hit.keys_to_load)
        served = Served([], [])
        if load:
            t0 = time.perf_counter()
            result = await self.cache.load(load, self._sink[: len(load)], ctx)
            spent = time.perf_counter() - t0
            ok = set(result.ok_keys)
            for key in load:  # the prefix stops at the first failed block
                if key not in ok:
                    break
                served.keys.append(key)
                served.sources.append(result.sources.get(key, PRIMARY))
            report.failed_loads += len(result.failed_keys)
            by = Counter(served.sources)
            for medium, count in by.items():  # a bandwidth sample per medium:
                # a load served by several is split by their shares of its bytes
                self._load_bytes[medium] += count * report.options.block_bytes
                share = spent * count / len(served.keys)
                self._load_time[medium] = self._load_time.get(medium, 0.0) + share
            report.served_by.update(by)
        report.requests += 1
        report.blocks_asked += len(keys)
        report.blocks_served += len(served.keys)
        return served

    async def store_rest(self, keys: Sequence[OffloadKey], served: int, ctx: ReqContext) -> None:
        """Store the blocks after the hit (prefill computed them) for `ctx`'s tenant and
        let every cascade finish; count evictions."""
        cache = self.cache
        if served < len(keys):
            rest = self._source[: len(keys) - served]
            stored = await cache.store(keys[served:], rest, ctx=ctx)
            self.report.rejected_stores += len(stored.rejected)
        await cache.flush()
        self.count_events()

    def count_events(self) -> None:
        for event in self.cache.take_events():
            if event.removed:
                self.report.evictions[event.medium] += len(event.keys)

    def cost(
        self,
        request: TraceRequest,
        first_ms: float,
        served: Served,
        mediums: Mapping[OffloadKey, str] | None = None,
        prefetched: tuple[PrefetchedBytes, ...] = (),
    ) -> RequestCost:
        """The request's cost-model input; `mediums` overrides the medium of keys a
        prefetch brought into the primary (the tier it read them from)."""
        by: Counter[str] = Counter()
        for key, medium in zip(served.keys, served.sources):
            by[mediums.get(key, medium) if mediums else medium] += 1
        tokens_hit = len(served.keys) * TRACE_BLOCK_TOKENS
        return RequestCost(
            (request.timestamp_ms - first_ms) / 1000.0,
            max(0, request.input_length - tokens_hit),
            {m: c * self.real_block for m, c in by.items()},
            prefetched,
        )

    async def finish(self) -> None:
        """Totals for the report: its time, bytes per tier, measured bandwidths."""
        cache, report = self.cache, self.report
        await cache.flush()
        self.count_events()
        report.seconds = time.perf_counter() - self._started
        report.cpu_seconds = time.process_time() - self._cpu_started
        stats = cache.stats()
        for name, tier in stats.tiers.items():
            report.bytes_written[name] = int(tier["bytes_in"])
            report.blocks_written[name] = int(tier["blocks_stored"])
            report.bytes_read[name] = int(tier["bytes_out"])
            report.declined[name] = int(tier["declined"])
        for counter in PREFETCH_COUNTERS:
            report.prefetch[counter] = int(stats.primary.get(counter, 0))
        report.tenants = {name: dict(counts) for name, counts in stats.tenants.items()}
        for medium, nbytes in self._load_bytes.items():
            if self._load_time.get(medium, 0.0) > 0:
                # measured at this block size: small blocks make it pessimistic for
                # a model's real ones (pass measured figures to the cost model instead)
                report.load_bandwidth[medium] = nbytes / self._load_time[medium]


async def replay(
    requests: Sequence[tuple[TraceRequest, Sequence[OffloadKey]]],
    options: ReplayOptions,
    *,
    kv_bytes_per_token: int = 131_072,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayReport:
    """Replay `requests` (each with its block keys) through a fresh cache, one after
    another: per request `lookup`, `load` the hit, `store` the rest."""
    report = ReplayReport(options)
    if not requests:
        return report
    first = requests[0][0].timestamp_ms
    async with ReplayChain.open(requests, options, report, kv_bytes_per_token) as chain:
        for n, (request, keys) in enumerate(requests):
            ctx = request_context(n, request)
            served = await chain.load_hit(keys, ctx)
            await chain.store_rest(keys, len(served.keys), ctx)
            report.costs.append(chain.cost(request, first, served))
            if progress is not None:
                progress(n + 1, len(requests))
    return report


def request_context(n: int, request: TraceRequest) -> ReqContext:
    """The context of the trace's `n`th request: its id (`r<n>`) and its tenant."""
    return ReqContext(request_id=f"r{n}", tenant=request.tenant)


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
