"""Prometheus metrics for a `TieredCache`, built from `TieredCache.stats()`.

    from tierkv.metrics import serve_metrics

    async with TieredCache(config) as cache, serve_metrics(cache, port=9400):
        ...   # GET http://127.0.0.1:9400/metrics

Every series carries `tier` (the medium: `cpu` for the primary, then each tier's name)
and `namespace`. Counters: lookups, keys looked up, hits, misses, lookup timeouts,
store/load jobs, blocks and bytes stored into / loaded out of the medium, failed keys,
errors, dropped cascades, requests skipped while the circuit was open, blocks claimed
by lookups and claims whose lease ran out. Gauges: jobs and bytes in flight, claims
held, breaker state, primary occupancy. Summaries (count, sum, p50, p99): job latency
and lookup latency per tier. Cache-wide series (`namespace` only): rejected and skipped
store blocks, store waits, dropped write-back blocks, shed promotions,
prefetched, used, cancelled and shed prefetch blocks, dropped events (counters),
background jobs and indexed keys (gauges). Per tenant (`tenant` and `namespace`, from
`stats().tenants`: at most `tenants.report_top` tenants by name, then `other`):
lookups, hit and missed blocks, stored, rejected, loaded and failed blocks, stored and
loaded bytes (counters), bytes held in the primary (gauge).

Needs `prometheus-client` (the `metrics` extra of tierkv-cache), imported when this module
is. The stats are read on the event loop that runs the cache: `serve_metrics` answers
scrapes from that loop (an anyio TCP listener, no thread), because the cache is not
thread-safe. To add the collector to a registry of your own, scrape that registry from
the cache's loop too.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

try:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "tierkv.metrics needs prometheus-client: pip install prometheus-client (the metrics "
        "extra of tierkv-cache)"
    ) from exc

from tierkv.cache import CacheStats, TieredCache
from tierkv.cache.counters import CacheCounters
from tierkv.primary import MEDIUM as PRIMARY_MEDIUM

logger = logging.getLogger(__name__)

PREFIX = "tierkv"

COUNTERS: dict[str, tuple[str, str]] = {
    # stats field -> (metric name without prefix/suffix, help)
    "lookups": ("lookups", "Batched lookup calls answered by the medium"),
    "lookup_keys": ("lookup_keys", "Keys the medium was asked about"),
    "hits": ("hits", "Looked-up keys the medium held"),
    "misses": ("misses", "Looked-up keys the medium did not hold"),
    "lookup_timeouts": ("lookup_timeouts", "Lookups that did not answer in time"),
    "abandoned_lookups": (
        "abandoned_lookups",
        "Lookups left running in the tier at their timeout (their late answers dropped)",
    ),
    "abandoned_jobs": (
        "abandoned_jobs",
        "Loads and stores left running in the tier at their backstop (their slots held "
        "until they return)",
    ),
    "store_jobs": ("store_jobs", "Store jobs run against the medium"),
    "blocks_stored": ("stored_blocks", "Blocks written into the medium"),
    "bytes_in": ("stored_bytes", "Bytes written into the medium"),
    "load_jobs": ("load_jobs", "Load jobs run against the medium"),
    "blocks_loaded": ("loaded_blocks", "Blocks read out of the medium"),
    "bytes_out": ("loaded_bytes", "Bytes read out of the medium"),
    "failed_keys": ("failed_keys", "Keys a job reported failed (load misses included)"),
    "errors": ("errors", "Jobs or lookups that raised or timed out"),
    "deadline_breaches": ("deadline_breaches", "Jobs with no answer by job_timeout + grace"),
    "drops": ("dropped_blocks", "Blocks not cascaded (back-pressure) or not stored (no room)"),
    "skipped_unhealthy": ("skipped_unhealthy", "Requests not sent while the circuit was open"),
    "declined": (
        "declined_blocks",
        "Stored blocks admission (reuse, tinylfu) kept out of the tier",
    ),
    "foreign_blocks": (
        "foreign_blocks",
        "Loads that found a block signed by another trust domain's MAC key (left in place)",
    ),
    "fallback_lookups": (
        "fallback_lookups",
        "Keys asked again because the tier above failed to load them",
    ),
    "fallback_hits": ("fallback_hits", "Keys a fallback lookup found in the medium"),
    "protected": (
        "protected_blocks",
        "Blocks a lookup claimed in the tier, kept from its eviction until their load",
    ),
    "lease_expired": (
        "lease_expired_blocks",
        "Claimed blocks whose claim_lease ran out before their load let them go",
    ),
    "lost_probes": (
        "lost_probes",
        "Half-open probes taken and never reported on (each cost one probe lease)",
    ),
}
GAUGES: dict[str, tuple[str, str]] = {
    "inflight_jobs": ("inflight_jobs", "Jobs running against the medium now"),
    "inflight_bytes": ("inflight_bytes", "Bytes of cascades in flight to the medium"),
    "claims_held": ("claims_held", "Claims on the tier's blocks not yet let go"),
}
SUMMARIES: dict[str, tuple[str, str]] = {
    "job_latency": ("job_latency_seconds", "Latency of store and load jobs"),
    "lookup_latency": ("lookup_latency_seconds", "Latency of batched lookups"),
}
BREAKER_STATES = ("closed", "open", "half_open")
BREAKER_SIDES = {"reads": "read_breaker", "writes": "write_breaker"}
"""Each side's breaker (`tierkv_breaker_side_state{side}`) -> its stats field."""
PRIMARY_GAUGES = ("blocks", "resident", "free", "evictable", "promoting", "write_back_pending")
CACHE_COUNTERS: dict[str, tuple[str, str]] = {
    # cache-wide fields of stats().primary -> (metric name without prefix/suffix, help):
    # the cache's own counters, declared once with their names and help beside them
    **CacheCounters.metrics(),
    "room_wakeups": (
        "room_wakeups",
        "Stores and loads woken because primary room they could use was released",
    ),
    "events_dropped": (
        "events_dropped",
        "Stored/removed events discarded unread (take_events keeps the newest 65,536)",
    ),
}
CACHE_GAUGES: dict[str, tuple[str, str]] = {
    "background_jobs": (
        "background_jobs",
        "Background cascades, promotions and write-backs running now",
    ),
    "indexed_keys": (
        "indexed_keys",
        "Keys in the cache's per-key index (tier locations, dirty, cascading, promoting)",
    ),
    "pinned_bytes": (
        "primary_pinned_bytes",
        "Bytes of the primary slab pinned for CUDA copies (exactly the slab; 0 without CUDA)",
    ),
}


TENANT_COUNTERS: dict[str, tuple[str, str]] = {
    # stats().tenants field -> (metric name without prefix/suffix, help)
    "lookups": ("tenant_lookups", "Lookup calls of the tenant"),
    "hits": (
        "tenant_hits",
        "Blocks of the tenant's lookup hits (the blocks to load; those the GPU holds aside)",
    ),
    "misses": ("tenant_misses", "Blocks the tenant looked up past the hit"),
    "stored_blocks": ("tenant_stored_blocks", "Blocks the tenant's stores placed in the cache"),
    "stored_bytes": ("tenant_stored_bytes", "Bytes the tenant's stores placed in the cache"),
    "rejected_blocks": ("tenant_rejected_blocks", "Blocks the tenant's stores reported rejected"),
    "loaded_blocks": ("tenant_loaded_blocks", "Blocks the tenant's loads copied out"),
    "loaded_bytes": ("tenant_loaded_bytes", "Bytes the tenant's loads copied out"),
    "load_failed_blocks": (
        "tenant_load_failed_blocks",
        "Blocks the tenant's loads reported failed (recomputed)",
    ),
    "evicted_blocks": (
        "tenant_evicted_blocks",
        "Blocks of the tenant's the primary evicted (to make room for any store or promotion)",
    ),
    "declined_blocks": (
        "tenant_declined_blocks",
        "Blocks of the tenant's a quota declined (tenants.quotas), on any tier",
    ),
}
TENANT_GAUGES: dict[str, tuple[str, str]] = {
    "primary_bytes": (
        "tenant_primary_bytes",
        "Bytes of the primary holding the tenant's blocks (the tenant whose store or load "
        "put a block there owns it until it is evicted)",
    ),
}


TENANT_QUOTA_GAUGES: dict[str, tuple[str, str]] = {
    # stats().tenants[t]["quotas"][tier] field -> (metric name, help); labelled by tier
    "held_bytes": (
        "tenant_quota_held_bytes",
        "Bytes of the tier the tenant's blocks fill, on tiers with tenants.quotas",
    ),
    "quota_bytes": ("tenant_quota_bytes", "The tenant's quota on the tier (absent: no cap)"),
}


def _summary(name: str, doc: str) -> Metric:
    return Metric(name, doc, "summary")


class TieredCacheCollector(Collector):
    """A prometheus-client collector over `stats()` of one cache (or any callable
    returning a `CacheStats`); call it from the thread that runs the cache."""

    def __init__(
        self, source: TieredCache | Callable[[], CacheStats], *, namespace: str | None = None
    ) -> None:
        if isinstance(source, TieredCache):
            self._stats: Callable[[], CacheStats] = source.stats
            namespace = namespace if namespace is not None else source.config.namespace
        else:
            self._stats = source
        self.namespace = namespace or ""

    def describe(self) -> Iterable[Metric]:
        return []  # collected fresh each scrape; nothing to check at registration

    def collect(self) -> Iterable[Metric]:
        stats = self._stats()
        media: dict[str, Mapping[str, Any]] = {PRIMARY_MEDIUM: stats.primary, **stats.tiers}
        labels = ["tier", "namespace"]
        counters = {
            f: CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)
            for f, (name, doc) in COUNTERS.items()
        }
        gauges = {
            f: GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)
            for f, (name, doc) in GAUGES.items()
        }
        summaries = {f: _summary(f"{PREFIX}_{name}", doc) for f, (name, doc) in SUMMARIES.items()}
        breaker = GaugeMetricFamily(
            f"{PREFIX}_breaker_state",
            "Circuit breaker of the tier: 1 for its current state",
            labels=[*labels, "state"],
        )
        sides = GaugeMetricFamily(
            f"{PREFIX}_breaker_side_state",
            "Circuit breaker of each side of the tier (reads: lookups and loads; writes: "
            "stores): 1 for its current state. A tier whose writes are open and reads "
            "closed serves what it holds (a full or read-only disk)",
            labels=[*labels, "side", "state"],
        )
        paths = GaugeMetricFamily(
            f"{PREFIX}_data_path",
            "What moves the tier's bytes, where it has a choice (nvme: native, its "
            "compiled core, or python): 1 for the path in use",
            labels=[*labels, "path"],
        )
        for medium, data in media.items():
            values = [medium, self.namespace]
            if data.get("data_path"):
                paths.add_metric([*values, str(data["data_path"])], 1.0)
            for f, family in counters.items():
                if f in data:
                    family.add_metric(values, float(data[f]))
            for f, gauge in gauges.items():
                if f in data:
                    gauge.add_metric(values, float(data[f]))
            for f, summary in summaries.items():
                snap = data.get(f)
                if not snap or medium == PRIMARY_MEDIUM:  # the primary runs no jobs
                    continue
                base = {"tier": medium, "namespace": self.namespace}
                for q, key in (("0.5", "p50_ms"), ("0.99", "p99_ms")):
                    summary.add_sample(summary.name, {**base, "quantile": q}, snap[key] / 1e3)
                count = float(snap["count"])
                summary.add_sample(f"{summary.name}_count", base, count)
                summary.add_sample(f"{summary.name}_sum", base, snap["mean_ms"] / 1e3 * count)
            if medium != PRIMARY_MEDIUM:
                current = str(data.get("breaker", "closed"))
                states = BREAKER_STATES if current in BREAKER_STATES else (*BREAKER_STATES, current)
                for state in states:
                    breaker.add_metric([*values, state], 1.0 if state == current else 0.0)
                for side, field in BREAKER_SIDES.items():
                    now = str(data.get(field, "closed"))
                    states = BREAKER_STATES if now in BREAKER_STATES else (*BREAKER_STATES, now)
                    for state in states:
                        sides.add_metric([*values, side, state], 1.0 if state == now else 0.0)
        primary = GaugeMetricFamily(
            f"{PREFIX}_primary_blocks",
            "Primary slab occupancy by state (blocks = capacity)",
            labels=["state", "namespace"],
        )
        for state in PRIMARY_GAUGES:
            if state in stats.primary:
                primary.add_metric([state, self.namespace], float(stats.primary[state]))
        yield from counters.values()
        yield from gauges.values()
        yield from summaries.values()
        yield breaker
        yield sides
        yield paths
        yield primary
        yield from self._cache_wide(stats.primary)
        yield from self._per_tenant(stats.tenants)

    def _cache_wide(self, data: Mapping[str, Any]) -> Iterable[Metric]:
        """The cache's own counters and gauges (one series each, not per tier)."""
        for f, (name, doc) in CACHE_COUNTERS.items():
            if f in data:
                counter = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["namespace"])
                counter.add_metric([self.namespace], float(data[f]))
                yield counter
        for f, (name, doc) in CACHE_GAUGES.items():
            if f in data:
                gauge = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["namespace"])
                gauge.add_metric([self.namespace], float(data[f]))
                yield gauge

    def _per_tenant(self, tenants: Mapping[str, Mapping[str, Any]]) -> Iterable[Metric]:
        """One series per tenant `stats().tenants` names (bounded there)."""
        if not tenants:
            return
        labels = ["tenant", "namespace"]
        kinds: list[
            tuple[
                dict[str, tuple[str, str]],
                Callable[..., CounterMetricFamily | GaugeMetricFamily],
            ]
        ] = [(TENANT_COUNTERS, CounterMetricFamily), (TENANT_GAUGES, GaugeMetricFamily)]
        for table, family in kinds:
            for f, (name, doc) in table.items():
                metric = family(f"{PREFIX}_{name}", doc, labels=labels)
                for tenant, row in tenants.items():
                    if f in row:
                        metric.add_metric([tenant, self.namespace], float(row[f]))
                yield metric
        quotas = [(t, row["quotas"]) for t, row in tenants.items() if row.get("quotas")]
        if not quotas:
            return
        tier_labels = ["tenant", "namespace", "tier"]
        for f, (name, doc) in TENANT_QUOTA_GAUGES.items():
            gauge = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=tier_labels)
            for tenant, per_tier in quotas:
                for tier, row in per_tier.items():
                    if row.get(f) is not None:
                        gauge.add_metric([tenant, self.namespace, tier], float(row[f]))
            yield gauge
        declined = CounterMetricFamily(
            f"{PREFIX}_tenant_quota_declined_blocks",
            "Blocks of the tenant's a quota of the tier declined (tenants.quotas)",
            labels=tier_labels,
        )
        for tenant, per_tier in quotas:
            for tier, row in per_tier.items():
                declined.add_metric([tenant, self.namespace, tier], float(row["declined_blocks"]))
        yield declined


def registry_for(source: TieredCache | Callable[[], CacheStats]) -> CollectorRegistry:
    """A fresh registry holding the collector of one cache."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TieredCacheCollector(source))
    return registry


@dataclass(frozen=True)
class MetricsServer:
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"


_MAX_REQUEST = 16 << 10


def _response(status: str, body: bytes, content_type: str) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


async def _answer(registry: CollectorRegistry, stream: SocketStream) -> None:
    async with stream:
        try:
            with anyio.fail_after(10):
                head = await BufferedByteReceiveStream(stream).receive_until(
                    b"\r\n\r\n", _MAX_REQUEST
                )
            method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
        except Exception:  # a client that sends garbage or nothing gets dropped
            return
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            reply = _response("405 Method Not Allowed", b"GET only\n", "text/plain")
        elif path in ("/metrics", "/"):
            body = generate_latest(registry)
            reply = _response("200 OK", b"" if method == "HEAD" else body, CONTENT_TYPE_LATEST)
        else:
            reply = _response("404 Not Found", b"try /metrics\n", "text/plain")
        with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await stream.send(reply)


@asynccontextmanager
async def serve_metrics(
    source: TieredCache | Callable[[], CacheStats], *, port: int, host: str = "127.0.0.1"
) -> AsyncIterator[MetricsServer]:
    """Serve the cache's metrics at `http://host:port/metrics` while the block runs.

    `port=0` picks a free port (see the yielded `MetricsServer.port`). Scrapes are
    answered on the calling event loop, so stats are read where the cache runs."""
    registry = registry_for(source)
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    server = MetricsServer(host, listener.extra(anyio.abc.SocketAttribute.local_port))
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, lambda s: _answer(registry, s))
            logger.info("serving tierkv metrics at %s", server.url)
            try:
                yield server
            finally:
                tg.cancel_scope.cancel()
    finally:
        await listener.aclose()
