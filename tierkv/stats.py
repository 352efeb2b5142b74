"""Counters and latency summaries per medium, as `TieredCache.stats()` reports them."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any


def percentile(values: Iterable[float], q: float) -> float:
    """The `q` quantile (0..1) of `values` by nearest rank; 0 when empty."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


class LatencySummary:
    """Count, mean, max and percentiles over the most recent samples (bounded memory)."""

    def __init__(self, window: int = 2048) -> None:
        self._samples: deque[float] = deque(maxlen=window)
        self.count = 0
        self.total = 0.0
        self.max = 0.0

    def add(self, seconds: float) -> None:
        self._samples.append(seconds)
        self.count += 1
        self.total += seconds
        self.max = max(self.max, seconds)

    def percentile(self, q: float) -> float:
        return percentile(self._samples, q)

    def snapshot(self) -> dict[str, float]:
        return {
            "count": self.count,
            "mean_ms": (self.total / self.count * 1e3) if self.count else 0.0,
            "p50_ms": self.percentile(0.50) * 1e3,
            "p99_ms": self.percentile(0.99) * 1e3,
            "max_ms": self.max * 1e3,
        }


@dataclass
class TierStats:
    """What one medium did since the cache opened."""

    lookups: int = 0  # batched lookup calls
    lookup_keys: int = 0
    hits: int = 0
    misses: int = 0
    lookup_timeouts: int = 0
    abandoned_lookups: int = 0  # lookups left behind at their timeout, still running then
    abandoned_jobs: int = 0  # loads and stores left behind at their backstop, still running
    store_jobs: int = 0
    blocks_stored: int = 0
    bytes_in: int = 0  # into this medium
    load_jobs: int = 0
    blocks_loaded: int = 0
    bytes_out: int = 0  # out of this medium
    failed_keys: int = 0  # keys a job reported failed (misses on load included)
    errors: int = 0  # jobs or lookups that raised or timed out
    deadline_breaches: int = 0  # jobs the tier did not answer by job_timeout + grace
    drops: int = 0  # cascades not sent: back-pressure
    skipped_unhealthy: int = 0  # requests not sent: circuit open
    declined: int = 0  # stored blocks admission (reuse, tinylfu) kept out of this tier
    foreign_blocks: int = 0  # loads that found a block signed by another MAC key
    fallback_lookups: int = 0  # keys asked again because a tier above failed to load them
    fallback_hits: int = 0  # ... and found here
    protected: int = 0  # blocks a lookup claimed here (kept from its eviction until loaded)
    lease_expired: int = 0  # ... whose claim_lease ran out before their load let them go
    claims_held: int = 0  # claims not yet let go
    inflight_jobs: int = 0
    inflight_bytes: int = 0
    breaker: str = "closed"  # the worse of the two below (or not_open)
    read_breaker: str = "closed"  # lookups and loads
    write_breaker: str = "closed"  # stores
    serving: str = "read_write"  # read_write, read_only (cannot write), write_only, none
    lost_probes: int = 0  # half-open probes a caller took and never reported on
    data_path: str | None = None  # what moves the tier's bytes, where it has a choice
    job_latency: LatencySummary = field(default_factory=LatencySummary)
    lookup_latency: LatencySummary = field(default_factory=LatencySummary)

    def snapshot(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            f.name: getattr(self, f.name) for f in fields(self) if not f.name.endswith("_latency")
        }
        data["job_latency"] = self.job_latency.snapshot()
        data["lookup_latency"] = self.lookup_latency.snapshot()
        return data
